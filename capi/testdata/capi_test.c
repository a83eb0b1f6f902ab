/*
 * capi_test.c (with capi_test_v2.inc to _v13.inc) drives every
 * function of kvfence.h, every bad-input case the header documents, and
 * concurrent use from several threads. It exits 0 if
 * every check passed; each failed check prints its line and the library's
 * last error. Built and run by capi's Go tests and scripts/ci-capi.sh (also
 * under valgrind).
 *
 *   gcc -std=c11 -Wall -Wextra -Werror -I capi/include capi/testdata/capi_test.c \
 *       -L capi -lkvfence -lpthread -o capi_test
 */
#define _POSIX_C_SOURCE 200809L
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvfence.h"

static int failures;
static int checks;

static void report(const char *file, int line, const char *what) {
    char msg[KVF_ERROR_MESSAGE_MAX];
    kvf_error_info info;
    kvf_last_error(&info);
    kvf_last_error_message(msg, sizeof msg, NULL);
    fprintf(stderr, "%s:%d: FAIL %s\n    last error: %s (%s)\n", file, line, what,
            kvf_status_name(info.status), msg);
    failures++;
}

/* EXPECT runs a call and compares its status. */
#define EXPECT(call, want)                                                              \
    do {                                                                                \
        kvf_status got_ = (call);                                                       \
        checks++;                                                                       \
        if (got_ != (want)) {                                                           \
            char what_[512];                                                            \
            snprintf(what_, sizeof what_, "%s returned %s, want %s", #call,            \
                     kvf_status_name(got_), kvf_status_name(want));                     \
            report(__FILE__, __LINE__, what_);                                          \
        }                                                                               \
    } while (0)

