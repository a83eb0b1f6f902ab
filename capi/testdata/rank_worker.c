/*
 * rank_worker.c: one rank of a tensor-parallel group, as a worker process
 * of an engine would run it, driven line by line by capi's Go tests
 * (ranks_test.go) on stdin, answering on stdout. Its shard is host memory
 * it owns and hands to kvfence (adopted regions), so that it can play the
 * engine: write KV into pages, and look at what the scrub left.
 *
 *   rank_worker CONNECT RANK PAGES PAGE_BYTES REGIONS
 *
 * Commands (one per line) and answers:
 *   step              stepped N | error STATUS message
 *   step-arrived      steps until a batch was launched (10 s at most)
 *   write PAGE BYTE   fills PAGE of every region with BYTE: ok
 *   word PAGE         word HEX UNIFORM: PAGE's first word, and 1 if every
 *                     word of the page in every region is that word
 *   wait MS           ended E STATUS
 *   close             closed STATUS, and exits
 */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvfence.h"

static void answer_error(kvf_status st) {
    char msg[KVF_ERROR_MESSAGE_MAX];
    kvf_last_error_message(msg, sizeof msg, NULL);
    printf("error %s %s\n", kvf_status_name(st), msg);
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s CONNECT RANK PAGES PAGE_BYTES REGIONS\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    int rank = atoi(argv[2]);
    int64_t pages = atoll(argv[3]), page_bytes = atoll(argv[4]);
    int nregions = atoi(argv[5]);
    if (pages <= 0 || page_bytes <= 0 || nregions <= 0 || nregions > 64) {
        fprintf(stderr, "bad shard shape\n");
        return 2;
    }
    uint8_t *mem[64];
    kvf_region regions[64];
    for (int r = 0; r < nregions; r++) {
        mem[r] = malloc((size_t)(pages * page_bytes));
        if (mem[r] == NULL) return 2;
        memset(mem[r], 0xEE, (size_t)(pages * page_bytes)); /* an earlier user's data */
        regions[r] = (kvf_region){.base = (uint64_t)(uintptr_t)mem[r], .stride = page_bytes, .page_bytes = page_bytes, .pages = pages};
    }
    char config[1024];
    snprintf(config, sizeof config, "{\"connect\": \"%s\", \"rank\": %d, \"connect_timeout_ms\": 30000}", argv[1], rank);
    kvf_rank_worker w = 0;
    kvf_status st = kvf_rank_worker_create(config, regions, (size_t)nregions, &w);
    if (st != KVF_OK) {
        answer_error(st);
        return 1;
    }
    printf("ready\n");

    char line[256];
    while (fgets(line, sizeof line, stdin) != NULL) {
        long long a = 0, b = 0;
        if (strncmp(line, "step-arrived", 12) == 0) {
            size_t n = 0;
            struct timespec pause = {0, 2000000};
            for (int i = 0; i < 5000 && (st = kvf_rank_step(w, KVF_STREAM_LEGACY, 0, &n)) == KVF_OK && n == 0; i++) {
                nanosleep(&pause, NULL);
            }
            if (st != KVF_OK) answer_error(st);
            else printf("stepped %zu\n", n);
        } else if (strncmp(line, "step", 4) == 0) {
            size_t n = 0;
            if ((st = kvf_rank_step(w, KVF_STREAM_LEGACY, 0, &n)) != KVF_OK) answer_error(st);
            else printf("stepped %zu\n", n);
        } else if (sscanf(line, "write %lld %lld", &a, &b) == 2 && a >= 0 && a < pages) {
            for (int r = 0; r < nregions; r++) memset(mem[r] + a * page_bytes, (int)b, (size_t)page_bytes);
            printf("ok\n");
        } else if (sscanf(line, "word %lld", &a) == 1 && a >= 0 && a < pages) {
            uint32_t first, x;
            memcpy(&first, mem[0] + a * page_bytes, 4);
            int uniform = 1;
            for (int r = 0; r < nregions; r++) {
                for (int64_t off = 0; off < page_bytes; off += 4) {
                    memcpy(&x, mem[r] + a * page_bytes + off, 4);
                    uniform &= x == first;
                }
            }
            printf("word %08" PRIx32 " %d\n", first, uniform);
        } else if (sscanf(line, "wait %lld", &a) == 1) {
            int32_t ended = -1;
            st = kvf_rank_worker_wait(w, a, &ended);
            printf("ended %d %s\n", (int)ended, kvf_status_name(st));
        } else if (strncmp(line, "close", 5) == 0) {
            break;
        } else {
            printf("unknown command %s", line);
        }
    }
    st = kvf_rank_worker_close(w);
    printf("closed %s\n", kvf_status_name(st));
    for (int r = 0; r < nregions; r++) free(mem[r]); /* after the close: kvfence no longer touches it */
    return 0;
}
