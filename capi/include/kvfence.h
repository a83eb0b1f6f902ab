/*
 * kvfence.h: C ABI of kvfence, the KV-cache memory manager that keeps
 * tenants apart and scrubs pages before reuse.
 *
 * Link against libkvfence.so (go build -buildmode=c-shared) or
 * libkvfence.a (-buildmode=c-archive, add -lpthread). See capi/README.md.
 *
 * # Model
 *
 * A pool owns a paged KV cache shared by tenants. An engine calls
 * kvf_admit before prefill; it either gets a lease that already holds every
 * page the request can need (prompt + max new tokens) or a status that
 * says why not, with the numbers (kvf_last_error). Nothing in between: no
 * placeholder lease, no partial allocation. When the request ends the
 * engine calls kvf_lease_release; the pages are filled (zero, poison or
 * canary) and only return to the pool once the fill has completed.
 *
 * # Conventions
 *
 * - Every function that can fail returns a kvf_status: KVF_OK (0) or one
 *   of the KVF_ERR_* codes below, each the mirror of one Go sentinel error.
 * - On failure, the calling thread's last error holds the status, the
 *   message and any numbers (kvf_last_error, kvf_last_error_message).
 *   Successful calls leave it unchanged, like errno; read it right after
 *   the call that failed, on the same thread.
 * - Pools and leases are opaque 64-bit handles; 0 is never a valid handle.
 *   A destroyed pool's or freed lease's handle is never reused: passing it
 *   (or any value that is not a live handle of the right kind) returns
 *   KVF_ERR_INVALID_HANDLE, never crashes.
 * - A required pointer that is NULL returns KVF_ERR_NULL_POINTER.
 * - Results go into caller buffers. A buffer too small returns
 *   KVF_ERR_BUFFER_TOO_SMALL, writes nothing into it, and reports the size
 *   needed (through the function's length out-parameter, and as `need` in
 *   kvf_error_info). A buffer may be NULL if its length is 0, to ask for
 *   the size.
 * - Strings passed in are NUL-terminated UTF-8 and are copied; kvfence
 *   keeps no pointer into caller memory after a call returns.
 * - Every function is safe to call from any thread at any time.
 */
#ifndef KVFENCE_H
#define KVFENCE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI this header describes; compare with kvf_abi_version(). */
#define KVF_ABI_VERSION 1

/* The longest message kvf_last_error_message can return, NUL included;
 * longer messages are truncated. */
#define KVF_ERROR_MESSAGE_MAX 2048

/* A status code. Values are stable: they are never renumbered. */
typedef int32_t kvf_status;

enum {
    KVF_OK = 0,

    /* The C boundary. */
    KVF_ERR_INVALID_ARGUMENT = 1, /* bad argument: token range outside the lease, commit going backwards, negative wait */
    KVF_ERR_NULL_POINTER = 2,     /* a required pointer was NULL */
    KVF_ERR_INVALID_HANDLE = 3,   /* not a live pool/lease handle (0, freed, destroyed, other kind) */
    KVF_ERR_BUFFER_TOO_SMALL = 4, /* the size needed is in the length out-parameter and in need */
    KVF_ERR_INTERNAL = 5,         /* a bug in kvfence; please report the message */

    /* kvf_pool_create. */
    KVF_ERR_INVALID_CONFIG = 10,  /* bad JSON, unknown field, bad geometry, size, scrub policy or tenant */
    KVF_ERR_UNDERSIZED_POOL = 11, /* pool cannot hold max_context_tokens and allow_undersized_pool is false */

    /* kvf_admit refusals; nothing was allocated. */
    KVF_ERR_INVALID_REQUEST = 20,     /* empty or over-long ID or tenant, prompt < 1, max_new < 0, overflow */
    KVF_ERR_UNKNOWN_TENANT = 21,      /* also from kvf_pool_update_tenant */
    KVF_ERR_DUPLICATE_REQUEST = 22,   /* a live lease already has this request ID */
    KVF_ERR_EXCEEDS_MAX_CONTEXT = 23, /* prompt + max_new > max_context_tokens (need, limit in tokens) */
    KVF_ERR_EXCEEDS_CAPACITY = 24,    /* more pages than the pool has in service; permanent */
    KVF_ERR_EXCEEDS_QUOTA = 25,       /* over the tenant's quota (permanent if need > limit) */
    KVF_ERR_POOL_EXHAUSTED = 26,      /* not enough free pages now; retryable */