#define CHECK(cond)                                                                     \
    do {                                                                                \
        checks++;                                                                       \
        if (!(cond)) report(__FILE__, __LINE__, #cond);                                 \
    } while (0)

/* last error helpers */
static kvf_error_info last(void) {
    kvf_error_info info;
    memset(&info, 0xff, sizeof info);
    kvf_last_error(&info);
    return info;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int last_message_contains(const char *needle) {
    char msg[KVF_ERROR_MESSAGE_MAX];
    if (kvf_last_error_message(msg, sizeof msg, NULL) != KVF_OK) return 0;
    return strstr(msg, needle) != NULL;
}

/* 2 layers x K/V, 2 KV heads, head dim 8, fp16, 16 tokens per page:
 * 64 pages = 1024 tokens = max context. */
static const char *good_config =
    "{\"geometry\": {\"tokens_per_page\": 16, \"layers\": 2, \"kv_heads\": 2,"
    "  \"head_dim\": 8, \"dtype\": \"fp16\"},"
    " \"pages\": 64, \"max_context_tokens\": 1024,"
    " \"tenants\": [{\"name\": \"acme\", \"quota_pages\": 32}, {\"name\": \"globex\"}],"
    " \"scrub\": {\"kind\": \"poison\", \"pattern\": \"0x8000\"}}";

static void test_library(void) {
    CHECK(kvf_abi_version() == KVF_ABI_VERSION);
    CHECK(kvf_version() != NULL && strlen(kvf_version()) > 0);

    static const struct { kvf_status s; const char *name; } names[] = {
        {KVF_OK, "KVF_OK"},
        {KVF_ERR_INVALID_ARGUMENT, "KVF_ERR_INVALID_ARGUMENT"},
        {KVF_ERR_NULL_POINTER, "KVF_ERR_NULL_POINTER"},
        {KVF_ERR_INVALID_HANDLE, "KVF_ERR_INVALID_HANDLE"},
        {KVF_ERR_BUFFER_TOO_SMALL, "KVF_ERR_BUFFER_TOO_SMALL"},
        {KVF_ERR_INTERNAL, "KVF_ERR_INTERNAL"},
        {KVF_ERR_INVALID_CONFIG, "KVF_ERR_INVALID_CONFIG"},
        {KVF_ERR_UNDERSIZED_POOL, "KVF_ERR_UNDERSIZED_POOL"},
        {KVF_ERR_INVALID_REQUEST, "KVF_ERR_INVALID_REQUEST"},
        {KVF_ERR_UNKNOWN_TENANT, "KVF_ERR_UNKNOWN_TENANT"},
        {KVF_ERR_DUPLICATE_REQUEST, "KVF_ERR_DUPLICATE_REQUEST"},
        {KVF_ERR_EXCEEDS_MAX_CONTEXT, "KVF_ERR_EXCEEDS_MAX_CONTEXT"},
        {KVF_ERR_EXCEEDS_CAPACITY, "KVF_ERR_EXCEEDS_CAPACITY"},
        {KVF_ERR_EXCEEDS_QUOTA, "KVF_ERR_EXCEEDS_QUOTA"},
        {KVF_ERR_POOL_EXHAUSTED, "KVF_ERR_POOL_EXHAUSTED"},
        {KVF_ERR_POOL_CLOSED, "KVF_ERR_POOL_CLOSED"},
        {KVF_ERR_POOL_FAULTED, "KVF_ERR_POOL_FAULTED"},
        {KVF_ERR_LEASE_RELEASED, "KVF_ERR_LEASE_RELEASED"},
        {KVF_ERR_SCRUB_FAILED, "KVF_ERR_SCRUB_FAILED"},
        {KVF_ERR_CANARY_MISMATCH, "KVF_ERR_CANARY_MISMATCH"},
        {KVF_ERR_INVALID_TENANT, "KVF_ERR_INVALID_TENANT"},
        {KVF_ERR_DUPLICATE_TENANT, "KVF_ERR_DUPLICATE_TENANT"},
        {KVF_ERR_OVER_RESERVED, "KVF_ERR_OVER_RESERVED"},
        {KVF_ERR_NO_DEVICE, "KVF_ERR_NO_DEVICE"},
        {KVF_ERR_DEVICE_OUT_OF_MEMORY, "KVF_ERR_DEVICE_OUT_OF_MEMORY"},
        {KVF_ERR_DEVICE_FAILED, "KVF_ERR_DEVICE_FAILED"},
        {KVF_ERR_BAD_ORDERING, "KVF_ERR_BAD_ORDERING"},
        {KVF_ERR_LEASE_PHASE, "KVF_ERR_LEASE_PHASE"},
        {KVF_ERR_RECLAIMED, "KVF_ERR_RECLAIMED"},
        {KVF_ERR_STALE_TRANSFER, "KVF_ERR_STALE_TRANSFER"},
        {KVF_ERR_DUPLICATE_PAGE, "KVF_ERR_DUPLICATE_PAGE"},
        {KVF_ERR_INCOMPLETE_TRANSFER, "KVF_ERR_INCOMPLETE_TRANSFER"},
        {KVF_ERR_CHECKSUM_MISMATCH, "KVF_ERR_CHECKSUM_MISMATCH"},
        {KVF_ERR_MALFORMED_MANIFEST, "KVF_ERR_MALFORMED_MANIFEST"},
        {KVF_ERR_BAD_MAC, "KVF_ERR_BAD_MAC"},
        {KVF_ERR_MANIFEST_EXPIRED, "KVF_ERR_MANIFEST_EXPIRED"},
        {KVF_ERR_GEOMETRY_MISMATCH, "KVF_ERR_GEOMETRY_MISMATCH"},
        {KVF_ERR_DOMAIN_MISMATCH, "KVF_ERR_DOMAIN_MISMATCH"},
        {KVF_ERR_REPLAY, "KVF_ERR_REPLAY"},
        {KVF_ERR_IN_PROGRESS, "KVF_ERR_IN_PROGRESS"},
        {KVF_ERR_SHARD_MISMATCH, "KVF_ERR_SHARD_MISMATCH"},
        {KVF_ERR_NO_STATE_GROUP, "KVF_ERR_NO_STATE_GROUP"},
        {KVF_ERR_CHECKPOINT_CAPACITY, "KVF_ERR_CHECKPOINT_CAPACITY"},
        {KVF_ERR_TRANSPORT, "KVF_ERR_TRANSPORT"},
        {KVF_ERR_PROTOCOL, "KVF_ERR_PROTOCOL"},
        {KVF_ERR_UNAVAILABLE, "KVF_ERR_UNAVAILABLE"},
        {KVF_ERR_TIER_UNSUPPORTED, "KVF_ERR_TIER_UNSUPPORTED"},
        {KVF_ERR_ONLOAD_FAILED, "KVF_ERR_ONLOAD_FAILED"},
        {KVF_ERR_OFFLOAD_FAILED, "KVF_ERR_OFFLOAD_FAILED"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        CHECK(strcmp(kvf_status_name(names[i].s), names[i].name) == 0);
    }
    CHECK(strcmp(kvf_status_name(9999), "KVF_ERR_UNKNOWN_STATUS") == 0);

    /* Before any failure the last error is empty. */
    kvf_error_info info = last();
    CHECK(info.status == KVF_OK && info.message_len == 0);
    char msg[8] = "xxxxxxx";
    size_t needed = 0;
    EXPECT(kvf_last_error_message(msg, sizeof msg, &needed), KVF_OK);
    CHECK(needed == 1 && msg[0] == '\0');
    EXPECT(kvf_last_error(NULL), KVF_ERR_NULL_POINTER);
    EXPECT(kvf_last_error_message(NULL, 4, NULL), KVF_ERR_NULL_POINTER);
}

static void test_pool_create(void) {
    kvf_pool pool = 0;
    static const struct { const char *json; kvf_status want; const char *msg; } cases[] = {
        {"", KVF_ERR_INVALID_CONFIG, "config JSON"},
        {"{", KVF_ERR_INVALID_CONFIG, "config JSON"},
        {"[]", KVF_ERR_INVALID_CONFIG, "config JSON"},
        {"{\"geometry\": {\"tokens_per_page\": 16, \"layers\": 2, \"kv_heads\": 2, \"head_dim\": 8,"
         " \"dtype\": \"fp16\"}, \"pages\": 64, \"max_context_tokens\": 1024, \"colour\": 1}",
         KVF_ERR_INVALID_CONFIG, "unknown field \"colour\""},
        {"{\"geometry\": {\"tokens_per_page\": 16, \"layers\": 2, \"kv_heads\": 2, \"head_dim\": 8,"
         " \"dtype\": \"fp64\"}, \"pages\": 64, \"max_context_tokens\": 1024}",
         KVF_ERR_INVALID_CONFIG, "fp64"},
        {"{\"geometry\": {\"tokens_per_page\": 0, \"layers\": 2, \"kv_heads\": 2, \"head_dim\": 8,"
         " \"dtype\": \"fp16\"}, \"pages\": 64, \"max_context_tokens\": 1024}",
         KVF_ERR_INVALID_CONFIG, "TokensPerPage"},
        {"{\"geometry\": {\"tokens_per_page\": 16, \"layers\": 2, \"kv_heads\": 2, \"head_dim\": 8,"
         " \"dtype\": \"fp16\"}, \"pages\": 64, \"pool_bytes\": 65536, \"max_context_tokens\": 1024}",
         KVF_ERR_INVALID_CONFIG, "not both"},
        {"{\"geometry\": {\"tokens_per_page\": 16, \"layers\": 2, \"kv_heads\": 2, \"head_dim\": 8,"
         " \"dtype\": \"fp16\"}, \"pages\": 64, \"max_context_tokens\": 1024,"
         " \"scrub\": {\"kind\": \"poison\", \"pattern\": \"0x7e00\"}}",
         KVF_ERR_INVALID_CONFIG, "not a finite number"},
        {"{\"geometry\": {\"tokens_per_page\": 16, \"layers\": 2, \"kv_heads\": 2, \"head_dim\": 8,"
         " \"dtype\": \"fp16\"}, \"pages\": 64, \"max_context_tokens\": 1024,"
         " \"tenants\": [{\"name\": \"a\"}, {\"name\": \"a\"}]}",
         KVF_ERR_INVALID_CONFIG, "already registered"},
        /* An absurd size is refused with the bytes it needs, before any
         * allocation: 2^31 - 1 pages of 8 KiB would be 16 TiB. */
        {"{\"geometry\": {\"tokens_per_page\": 16, \"layers\": 1, \"kv_heads\": 1, \"head_dim\": 128,"
         " \"dtype\": \"fp16\"}, \"pages\": 2147483647, \"max_context_tokens\": 1048576}",
         KVF_ERR_INVALID_CONFIG, "bytes of host memory"},
        /* The incident: a 1M-token model on a pool of 681,280 tokens. */
        {"{\"geometry\": {\"tokens_per_page\": 16, \"layers\": 1, \"kv_heads\": 1, \"head_dim\": 2,"
         " \"dtype\": \"fp16\"}, \"pages\": 42580, \"max_context_tokens\": 1048576}",
         KVF_ERR_UNDERSIZED_POOL, "pool holds 681280 tokens"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        pool = 0;
        EXPECT(kvf_pool_create(cases[i].json, &pool), cases[i].want);
        CHECK(pool == 0);
        CHECK(last().status == cases[i].want);
        if (!last_message_contains(cases[i].msg)) {
            fprintf(stderr, "  case %zu: message lacks %s\n", i, cases[i].msg);
            CHECK(0);
        }
    }
    EXPECT(kvf_pool_create(NULL, &pool), KVF_ERR_NULL_POINTER);
    EXPECT(kvf_pool_create(good_config, NULL), KVF_ERR_NULL_POINTER);

    /* The same undersized pool, opted in: it refuses long requests instead. */
    EXPECT(kvf_pool_create("{\"geometry\": {\"tokens_per_page\": 16, \"layers\": 1, \"kv_heads\": 1,"
                           " \"head_dim\": 2, \"dtype\": \"fp16\"}, \"pages\": 64,"
                           " \"max_context_tokens\": 4096, \"allow_undersized_pool\": true,"
                           " \"tenants\": [{\"name\": \"t\"}]}",
                           &pool),
           KVF_OK);
    CHECK(pool != 0);
    kvf_lease lease = 0;
    EXPECT(kvf_admit(pool, "long", "t", 2000, 0, 0, &lease), KVF_ERR_EXCEEDS_CAPACITY);
    kvf_error_info info = last();
    CHECK(info.need == 125 && info.limit == 64 && info.need_tokens == 2000 && info.limit_tokens == 1024);
    CHECK(info.permanent == 1 && info.retryable == 0);
    CHECK(lease == 0);
    EXPECT(kvf_pool_check(pool), KVF_OK);
    EXPECT(kvf_pool_destroy(pool), KVF_OK);
}

static void test_tenants(kvf_pool pool) {
    EXPECT(kvf_pool_add_tenant(pool, "initech", 16, 4), KVF_OK);
    EXPECT(kvf_pool_add_tenant(pool, "initech", 16, 4), KVF_ERR_DUPLICATE_TENANT);
    EXPECT(kvf_pool_add_tenant(pool, "", 16, 0), KVF_ERR_INVALID_TENANT);
    EXPECT(kvf_pool_add_tenant(pool, "neg", -1, 0), KVF_ERR_INVALID_TENANT);
    EXPECT(kvf_pool_add_tenant(pool, "big", 8, 9), KVF_ERR_INVALID_TENANT);
    EXPECT(kvf_pool_add_tenant(pool, "hog", 0, 61), KVF_ERR_OVER_RESERVED);
    CHECK(last_message_contains("65 pages reserved"));
    EXPECT(kvf_pool_add_tenant(pool, NULL, 1, 0), KVF_ERR_NULL_POINTER);
    EXPECT(kvf_pool_add_tenant(0, "x", 1, 0), KVF_ERR_INVALID_HANDLE);
    EXPECT(kvf_pool_update_tenant(pool, "initech", 16, 0), KVF_OK);
    EXPECT(kvf_pool_update_tenant(pool, "nobody", 16, 0), KVF_ERR_UNKNOWN_TENANT);
    EXPECT(kvf_pool_update_tenant(pool, "initech", 4, 8), KVF_ERR_INVALID_TENANT);
    EXPECT(kvf_pool_update_tenant(pool, NULL, 4, 0), KVF_ERR_NULL_POINTER);
    EXPECT(kvf_pool_update_tenant(pool + 1000, "initech", 4, 0), KVF_ERR_INVALID_HANDLE);
}

static void test_admission(kvf_pool pool) {
    kvf_lease a = 0, b = 0, junk = 0;
    kvf_error_info info;

    EXPECT(kvf_admit(pool, "r1", "acme", 100, 28, 0, NULL), KVF_ERR_NULL_POINTER);
    EXPECT(kvf_admit(pool, NULL, "acme", 100, 28, 0, &junk), KVF_ERR_NULL_POINTER);
    EXPECT(kvf_admit(pool, "r1", NULL, 100, 28, 0, &junk), KVF_ERR_NULL_POINTER);
    EXPECT(kvf_admit(0, "r1", "acme", 100, 28, 0, &junk), KVF_ERR_INVALID_HANDLE);
    EXPECT(kvf_admit(123456789, "r1", "acme", 100, 28, 0, &junk), KVF_ERR_INVALID_HANDLE);
    EXPECT(kvf_admit(pool, "", "acme", 100, 28, 0, &junk), KVF_ERR_INVALID_REQUEST);
    EXPECT(kvf_admit(pool, "r1", "acme", 0, 28, 0, &junk), KVF_ERR_INVALID_REQUEST);
    EXPECT(kvf_admit(pool, "r1", "acme", 10, -1, 0, &junk), KVF_ERR_INVALID_REQUEST);
    EXPECT(kvf_admit(pool, "r1", "acme", INT64_MAX, INT64_MAX, 0, &junk), KVF_ERR_INVALID_REQUEST);
    EXPECT(kvf_admit(pool, "r1", "nobody", 100, 28, 0, &junk), KVF_ERR_UNKNOWN_TENANT);
    EXPECT(kvf_admit(pool, "r1", "acme", 100, 28, -5, &junk), KVF_ERR_INVALID_ARGUMENT);

    EXPECT(kvf_admit(pool, "r1", "acme", 2000, 48, 0, &junk), KVF_ERR_EXCEEDS_MAX_CONTEXT);
    info = last();
    CHECK(info.need == 2048 && info.limit == 1024 && info.permanent == 1);

    /* acme's quota is 32 pages; 600 tokens are 38. */
    EXPECT(kvf_admit(pool, "r1", "acme", 600, 0, 0, &junk), KVF_ERR_EXCEEDS_QUOTA);
    info = last();
    CHECK(info.need == 38 && info.limit == 32 && info.permanent == 1 && info.retryable == 0);
    CHECK(last_message_contains("quota"));
    CHECK(junk == 0);

    EXPECT(kvf_admit(pool, "r1", "acme", 100, 28, 0, &a), KVF_OK); /* 8 pages */
    CHECK(a != 0);
    EXPECT(kvf_admit(pool, "r1", "globex", 16, 0, 0, &junk), KVF_ERR_DUPLICATE_REQUEST);
    EXPECT(kvf_admit(pool, "r2", "globex", 500, 0, 0, &b), KVF_OK); /* 32 pages */

    /* 24 pages left: globex asks for 32, within its quota (64, 32 used).
     * wait_ms = 0 refuses at once; wait_ms = 20 waits that long first. */
    double t0 = now_seconds();
    EXPECT(kvf_admit(pool, "r3", "globex", 512, 0, 0, &junk), KVF_ERR_POOL_EXHAUSTED);
    CHECK(now_seconds() - t0 < 2.0);
    info = last();
    CHECK(info.need == 32 && info.have == 24 && info.limit == 64 && info.retryable == 1 && info.permanent == 0);
    t0 = now_seconds();
    EXPECT(kvf_admit(pool, "r3", "globex", 512, 0, 20, &junk), KVF_ERR_POOL_EXHAUSTED);
    CHECK(now_seconds() - t0 >= 0.020);
    /* 64 more would pass its quota, but its quota is the whole pool: what
     * it waits for is pages, so the refusal says the pool (a scheduler
     * keeps the request in line instead of letting smaller ones pass). */
    EXPECT(kvf_admit(pool, "r3", "globex", 1024, 0, 0, &junk), KVF_ERR_POOL_EXHAUSTED);
    info = last();
    CHECK(info.need == 64 && info.have == 24 && info.limit == 64 && info.retryable == 1 && info.permanent == 0);

    /* Block table: size query, short buffer, NULL buffer, success. */
    size_t n = 99;
    EXPECT(kvf_lease_block_table(a, NULL, 0, &n), KVF_ERR_BUFFER_TOO_SMALL);
    CHECK(n == 8 && last().need == 8 && last().have == 0);
    int32_t small[4] = {-7, -7, -7, -7};
    EXPECT(kvf_lease_block_table(a, small, 4, &n), KVF_ERR_BUFFER_TOO_SMALL);
    CHECK(n == 8 && small[0] == -7 && small[3] == -7);
    EXPECT(kvf_lease_block_table(a, NULL, 8, &n), KVF_ERR_NULL_POINTER);
    int32_t ta[16], tb[40];
    EXPECT(kvf_lease_block_table(a, ta, 16, &n), KVF_OK);
    CHECK(n == 8);
    EXPECT(kvf_lease_block_table(b, tb, 40, NULL), KVF_OK);
    for (int i = 0; i < 8; i++) {
        CHECK(ta[i] >= 0 && ta[i] < 64);
        for (int j = 0; j < 32; j++) CHECK(ta[i] != tb[j]); /* tenants never share a page */
    }
    EXPECT(kvf_lease_block_table(pool, ta, 16, &n), KVF_ERR_INVALID_HANDLE); /* a pool is not a lease */

    /* Slot mapping. */
    int64_t slots[20];
    EXPECT(kvf_lease_slot_mapping(a, 0, 20, slots, 20, &n), KVF_OK);
    CHECK(n == 20);
    for (int t = 0; t < 20; t++) CHECK(slots[t] == (int64_t)ta[t / 16] * 16 + t % 16);
    EXPECT(kvf_lease_slot_mapping(a, 0, 20, slots, 10, &n), KVF_ERR_BUFFER_TOO_SMALL);
    CHECK(n == 20);
    EXPECT(kvf_lease_slot_mapping(a, 120, 129, slots, 20, &n), KVF_ERR_INVALID_ARGUMENT);
    EXPECT(kvf_lease_slot_mapping(a, 5, 4, slots, 20, &n), KVF_ERR_INVALID_ARGUMENT);
    EXPECT(kvf_lease_slot_mapping(a, -1, 4, slots, 20, &n), KVF_ERR_INVALID_ARGUMENT);
    CHECK(n == 0);
    EXPECT(kvf_lease_slot_mapping(a, INT64_MIN, INT64_MAX, slots, 20, &n), KVF_ERR_INVALID_ARGUMENT);
    CHECK(n == 0); /* not the wrapped difference, SIZE_MAX */
    EXPECT(kvf_lease_slot_mapping(a, 0, 4, NULL, 4, &n), KVF_ERR_NULL_POINTER);

    /* Commit and describe. */
    EXPECT(kvf_lease_commit(a, 10), KVF_OK);
    EXPECT(kvf_lease_commit(a, 5), KVF_ERR_INVALID_ARGUMENT);
    EXPECT(kvf_lease_commit(a, 129), KVF_ERR_INVALID_ARGUMENT);
    EXPECT(kvf_lease_commit(a, 128), KVF_OK);
    kvf_lease_info li;
    EXPECT(kvf_lease_describe(a, &li), KVF_OK);
    CHECK(li.pages == 8 && li.capacity_tokens == 128 && li.prompt_tokens == 100 && li.max_new_tokens == 28);
    CHECK(li.written_tokens == 128 && li.live == 1);
    EXPECT(kvf_lease_describe(a, NULL), KVF_ERR_NULL_POINTER);

    /* Stats JSON: size query, short buffer, success. */
    size_t need = 0;
    EXPECT(kvf_pool_stats_json(pool, NULL, 0, &need), KVF_ERR_BUFFER_TOO_SMALL);
    CHECK(need > 100);
    char *js = malloc(need);
    memset(js, 'z', need);
    EXPECT(kvf_pool_stats_json(pool, js, need - 1, NULL), KVF_ERR_BUFFER_TOO_SMALL);
    CHECK(js[0] == 'z');
    EXPECT(kvf_pool_stats_json(pool, js, need, &need), KVF_OK);
    CHECK(strlen(js) == need - 1);
    CHECK(strstr(js, "\"live_leases\":2") != NULL);
    CHECK(strstr(js, "\"in_use_pages\":40") != NULL);
    CHECK(strstr(js, "\"exceeds_quota\":1") != NULL);
    CHECK(strstr(js, "\"pool_exhausted\":3") != NULL);
    free(js);
    EXPECT(kvf_pool_stats_json(pool, NULL, 5, NULL), KVF_ERR_NULL_POINTER);
    EXPECT(kvf_pool_check(pool), KVF_OK);

    /* Release with engine ordering (host pools accept and ignore it). */
    EXPECT(kvf_lease_release(a, (uintptr_t)0x1234, (uintptr_t)0x5678), KVF_OK);
    EXPECT(kvf_lease_release(a, 0, 0), KVF_ERR_LEASE_RELEASED);
    EXPECT(kvf_lease_block_table(a, ta, 16, &n), KVF_ERR_LEASE_RELEASED);
    EXPECT(kvf_lease_slot_mapping(a, 0, 4, slots, 20, &n), KVF_ERR_LEASE_RELEASED);
    EXPECT(kvf_lease_commit(a, 128), KVF_ERR_LEASE_RELEASED);
    EXPECT(kvf_lease_describe(a, &li), KVF_OK);
    CHECK(li.live == 0);
    EXPECT(kvf_lease_free(a), KVF_OK);
    EXPECT(kvf_lease_free(a), KVF_ERR_INVALID_HANDLE);
    EXPECT(kvf_lease_release(a, 0, 0), KVF_ERR_INVALID_HANDLE);
    EXPECT(kvf_lease_describe(a, &li), KVF_ERR_INVALID_HANDLE);
    EXPECT(kvf_lease_free(0), KVF_ERR_INVALID_HANDLE);
    EXPECT(kvf_lease_free(pool), KVF_ERR_INVALID_HANDLE);

    /* Freeing a live lease releases it; its ID is free again. */
    EXPECT(kvf_lease_free(b), KVF_OK);
    EXPECT(kvf_admit(pool, "r2", "globex", 1024, 0, 0, &b), KVF_OK);
    EXPECT(kvf_lease_free(b), KVF_OK);
    EXPECT(kvf_pool_check(pool), KVF_OK);
    EXPECT(kvf_pool_clear_fault(pool), KVF_OK);
    EXPECT(kvf_pool_clear_fault(0), KVF_ERR_INVALID_HANDLE);
    EXPECT(kvf_pool_check(0), KVF_ERR_INVALID_HANDLE);
}

static void test_last_error_message(void) {
    kvf_lease junk;
    EXPECT(kvf_admit(0, "r", "t", 1, 0, 0, &junk), KVF_ERR_INVALID_HANDLE);
    size_t needed = 0;
    char tiny[8];
    EXPECT(kvf_last_error_message(tiny, sizeof tiny, &needed), KVF_ERR_BUFFER_TOO_SMALL);
    CHECK(needed > sizeof tiny && strlen(tiny) == sizeof tiny - 1);
    CHECK(strncmp(tiny, "KVF_ERR", 7) == 0);
    EXPECT(kvf_last_error_message(NULL, 0, &needed), KVF_ERR_BUFFER_TOO_SMALL);
    /* Successful calls and the error getters leave the last error alone. */
    CHECK(strcmp(kvf_version(), "") != 0);
    kvf_error_info info = last();
    CHECK(info.status == KVF_ERR_INVALID_HANDLE && info.message_len + 1 == needed);
    char *full = malloc(needed);
    EXPECT(kvf_last_error_message(full, needed, NULL), KVF_OK);
    CHECK(strlen(full) + 1 == needed && strstr(full, "invalid handle") != NULL);
    free(full);
}

static void test_destroy(void) {
    kvf_pool pool = 0;
    kvf_lease l = 0, junk = 0;
    EXPECT(kvf_pool_create(good_config, &pool), KVF_OK);
    EXPECT(kvf_admit(pool, "r", "acme", 64, 0, 0, &l), KVF_OK);
    EXPECT(kvf_pool_destroy(pool), KVF_OK);
    EXPECT(kvf_pool_destroy(pool), KVF_ERR_INVALID_HANDLE);
    EXPECT(kvf_admit(pool, "r2", "acme", 64, 0, 0, &junk), KVF_ERR_INVALID_HANDLE);
    EXPECT(kvf_pool_stats_json(pool, NULL, 0, NULL), KVF_ERR_INVALID_HANDLE);
    EXPECT(kvf_pool_add_tenant(pool, "x", 0, 0), KVF_ERR_INVALID_HANDLE);
    /* The lease was released by the destroy; its handle lives until freed. */
    int32_t t[4];
    EXPECT(kvf_lease_block_table(l, t, 4, NULL), KVF_ERR_LEASE_RELEASED);
    EXPECT(kvf_lease_release(l, 0, 0), KVF_ERR_POOL_CLOSED);
    EXPECT(kvf_lease_free(l), KVF_OK);
}

/* Threads: each admits and releases under its own tenant and request IDs,
 * and checks that its last error is its own. */
#define THREADS 4
#define ROUNDS 300

struct worker {
    kvf_pool pool;
    int id;
    int errors;
};

static void *work(void *arg) {
    struct worker *w = arg;
    char tenant[32], req[64];
    snprintf(tenant, sizeof tenant, "tenant-%d", w->id);
    int32_t table[8];
    for (int i = 0; i < ROUNDS; i++) {
        kvf_lease l = 0;
        snprintf(req, sizeof req, "w%d-r%d", w->id, i);
        kvf_status st = kvf_admit(w->pool, req, tenant, 16 * (1 + i % 4), 0, 1000, &l);
        if (st != KVF_OK) {
            w->errors++;
            continue;
        }
        size_t n = 0;
        if (kvf_lease_block_table(l, table, 8, &n) != KVF_OK || n != (size_t)(1 + i % 4)) w->errors++;
        /* A failure private to this thread. */
        if (kvf_lease_commit(l, -(w->id + 1)) != KVF_ERR_INVALID_ARGUMENT) w->errors++;
        char msg[256];
        snprintf(req, sizeof req, "commit of %d tokens", -(w->id + 1));
        kvf_last_error_message(msg, sizeof msg, NULL);
        if (strstr(msg, req) == NULL) w->errors++;
        if (i % 2 == 0) {
            if (kvf_lease_release(l, 0, 0) != KVF_OK) w->errors++;
        }
        if (kvf_lease_free(l) != KVF_OK) w->errors++;
    }
    return NULL;
}

static void test_threads(void) {
    kvf_pool pool = 0;
    EXPECT(kvf_pool_create(good_config, &pool), KVF_OK);
    pthread_t th[THREADS];
    struct worker w[THREADS];
    for (int i = 0; i < THREADS; i++) {
        char name[32];
        snprintf(name, sizeof name, "tenant-%d", i);
        EXPECT(kvf_pool_add_tenant(pool, name, 16, 0), KVF_OK);
        w[i] = (struct worker){.pool = pool, .id = i};
        CHECK(pthread_create(&th[i], NULL, work, &w[i]) == 0);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(th[i], NULL);
        if (w[i].errors != 0) fprintf(stderr, "worker %d: %d errors\n", i, w[i].errors);
        CHECK(w[i].errors == 0);
    }
    EXPECT(kvf_pool_check(pool), KVF_OK);
    size_t need = 0;
    kvf_pool_stats_json(pool, NULL, 0, &need);
    char *js = malloc(need);
    EXPECT(kvf_pool_stats_json(pool, js, need, NULL), KVF_OK);
    CHECK(strstr(js, "\"in_use_pages\":0") != NULL && strstr(js, "\"live_leases\":0") != NULL);
    CHECK(strstr(js, "\"admitted\":1200") != NULL);
    free(js);
    EXPECT(kvf_pool_destroy(pool), KVF_OK);
}

/* Strings longer than the library reads (1 MiB, the limit on a JSON
 * document) are refused with the status the header gives a bad value of
 * that argument, not a boundary error, and change nothing; a config of
 * exactly 1 MiB is parsed. */
static void test_long_strings(void) {
    enum { LIMIT = 1 << 20, BIG = 2 << 20 };
    char *cfg = malloc(BIG + 1), *name = malloc(BIG + 1), *tenant_js = malloc(BIG + 1);
    size_t n = strlen(good_config);
    memcpy(cfg, good_config, n);
    memset(cfg + n, ' ', BIG - n);
    cfg[BIG] = '\0';
    memset(name, 'x', BIG);
    name[BIG] = '\0';
    static const char tj[] = "{\"name\": \"big\"}";
    memcpy(tenant_js, tj, sizeof tj - 1);
    memset(tenant_js + sizeof tj - 1, ' ', BIG - (sizeof tj - 1));
    tenant_js[BIG] = '\0';

    kvf_pool pool = 0;
    EXPECT(kvf_pool_create(cfg, &pool), KVF_ERR_INVALID_CONFIG); /* 2 MiB */
    CHECK(pool == 0 && last_message_contains("config_json is longer than 1048576 bytes"));
    cfg[LIMIT + 1] = '\0';
    EXPECT(kvf_pool_create(cfg, &pool), KVF_ERR_INVALID_CONFIG); /* one byte over */
    CHECK(pool == 0);
    cfg[LIMIT] = '\0';
    EXPECT(kvf_pool_create(cfg, &pool), KVF_OK); /* at the limit */
    CHECK(pool != 0);

    kvf_lease lease = 0;
    int32_t toks[3] = {1, 2, 3};
    EXPECT(kvf_pool_add_tenant(pool, name, 0, 0), KVF_ERR_INVALID_TENANT);
    CHECK(last_message_contains("name is longer than"));
    EXPECT(kvf_pool_update_tenant(pool, name, 0, 0), KVF_ERR_UNKNOWN_TENANT);
    EXPECT(kvf_pool_add_tenant_json(pool, tenant_js), KVF_ERR_INVALID_TENANT);
    CHECK(last_message_contains("tenant_json is longer than"));
    EXPECT(kvf_pool_update_tenant_json(pool, tenant_js), KVF_ERR_INVALID_TENANT);
    EXPECT(kvf_admit(pool, name, "acme", 16, 0, 0, &lease), KVF_ERR_INVALID_REQUEST);
    CHECK(last_message_contains("request_id is longer than"));
    EXPECT(kvf_admit(pool, "r", name, 16, 0, 0, &lease), KVF_ERR_INVALID_REQUEST);
    EXPECT(kvf_admit_tokens(pool, "r", "acme", toks, 3, 0, name, 0, &lease), KVF_ERR_INVALID_REQUEST);
    CHECK(last_message_contains("adapter is longer than"));
    CHECK(lease == 0);
    static const uint8_t rkey[32] = "a receiver key of 32 bytes......";
    kvf_receiver rcv = 0;
    EXPECT(kvf_receiver_create(pool, rkey, sizeof rkey, tenant_js, &rcv), KVF_ERR_INVALID_CONFIG);
    CHECK(rcv == 0 && last_message_contains("config_json is longer than"));

    size_t need = 0;
    kvf_pool_stats_json(pool, NULL, 0, &need);
    char *js = malloc(need);
    EXPECT(kvf_pool_stats_json(pool, js, need, NULL), KVF_OK);
    CHECK(strstr(js, "\"live_leases\":0") != NULL && strstr(js, "\"name\":\"big\"") == NULL);
    free(js);
    EXPECT(kvf_pool_check(pool), KVF_OK);
    EXPECT(kvf_pool_destroy(pool), KVF_OK);
    free(cfg);
    free(name);
    free(tenant_js);
}

#include "capi_test_v2.inc"
#include "capi_test_v3.inc"
#include "capi_test_v4.inc"
#include "capi_test_v5.inc"
#include "capi_test_v6.inc"
#include "capi_test_v7.inc"
#include "capi_test_v8.inc"
#include "capi_test_v9.inc"
#include "capi_test_v10.inc"
#include "capi_test_v11.inc"
#include "capi_test_v12.inc"
#include "capi_test_v13.inc"

int main(void) {
    test_library();
    test_pool_create();
    kvf_pool pool = 0;
    EXPECT(kvf_pool_create(good_config, &pool), KVF_OK);
    test_tenants(pool);
    test_admission(pool);
    EXPECT(kvf_pool_destroy(pool), KVF_OK);
    test_last_error_message();
    test_destroy();
    test_threads();
    test_long_strings();
    test_prefix();
    test_phases();
    test_handoff();
    test_regions();
    test_device();
    test_growth();
    test_cache_groups();
    test_adopted_host_tensors();
    test_ranks();
    test_admit_tokens_table();
    test_binding_callbacks();
    test_async_host_fills();
    test_admit_tokens_keyed();
    test_exhausted_cause();
    test_rank_step_lag_config();
    test_hybrid_handoff();
    test_shard_config();
    test_checkpoint_config();
    test_checkpoints();
    test_ucx_handoff();
    test_host_tier();
    test_host_tier_checkpoints();
    if (failures) {
        fprintf(stderr, "capi_test: %d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("capi_test: all %d checks passed\n", checks);
    return 0;
}