    /* Pool and lease state. */
    KVF_ERR_POOL_CLOSED = 30,     /* the pool was destroyed (seen through a lease) */
    KVF_ERR_POOL_FAULTED = 31,    /* a scrub failed or a canary audit failed; see kvf_pool_clear_fault */
    KVF_ERR_LEASE_RELEASED = 32,  /* the lease was already released */
    KVF_ERR_SCRUB_FAILED = 33,    /* a device fill failed */
    KVF_ERR_CANARY_MISMATCH = 34, /* a freed page was written after its release */

    /* Tenant administration. */
    KVF_ERR_INVALID_TENANT = 40,   /* empty or over-long name, negative quota, reservation above quota */
    KVF_ERR_DUPLICATE_TENANT = 41, /* kvf_pool_add_tenant of a registered name */
    KVF_ERR_OVER_RESERVED = 42     /* reservations would exceed the pool */
};

/* Handles. 0 is never valid. */
typedef uint64_t kvf_pool;
typedef uint64_t kvf_lease;

/* What the last failed call on this thread reported. Numbers that do not
 * apply are 0. */
typedef struct kvf_error_info {
    kvf_status status;    /* KVF_OK if no call on this thread has failed yet */
    int32_t retryable;    /* 1: the same admission may succeed later unchanged */
    int32_t permanent;    /* 1: it can never succeed on this pool as configured */
    int32_t reserved0;
    int64_t need;         /* pages (tokens for EXCEEDS_MAX_CONTEXT; elements or bytes for BUFFER_TOO_SMALL) */
    int64_t have;         /* what could be granted now (the buffer's length for BUFFER_TOO_SMALL) */
    int64_t limit;        /* the ceiling: pages in service, quota, max context */
    int64_t need_tokens;  /* EXCEEDS_CAPACITY restated in tokens */
    int64_t limit_tokens;
    uint64_t message_len; /* bytes of the message, NUL excluded */
} kvf_error_info;

/* The shape of a lease (kvf_lease_describe). */
typedef struct kvf_lease_info {
    int64_t pages;           /* block table length */
    int64_t capacity_tokens; /* pages * tokens_per_page, >= prompt + max_new */
    int64_t prompt_tokens;
    int64_t max_new_tokens;
    int64_t written_tokens;  /* the watermark set by kvf_lease_commit */
    int32_t live;            /* 1 until released */
    int32_t reserved0;
} kvf_lease_info;

#ifndef KVFENCE_TYPES_ONLY

#if defined(__GNUC__)
#define KVF_API __attribute__((visibility("default")))
#else
#define KVF_API
#endif

/* ---- Library ---------------------------------------------------------- */

/* The library's version, e.g. "0.1.0". Static storage; never free it. */
KVF_API const char *kvf_version(void);

/* The ABI version the library implements; equal to KVF_ABI_VERSION when
 * header and library agree. */
KVF_API uint32_t kvf_abi_version(void);

/* The enumerator name of a status, e.g. "KVF_ERR_EXCEEDS_QUOTA", or
 * "KVF_ERR_UNKNOWN_STATUS". Static storage. */
KVF_API const char *kvf_status_name(kvf_status status);

/* ---- Errors (per thread) ---------------------------------------------- */

/* Copies the calling thread's last error into *info. Returns
 * KVF_ERR_NULL_POINTER if info is NULL. Never changes the last error. */
KVF_API kvf_status kvf_last_error(kvf_error_info *info);

/* Copies the calling thread's last error message, NUL-terminated, into
 * buf. *needed (if not NULL) gets message_len + 1. If buf_len is smaller,
 * the message is truncated to fit (when buf_len > 0) and the call returns
 * KVF_ERR_BUFFER_TOO_SMALL. Never changes the last error. */
KVF_API kvf_status kvf_last_error_message(char *buf, size_t buf_len, size_t *needed);

/* ---- Pools ------------------------------------------------------------- */

/* Creates a pool from a JSON config, the Go kvcache.Config field for
 * field (capi/README.md has the schema):
 *
 *   {"geometry": {"tokens_per_page": 16, "layers": 32, "kv_heads": 8,
 *                 "head_dim": 128, "dtype": "bf16"},
 *    "pages": 4096,                    (or "pool_bytes": N, not both)
 *    "max_context_tokens": 32768,
 *    "allow_undersized_pool": false,
 *    "tenants": [{"name": "acme", "quota_pages": 2048, "reserved_pages": 0}],
 *    "scrub": {"kind": "poison", "pattern": "0x8000"}}
 *
 * Unknown fields are rejected. A pool that cannot hold max_context_tokens
 * returns KVF_ERR_UNDERSIZED_POOL unless allow_undersized_pool is true.
 * Pages live in host memory owned by the pool. */
KVF_API kvf_status kvf_pool_create(const char *config_json, kvf_pool *out);

/* Closes the pool: live leases are released and scrubbed, fills are
 * waited for, memory is freed, and the handle becomes invalid (even if the
 * status is not KVF_OK: then a final scrub failed). Lease handles of the
 * pool stay allocated until kvf_lease_free; calls on them report
 * KVF_ERR_LEASE_RELEASED or KVF_ERR_POOL_CLOSED. */
KVF_API kvf_status kvf_pool_destroy(kvf_pool pool);

/* Registers a tenant. quota_pages 0 means the whole pool. */
KVF_API kvf_status kvf_pool_add_tenant(kvf_pool pool, const char *name, int64_t quota_pages, int64_t reserved_pages);

/* Changes a registered tenant's quota and reservation; leases already
 * admitted keep their pages. */
KVF_API kvf_status kvf_pool_update_tenant(kvf_pool pool, const char *name, int64_t quota_pages, int64_t reserved_pages);

/* Writes the pool's statistics as NUL-terminated JSON into buf; *needed
 * (if not NULL) gets the JSON's length + 1. */
KVF_API kvf_status kvf_pool_stats_json(kvf_pool pool, char *buf, size_t buf_len, size_t *needed);

/* Verifies the pool's accounting (free + in use + cached + quarantined +
 * retired = total, every page owned by exactly one live lease). KVF_OK or
 * KVF_ERR_INTERNAL with the inconsistency in the message. */
KVF_API kvf_status kvf_pool_check(kvf_pool pool);

/* Lets a faulted pool admit again. Pages of the failed fill stay retired. */
KVF_API kvf_status kvf_pool_clear_fault(kvf_pool pool);

/* ---- Leases ------------------------------------------------------------ */

/* Admits a request: reserves every page prompt_tokens + max_new_tokens can
 * need and stores the lease handle in *out, or returns a refusal with
 * nothing allocated. wait_ms = 0 refuses a busy pool at once
 * (KVF_ERR_POOL_EXHAUSTED / KVF_ERR_EXCEEDS_QUOTA, retryable); wait_ms > 0
 * blocks the calling thread up to that long for pages to free up. */
KVF_API kvf_status kvf_admit(kvf_pool pool, const char *request_id, const char *tenant,
                             int64_t prompt_tokens, int64_t max_new_tokens, int64_t wait_ms,
                             kvf_lease *out);

/* Copies the lease's block table (page IDs in token order) into buf and
 * its length into *len (if not NULL). */
KVF_API kvf_status kvf_lease_block_table(kvf_lease lease, int32_t *buf, size_t buf_len, size_t *len);

/* Copies the cache slot of each token in [start, end) into buf:
 * slot = page * tokens_per_page + offset in the page (vLLM's
 * slot_mapping). *len (if not NULL) gets end - start. */
KVF_API kvf_status kvf_lease_slot_mapping(kvf_lease lease, int64_t start, int64_t end,
                                          int64_t *buf, size_t buf_len, size_t *len);

/* Records that the first `tokens` tokens have been written. The watermark
 * only moves forward, up to prompt + max_new. */
KVF_API kvf_status kvf_lease_commit(kvf_lease lease, int64_t tokens);

/* Describes the lease; works on a released lease until it is freed. */
KVF_API kvf_status kvf_lease_describe(kvf_lease lease, kvf_lease_info *out);

/* Ends the lease. Its pages are scrubbed after the engine work named by
 * stream and event (a CUstream / cudaStream_t and a CUevent /
 * cudaEvent_t as integers; 0 for none) and reused only once the scrub has
 * completed. A second release returns KVF_ERR_LEASE_RELEASED.
 * KVF_ERR_POOL_FAULTED means the lease was released but its scrub failed:
 * its pages were retired. The handle stays valid until kvf_lease_free. */
KVF_API kvf_status kvf_lease_release(kvf_lease lease, uintptr_t stream, uintptr_t event);

/* Frees the handle, releasing the lease first (with no ordering) if it is
 * still live. The handle is invalid afterwards, whatever the status. */
KVF_API kvf_status kvf_lease_free(kvf_lease lease);

#endif /* KVFENCE_TYPES_ONLY */

#ifdef __cplusplus
}
#endif

#endif /* KVFENCE_H */
