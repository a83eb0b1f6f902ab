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
 *   keeps no pointer into caller memory after a call returns. A string may
 *   be up to 1 MiB (1048576 bytes, NUL excluded), the limit on a JSON
 *   document; a longer one is a bad value of its argument and gets that
 *   argument's status, as any other bad value would: KVF_ERR_INVALID_CONFIG
 *   for a pool or receiver config, KVF_ERR_INVALID_TENANT for tenant JSON
 *   or a new tenant's name, KVF_ERR_UNKNOWN_TENANT for the name of
 *   kvf_pool_update_tenant, KVF_ERR_INVALID_REQUEST for an admission's
 *   request ID, tenant or adapter.
 * - Every function is safe to call from any thread at any time.
 */
#ifndef KVFENCE_H
#define KVFENCE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI this header describes; compare with kvf_abi_version(). Each
 * version adds functions, types, status codes and JSON fields to the one
 * before and changes none: a program built against an older version runs
 * unchanged on a newer library. Version 2 added the prefix cache, lease
 * phases, the handoff and CUDA pools; version 3 adds leases sized on
 * demand, which grow (kvf_lease_grow), preemption (kvf_lease_preempt),
 * and the config's "sizing" and "growth_watermark"; version 4 adds cache
 * specs (the config's "cache" and "max_leases": MLA latents, indexer keys,
 * sliding windows, state slots, engine-owned tensors), the tables of a
 * lease's cache groups (kvf_lease_group_table), sliding windows
 * (kvf_lease_slide_windows), host regions' addresses in kvf_pool_regions
 * and "groups" in the stats JSON; version 5 adds tensor-parallel groups
 * with one process per rank: a pool over remote ranks ("device": {"kind":
 * "remote"}) and the rank worker each rank's process runs
 * (kvf_rank_worker_create, kvf_rank_step, ...); version 6 adds
 * kvf_admit_tokens_table, admission by token IDs that writes the block
 * table in the same call; version 7 adds the host device's
 * "async_fills" and the callbacks of language bindings
 * (kvf_py_set_callbacks); version 8 adds extra key material per prompt
 * page (kvf_admit_tokens_keyed: a multimodal prompt's images), dropping
 * the prefix cache (kvf_pool_clear_prefix_cache), the cause of a
 * KVF_ERR_POOL_EXHAUSTED refusal (kvf_error_info.cause, KVF_CAUSE_*) and a
 * rank worker's "step_lag"; version 9 adds handoffs of every cache group:
 * a transfer's extents (kvf_export_extents, kvf_import_extents), reads
 * and writes of handoff units and of ranges of one
 * (kvf_export_read_units, kvf_import_write_unit_range, ...), which a pool
 * with sliding-window or state groups needs, and a cache spec's
 * tensor-parallel "shard"; version 10 adds state checkpoints, the prefix
 * cache of a pool with sliding-window or state groups
 * (kvf_lease_checkpoint_state, kvf_lease_prefill_checkpoint, the config's
 * "prefix": {"max_checkpoints", "checkpoint_slots"} and a tenant's
 * "max_checkpoints", "checkpoints" in the stats JSON) and the statuses
 * KVF_ERR_NO_STATE_GROUP and KVF_ERR_CHECKPOINT_CAPACITY; version 11 adds
 * handoffs the library moves itself, over UCX: a receiver serves imports
 * on an address (kvf_ucx_server_create), an export is sent there
 * (kvf_ucx_transport_create, kvf_export_send_ucx), the imported lease
 * taken by request ID (kvf_receiver_take), and the statuses
 * KVF_ERR_TRANSPORT, KVF_ERR_PROTOCOL and KVF_ERR_UNAVAILABLE; version
 * 12 adds the host tier: the config's "host_tier" and a tenant's
 * "tier_pages", its figures in the stats JSON ("tier", and per domain),
 * events' "medium", swaps on preemption, and the statuses
 * KVF_ERR_TIER_UNSUPPORTED, KVF_ERR_ONLOAD_FAILED and
 * KVF_ERR_OFFLOAD_FAILED; version 13 adds the host tier of a pool with
 * sliding-window or state groups: "host_tier": {"checkpoints": N} and the
 * stats' tier checkpoint figures ("checkpoint_slots",
 * "checkpoint_slot_bytes", "checkpoints", "checkpoints_stored", ...,
 * and each domain's "tier_checkpoints", ...). */
#define KVF_ABI_VERSION 13

/* The longest message kvf_last_error_message can return, NUL included;
 * longer messages are truncated. */
#define KVF_ERROR_MESSAGE_MAX 2048

/* A status code. Values are stable: they are never renumbered. */
typedef int32_t kvf_status;

enum {
    KVF_OK = 0,

    /* The C boundary. */
    KVF_ERR_INVALID_ARGUMENT = 1, /* bad argument: token or page range outside the lease or transfer, commit going backwards, negative wait */
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
    KVF_ERR_OVER_RESERVED = 42,    /* reservations would exceed the pool */

    /* Devices (pool config "device"). Since ABI 2. */
    KVF_ERR_NO_DEVICE = 50,            /* no CUDA driver or device; the message has the driver's reason */
    KVF_ERR_DEVICE_OUT_OF_MEMORY = 51, /* the pool's pages do not fit in device memory */
    KVF_ERR_DEVICE_FAILED = 52,        /* a driver call failed */
    KVF_ERR_BAD_ORDERING = 53,         /* a release's stream or event cannot order the scrub (unknown, another
                                          context, capturing a CUDA graph); the lease stays live */

    /* Lease phases and handoff. Since ABI 2. */
    KVF_ERR_LEASE_PHASE = 60,         /* the lease is not in the phase the call needs (e.g. export before finish_prefill) */
    KVF_ERR_RECLAIMED = 61,           /* the exported pages were released (ack, abort, reclaim deadline, release) */
    KVF_ERR_STALE_TRANSFER = 62,      /* the import has ended (aborted, timed out, completed); nothing was written */
    KVF_ERR_DUPLICATE_PAGE = 63,      /* an import received the same page twice; the import is aborted */
    KVF_ERR_INCOMPLETE_TRANSFER = 64, /* complete before every page arrived; the import is aborted */
    KVF_ERR_CHECKSUM_MISMATCH = 65,   /* the pages do not match the manifest's checksum; the import is aborted */
    KVF_ERR_MALFORMED_MANIFEST = 66,  /* not a manifest this library reads (length, magic, version, fields) */
    KVF_ERR_BAD_MAC = 67,             /* the manifest's MAC does not verify under the key: forged, corrupted, other key */
    KVF_ERR_MANIFEST_EXPIRED = 68,    /* expired, or expiring further ahead than the receiver's max_ttl_ms */
    KVF_ERR_GEOMETRY_MISMATCH = 69,   /* the manifest's units are of another cache spec than the decode pool's: the message names the first difference */
    KVF_ERR_DOMAIN_MISMATCH = 70,     /* the manifest names another sharing domain than its tenant has here */
    KVF_ERR_REPLAY = 71,              /* this request ID was imported by this receiver: refused for good */
    KVF_ERR_IN_PROGRESS = 72,         /* this request ID is being imported by this receiver: retry once that import ends */
    KVF_ERR_SHARD_MISMATCH = 73,      /* the manifest's KV is another tensor-parallel shard (rank, or number of ranks) than the decode pool's */
    /* State checkpoints (kvf_lease_checkpoint_state). Since ABI 10. */
    KVF_ERR_NO_STATE_GROUP = 74,      /* a state checkpoint in a pool whose only cache group is per-token */
    KVF_ERR_CHECKPOINT_CAPACITY = 75, /* no room for a state checkpoint: the pool's or the tenant's bound, or no slot free or evictable; counted, the lease unchanged */

    /* Transports: handoffs the library moves itself. Since ABI 11. */
    KVF_ERR_TRANSPORT = 76,   /* the connection failed, the peer is gone, or it stayed silent past a timeout; the export stays pinned for a retry */
    KVF_ERR_PROTOCOL = 77,    /* the peer broke the handoff's protocol (a forged frame, a grant of memory that does not hold the units) */
    KVF_ERR_UNAVAILABLE = 78, /* the library was built without UCX (build it with cgo, libucx-dev and -tags ucx) */

    /* The host tier. Since ABI 12. */
    KVF_ERR_TIER_UNSUPPORTED = 79, /* a host tier on a pool that cannot have one (a remote device; window or state groups without "checkpoints") */
    KVF_ERR_ONLOAD_FAILED = 80,    /* an admission could not copy its prefix from the host tier: nothing admitted; retryable */
    KVF_ERR_OFFLOAD_FAILED = 81    /* a copy into the host tier failed (logged and counted in the stats; no call returns it yet) */
};

/* Handles. 0 is never valid. All kinds share one counter: a value names
 * at most one object, ever. */
typedef uint64_t kvf_pool;
typedef uint64_t kvf_lease;
typedef uint64_t kvf_export;   /* since ABI 2 */
typedef uint64_t kvf_receiver; /* since ABI 2 */
typedef uint64_t kvf_import;   /* since ABI 2 */
typedef uint64_t kvf_rank_worker; /* since ABI 5 */
typedef uint64_t kvf_ucx_server;    /* since ABI 11 */
typedef uint64_t kvf_ucx_transport; /* since ABI 11 */

/* A lease's handoff phase (kvf_lease_phase). Since ABI 2. */
enum {
    KVF_PHASE_ADMITTED = 0,   /* admitted, nothing written yet */
    KVF_PHASE_PREFILLING = 1, /* kvf_lease_begin_prefill: the engine writes the prompt's KV */
    KVF_PHASE_PREFILLED = 2,  /* kvf_lease_finish_prefill (written = prompt), or an import completed */
    KVF_PHASE_EXPORTED = 3,   /* pinned by kvf_export_create until ack, abort or the reclaim deadline */
    KVF_PHASE_IMPORTING = 4,  /* never seen through a lease handle */
    KVF_PHASE_RELEASED = 5,
    KVF_PHASE_ABORTED = 6
};

/* Why a pool had no pages for an admission or growth refused with
 * KVF_ERR_POOL_EXHAUSTED (kvf_error_info.cause). Since ABI 8. An engine
 * that serves several tenants tells by it whether others may still be
 * admitted: with KVF_CAUSE_NONE the pool's supply is short (back-pressure
 * for everyone); with KVF_CAUSE_RESERVED or KVF_CAUSE_KEPT_FOR_GROWTH the
 * pages exist but not for this tenant's request now, and a tenant with an
 * unused reservation may still get its own. */
enum {
    KVF_CAUSE_NONE = 0,
    KVF_CAUSE_RESERVED = 1,        /* the free pages are other tenants' unused reservations */
    KVF_CAUSE_KEPT_FOR_GROWTH = 2  /* the free pages are kept for the growth of running leases ("growth_watermark") */
};

/* What the last failed call on this thread reported. Numbers that do not
 * apply are 0. */
typedef struct kvf_error_info {
    kvf_status status;    /* KVF_OK if no call on this thread has failed yet */
    int32_t retryable;    /* 1: the same admission may succeed later unchanged */
    int32_t permanent;    /* 1: it can never succeed on this pool as configured */
    int32_t cause;        /* KVF_CAUSE_*: why the pool had no pages (since ABI 8; 0 before) */
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

/* Where a pool's pages live (kvf_pool_regions). Since ABI 2. */
typedef struct kvf_region {
    uint64_t base;      /* address of page 0: a CUdeviceptr, or host memory's address */
    int64_t stride;     /* bytes from page p to page p+1 */
    int64_t page_bytes; /* bytes of one page in this region */
    int64_t pages;
} kvf_region;

/* What an export holds or an import expects (kvf_export_describe,
 * kvf_import_describe). Since ABI 2. */
typedef struct kvf_transfer_info {
    int64_t pages;          /* prompt pages of the per-token group to move (its units: the transfer's first);
                               a pool with window or state groups moves more (kvf_export_extents) */
    int64_t page_bytes;     /* bytes of one per-token page, all its regions (layers' K and V, layer 0's K first) */
    int64_t prompt_tokens;
    int64_t max_new_tokens; /* what the decode lease reserves beyond the prompt */
    uint32_t checksum;      /* content checksum the manifest promises (XXH3-64 per unit, folded) */
    int32_t live;           /* export: pages still pinned; import: neither completed nor aborted */
} kvf_transfer_info;

/* The kind of a cache group (kvf_handoff_extent.kind). Since ABI 9. */
enum {
    KVF_GROUP_PER_TOKEN = 1,      /* pages of tokens: K/V, MLA latents, indexer keys */
    KVF_GROUP_SLIDING_WINDOW = 2, /* a ring of pages over the last window_tokens tokens */
    KVF_GROUP_STATE = 3           /* one slot per lease: a linear-attention layer's state */
};

/* The most bytes of a cache group's name in a kvf_handoff_extent, NUL
 * included (names are at most 128 bytes). Since ABI 9. */
#define KVF_GROUP_NAME_MAX 129

/* One cache group's part of a handoff (kvf_export_extents,
 * kvf_import_extents). Since ABI 9. A transfer moves units: the pages
 * (slots) of every group that hold the prompt's state, group by group in
 * the cache spec's order, numbered from 0 across groups. A unit's bytes
 * are its page (slot) in every region of its group, in region order. */
typedef struct kvf_handoff_extent {
    int64_t first_unit; /* the transfer's number of the group's first unit */
    int64_t units;      /* per-token: the prompt's pages; window: its ring pages still inside the window at the
                           prompt's end, oldest first; state: 1, the lease's slot */
    int64_t unit_bytes; /* bytes of one unit: its page (slot) in every region of the group */
    int64_t first_page; /* the logical page the first unit holds: 0, or for a window the oldest page inside it
                           (unit first_unit + i holds tokens [(first_page + i) x tokens_per_page, ...)) */
    int32_t kind;       /* KVF_GROUP_* */
    char group[KVF_GROUP_NAME_MAX]; /* the group's name, NUL-terminated */
} kvf_handoff_extent;

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
 *    "tenants": [{"name": "acme", "quota_pages": 2048, "reserved_pages": 0,
 *                 "domain": "team-a"}],
 *    "scrub": {"kind": "poison", "pattern": "0x8000"},
 *    "prefix": {"disable": false, "event_buffer": 0,
 *               "max_checkpoints": 0, "checkpoint_slots": 0},
 *    "sizing": {"mode": "full"},      (or {"mode": "on_demand",
 *                                        "headroom_tokens": 256})
 *    "growth_watermark": 0.01,
 *    "host_tier": {"pages": 65536},   (or "bytes": N; "checkpoints": N;
 *                                        "no_swap": true)
 *    "device": {"kind": "host"}}      (or {"kind": "cuda", "ordinal": 0},
 *                                        or {"kind": "remote", ...}: below)
 *
 * Unknown fields are rejected. A pool that cannot hold max_context_tokens
 * returns KVF_ERR_UNDERSIZED_POOL unless allow_undersized_pool is true.
 * A tenant's "domain" names the sharing domain whose prefix cache it
 * shares (omitted: its own). Pages live in host memory, or, with
 * "device": {"kind": "cuda"}, in memory the pool allocates on that CUDA
 * device (the driver is loaded at run time; without one the call returns
 * KVF_ERR_NO_DEVICE with the driver's reason). The pool owns either.
 * A host device with "async_fills": true (since ABI 7) scrubs released
 * pages on a thread of the library's, as a GPU does on its stream: a
 * release returns before the memset, the pages stay quarantined until it
 * has ended, and every page copy waits for the scrubs issued before it.
 *
 * "sizing" (since ABI 3; a tenant object takes one too, which overrides
 * the pool's) says how much of a request's output admission reserves:
 * "full" (the default) reserves prompt + max_new; "on_demand" reserves the
 * whole prompt plus headroom_tokens of output (at most max_new), and the
 * lease grows with kvf_lease_grow. The prompt is always admitted whole or
 * refused. "growth_watermark" (0 to 0.5, default 0) is the share of pages
 * new admissions leave free for growth: an admission that would cut into
 * it is refused KVF_ERR_POOL_EXHAUSTED (retryable); growth may use it.
 *
 * "host_tier" (since ABI 12) gives the pool a second page space in host
 * memory (page-locked on a CUDA device), of "pages" pages or "bytes"
 * bytes: cached pages the device evicts are kept there, under the same
 * sharing domain and keys, and copied back into the fresh pages of an
 * admission whose prefix continues there before the admission returns
 * (they count as hits: kvf_lease_hit_tokens); a copy that fails refuses
 * the admission with KVF_ERR_ONLOAD_FAILED, nothing allocated.
 * kvf_lease_preempt swaps a request's private written pages there unless
 * "no_swap" is true (or the pool has window or state groups). The tier evicts least recently used within each
 * domain's share: a tenant's "tier_pages" (its domain may keep the sum of
 * its tenants' shares; a tenant without one lets its domain use the whole
 * tier), and fills every slot it frees with the scrub policy. A pool over
 * remote ranks cannot have one (KVF_ERR_TIER_UNSUPPORTED).
 *
 * In a pool with sliding-window or state groups (since ABI 13; before, it
 * could have no tier) the tier also keeps the state checkpoints the
 * device evicts (kvf_lease_checkpoint_state), "checkpoints" of them, each
 * in a slot of its own of "checkpoint_slot_bytes" (a checkpoint's window
 * pages and state slots at most): an admission whose prefix reaches one
 * there gets it copied into its own fresh units before the call returns,
 * as a checkpoint restored on the device (the hit covers it:
 * kvf_lease_hit_tokens; a failed copy refuses the admission with
 * KVF_ERR_ONLOAD_FAILED, nothing allocated). The tier's checkpoints are
 * their domain's alone, bounded by the same share as its pages
 * ("tier_pages" as a share of each space), and leave the tier with the
 * page they end on. "checkpoints" is required there (at least 1; 0 or
 * omitted is KVF_ERR_TIER_UNSUPPORTED, as an ABI 12 library reports) and
 * refused in a pool without such groups (KVF_ERR_INVALID_CONFIG); with
 * "bytes" the checkpoints take their bytes first and the pages the
 * rest.
 *
 * "cache" (since ABI 4), instead of "geometry", describes any model's
 * caches as groups of regions (kvcache.CacheSpec; capi/README.md has the
 * schema and examples):
 *
 *   "cache": {"groups": [
 *     {"name": "kv", "kind": "per_token", "tokens_per_page": 64,
 *      "regions": [{"name": "layer.0.latent", "dtype": "bf16", "page_bytes": 73728},
 *                  {"name": "layer.0.indexer", "dtype": "fp8_e4m3",
 *                   "also_holds": ["fp32"], "page_bytes": 8448}]},
 *     {"name": "state", "kind": "state", "regions": [...]}]},
 *   "max_leases": 256
 *
 * The first group is the per-token one (K/V, latents, indexer keys: any
 * page size per region); "sliding_window" groups take "window_tokens";
 * "state" groups hold one slot per lease. "max_leases" sizes the window
 * and state groups (required with them). "shard": {"rank": r, "size": n}
 * (since ABI 9) says the regions hold tensor-parallel rank r's shard of n
 * (its heads of every layer); a handoff moves KV only between pools of
 * one shard (KVF_ERR_SHARD_MISMATCH). Omitted: the whole model. Both
 * fields are required, size 1 to 65536 and rank 0 to size - 1
 * (KVF_ERR_INVALID_CONFIG naming the field). A region's "memory":
 * {"base": "0x7f..", "stride": N, "pages": N, "bytes": N} adopts an
 * engine's tensor instead of allocating: a device address on a CUDA pool,
 * a host address ("bytes" long, required) on a host pool; the engine keeps
 * the memory alive until kvf_pool_destroy. Overlapping tensors, strides
 * smaller than a page and memory smaller than its group are refused
 * (KVF_ERR_INVALID_CONFIG), with nothing adopted.
 *
 * Such a pool (with sliding-window or state groups) shares prefixes
 * through state checkpoints (since ABI 10; kvf_lease_checkpoint_state).
 * "prefix": {"checkpoint_slots": N} sizes its window and state groups for
 * N checkpoints beside max_leases leases (0: checkpoints use only the
 * slots of leases not live; refused in a pool without such groups), and
 * "max_checkpoints": N bounds the checkpoints it keeps at once (0: as many
 * as the groups have room for); a tenant's "max_checkpoints" bounds its
 * own (0: the pool's bound). Each is 0 to 16777216 (checkpoint_slots: up
 * to 16777216 - max_leases); a bad value is KVF_ERR_INVALID_CONFIG naming
 * the field (KVF_ERR_INVALID_TENANT through the tenant calls).
 *
 * "device": {"kind": "remote", "listen": "unix:/run/kvf.sock" (or
 * "tcp:HOST:PORT"), "ranks": 4, "report_timeout_ms": 30000,
 * "accept_timeout_ms": 60000} (since ABI 5) makes this the scheduler's
 * pool of a tensor-parallel group with one process per rank: each rank's
 * process holds its shard of every region and serves it with a rank
 * worker (kvf_rank_worker_create, below). The call listens on the address,
 * blocks until every rank in [0, ranks) has connected once, with shards
 * of one shape, and scrubs every page on every rank (the workers launch
 * that scrub without a step), then stops listening; ranks missing after
 * accept_timeout_ms (0: 60 s), a socket file already there, or a refused
 * rank is KVF_ERR_NO_DEVICE with the reason. Region r of the pool is the
 * ranks' region r side by side, rank 0 first: geometry.kv_heads counts
 * the heads of all ranks, and "pages" must not exceed the ranks' own
 * (such a pool takes a "geometry"; a "cache" over remote ranks is not
 * supported yet: KVF_ERR_INVALID_CONFIG). A
 * page returns to the free list only after every rank has reported its
 * scrub; a rank that fails one, disconnects or stays silent for
 * report_timeout_ms (0: 30 s) fails it: the pages are retired, the pool
 * faults (KVF_ERR_POOL_FAULTED), and every later fill fails, so the group
 * must be rebuilt (destroy the pool, create it again). Orderings given to
 * kvf_lease_release are ignored: each rank orders its scrub after its own
 * stream (kvf_rank_step). kvf_pool_destroy waits for the scrubs in flight,
 * up to report_timeout_ms, then closes the connections: the workers see
 * KVF_ERR_POOL_CLOSED. The protocol authenticates nothing: listen on a
 * Unix socket in a directory only the engine's user can reach, or on TCP
 * only inside a trusted network. */
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
 * admitted keep their pages. The tenant keeps the rest of its
 * configuration as last set: its sharing domain, its "sizing" and (since
 * ABI 10) its "max_checkpoints". */
KVF_API kvf_status kvf_pool_update_tenant(kvf_pool pool, const char *name, int64_t quota_pages, int64_t reserved_pages);

/* kvf_pool_add_tenant and a full replacement of a tenant's configuration,
 * taking one object of the config's "tenants" list, e.g.
 * {"name": "acme", "quota_pages": 64, "domain": "team-a",
 * "max_checkpoints": 8}. The update
 * replaces every field: an omitted "domain" moves the tenant back to its
 * own domain (its live leases stay where they were admitted). Bad JSON is
 * KVF_ERR_INVALID_TENANT. Since ABI 2. */
KVF_API kvf_status kvf_pool_add_tenant_json(kvf_pool pool, const char *tenant_json);
KVF_API kvf_status kvf_pool_update_tenant_json(kvf_pool pool, const char *tenant_json);

/* Writes the pool's statistics as NUL-terminated JSON into buf; *needed
 * (if not NULL) gets the JSON's length + 1. capi/README.md lists the
 * keys. Since ABI 10 it has "checkpoints", the state checkpoints of a
 * pool with sliding-window or state groups (all 0 in any other pool):
 *   {"live", "restoring" (of them, being copied into an admitted lease),
 *    "state_bytes" (the bytes they hold, every group), "taken",
 *    "existing" (checkpoint calls that found one at the tokens already),
 *    "hits", "hit_tokens" (admissions that restored one, and the tokens
 *    they shared), "misses", "miss_tokens" (admissions that matched
 *    cached pages past their last checkpoint, and those pages' tokens),
 *    "evicted", "capacity_skips" (checkpoints not taken for lack of
 *    room), "restore_nanos", "copy_nanos" (time spent copying into
 *    admitted leases, and out of leases into checkpoints)}
 * Since ABI 12 it has "tier", the host tier's figures ("enabled": false
 * without one): its slots by state, which add up to "slots", pages and
 * bytes copied each way, copy failures and swaps,
 *   {"enabled", "slots", "slot_bytes", "free", "cached", "swapped",
 *    "in_flight", "quarantined", "retired", "offloads", "offload_bytes",
 *    "offloads_dropped", "offloads_failed", "onloads", "onload_bytes",
 *    "onloads_failed", "swaps_out", "swap_out_pages", "swaps_full",
 *    "swaps_failed", "swaps_in", "swap_in_pages", "swaps_evicted",
 *    "evicted_slots", "scrubbed_slots", "retired_slots"}
 * and, for each prefix-cache domain, "tier_pages", "tier_bound",
 * "tier_hit_pages", "tier_hit_tokens", "tier_stored_pages" and
 * "tier_evicted_pages". Since ABI 13 "tier" has a hybrid pool's state
 * checkpoints too (all 0 in any other pool): "checkpoint_slots" and
 * "checkpoint_slot_bytes" (the tier's checkpoint space; "slots" counts
 * them, so slots = free + cached + swapped + checkpoints + in_flight +
 * quarantined + retired), "checkpoints" (held, no copy reading them),
 * "checkpoints_stored", "checkpoints_dropped" (no room),
 * "checkpoints_failed" (the copy in failed), "checkpoints_restored",
 * "checkpoint_restore_bytes", "checkpoint_restores_failed" (admissions
 * refused with KVF_ERR_ONLOAD_FAILED) and "checkpoints_evicted" (for
 * room, or with their page), and each domain "tier_checkpoints",
 * "tier_checkpoint_bound" (its share of the checkpoint slots),
 * "tier_checkpoints_stored", "tier_checkpoint_hits" and
 * "tier_checkpoints_evicted". */
KVF_API kvf_status kvf_pool_stats_json(kvf_pool pool, char *buf, size_t buf_len, size_t *needed);

/* Verifies the pool's accounting (free + in use + cached + quarantined +
 * retired = total, every page owned by exactly one live lease). KVF_OK or
 * KVF_ERR_INTERNAL with the inconsistency in the message. */
KVF_API kvf_status kvf_pool_check(kvf_pool pool);

/* Lets a faulted pool admit again. Pages of the failed fill stay retired. */
KVF_API kvf_status kvf_pool_clear_fault(kvf_pool pool);

/* Copies the pool's regions into buf: for a "geometry" pool 2 x layers of
 * them, layer l's K in region 2l and its V in 2l+1; for a "cache" pool its
 * regions in the spec's order, group by group (a group's page IDs are its
 * own). Page p of a region starts at base + p * stride. *len (if not NULL)
 * gets the count. For a CUDA pool the bases are device addresses the
 * engine's kernels write the KV to (in the pages of its leases only); a
 * host pool reports the address of its host memory (since ABI 4; 0
 * before), valid until kvf_pool_destroy. Since ABI 2. */
KVF_API kvf_status kvf_pool_regions(kvf_pool pool, kvf_region *buf, size_t buf_len, size_t *len);

/* Writes the next batch (up to 256) of prefix-cache events as
 * NUL-terminated JSON, for a KV-aware router:
 *   {"enabled": true, "events": [{"kind": "stored"|"removed"|"cleared",
 *     "seq": 7, "domain": "team-a", "keys": ["<64 hex>", ...],
 *     "parent": "<64 hex>" (stored, not a prompt's first page), "tokens": 32,
 *     "medium": "device"|"host" (since ABI 12: the host tier's pages are
 *     stored there when the device evicts them, before they are removed
 *     from the device)}]}
 * A short buffer returns KVF_ERR_BUFFER_TOO_SMALL with the size in
 * *needed and keeps the batch for the next call. Events flow only with
 * "prefix": {"event_buffer": N > 0}; when the buffer is full the pool drops
 * events (a gap in seq; counted in the stats) rather than stall. Since
 * ABI 2. */
KVF_API kvf_status kvf_pool_events_json(kvf_pool pool, char *buf, size_t buf_len, size_t *needed);

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
 * slot_mapping). *len (if not NULL) gets end - start, or 0 for a range
 * outside the lease (KVF_ERR_INVALID_ARGUMENT). */
KVF_API kvf_status kvf_lease_slot_mapping(kvf_lease lease, int64_t start, int64_t end,
                                          int64_t *buf, size_t buf_len, size_t *len);

/* Records that the first `tokens` tokens have been written. The watermark
 * only moves forward, up to prompt + max_new and up to the lease's
 * capacity (an on-demand lease grows first). */
KVF_API kvf_status kvf_lease_commit(kvf_lease lease, int64_t tokens);

/* Makes room in the lease for `tokens` more tokens after its written
 * watermark: afterwards its capacity (kvf_lease_describe) is at least
 * written + tokens. The pages it takes are added all or none, charged to
 * the tenant; KVF_OK without adding any if the lease has the room. A
 * refusal tells the engine to finish or preempt the request, with the
 * numbers in kvf_last_error: KVF_ERR_POOL_EXHAUSTED or
 * KVF_ERR_EXCEEDS_QUOTA (retryable: wait_ms > 0 waits up to that long),
 * KVF_ERR_EXCEEDS_MAX_CONTEXT (past prompt + max_new: need and limit in
 * tokens), KVF_ERR_EXCEEDS_CAPACITY; KVF_ERR_LEASE_PHASE for an exported
 * or importing lease. The block table and slot mapping include the new
 * pages. Growth passes waiting admissions and the growth watermark.
 * Since ABI 3. */
KVF_API kvf_status kvf_lease_grow(kvf_lease lease, int64_t tokens, int64_t wait_ms);

/* Preempts the lease: gives its pages back but keeps what it computed.
 * token_ids are the IDs of its written tokens (n_tokens = written: the
 * prompt, then what it generated); the full pages they fill are published
 * to the prefix cache of the lease's sharing domain and every other page
 * is scrubbed. *kept_tokens (if not NULL) gets the tokens kept. The lease
 * ends; to resume, admit the request again with kvf_admit_tokens and all
 * its tokens as the prompt: kvf_lease_hit_tokens says how much prefill
 * to skip. With token_ids NULL (n_tokens 0) it is kvf_lease_release
 * without ordering, keeping nothing. Token IDs that contradict the prompt
 * the lease was admitted with (kvf_admit_tokens) are refused with
 * KVF_ERR_INVALID_ARGUMENT, the lease left live. With a host tier (since
 * ABI 12) the written pages the prefix cache does not keep (the partial
 * last page; all of them with the prefix cache off) are swapped to the
 * tier, all or none, and *kept_tokens is then every written token: the
 * next admission of the same request ID by the same tenant in the same
 * domain, with those tokens as the prompt and the same adapter, copies
 * them back (kvf_lease_hit_tokens: all but the last prompt token). A swap
 * the tier has no room for, or whose copy fails, is counted in the stats
 * and the preemption keeps what the prefix cache holds. A pool with
 * sliding-window or state groups (a host tier since ABI 13) never swaps:
 * pages are of no use without the state at their end, so its preemption
 * keeps what a state checkpoint covers, as without a tier. Since ABI 3. */
KVF_API kvf_status kvf_lease_preempt(kvf_lease lease, const int32_t *token_ids, size_t n_tokens,
                                     int64_t *kept_tokens);

/* Describes the lease; works on a released lease until it is freed. */
KVF_API kvf_status kvf_lease_describe(kvf_lease lease, kvf_lease_info *out);

/* Copies the pages (slots) the lease holds in cache group `group` into
 * buf; *len (if not NULL) gets the count, *first_page (if not NULL) the
 * logical page the first of them holds. The per-token group gives the
 * block table (first 0); a sliding-window group its ring in logical order
 * from the oldest page still in the window (entry i holds tokens
 * [(first+i) x tokens_per_page, (first+i+1) x tokens_per_page)); a state
 * group its one slot. KVF_ERR_BUFFER_TOO_SMALL (with *len set) if buf is
 * short; KVF_ERR_INVALID_ARGUMENT for an unknown group. Since ABI 4. */
KVF_API kvf_status kvf_lease_group_table(kvf_lease lease, const char *group, int32_t *buf, size_t buf_len,
                                         size_t *len, int64_t *first_page);

/* Moves the lease's sliding windows to its written watermark: the pages
 * whose tokens all lie more than a window behind it are scrubbed, after
 * the engine work named by stream and event (the rules of
 * kvf_lease_release), before the call returns, and become the ring pages
 * of the next tokens. *scrubbed (if not NULL) gets their count. Write
 * those pages only after the call returns. A failed fill faults the pool
 * (KVF_ERR_POOL_FAULTED). Since ABI 4. */
KVF_API kvf_status kvf_lease_slide_windows(kvf_lease lease, uintptr_t stream, uintptr_t event, int64_t *scrubbed);

/* The driver's special stream handles, for kvf_lease_release (cuda.h's
 * CU_STREAM_LEGACY and CU_STREAM_PER_THREAD, the runtime's
 * cudaStreamLegacy and cudaStreamPerThread). */
#define KVF_STREAM_LEGACY ((uintptr_t)0x1)
#define KVF_STREAM_PER_THREAD ((uintptr_t)0x2)

/* Ends the lease. Its pages are scrubbed after the engine work on them and
 * reused only once the scrub has completed. The ordering rule on a CUDA
 * pool:
 *   - stream (a CUstream / cudaStream_t as an integer): after all work
 *     queued on it so far. KVF_STREAM_LEGACY is the legacy default stream
 *     (PyTorch's default stream, whose cuda_stream reads 0: pass
 *     KVF_STREAM_LEGACY for it), KVF_STREAM_PER_THREAD the per-thread
 *     default stream of the calling thread.
 *   - event (a CUevent / cudaEvent_t): after its latest record.
 *   - stream = event = 0: after ALL work queued in the pool's CUDA context
 *     before the call, on every stream. Safe, but the call blocks until
 *     the GPU is idle; name the engine's stream instead.
 * A stream or event the driver does not know, one of another CUDA context,
 * a stream capturing a CUDA graph or an event recorded inside a capture is
 * refused with KVF_ERR_BAD_ORDERING before anything happens: the lease
 * stays live (release it again with a usable ordering) and the pool is
 * not faulted. A host pool ignores stream and event. A second release
 * returns KVF_ERR_LEASE_RELEASED. KVF_ERR_POOL_FAULTED means the lease was
 * released but its scrub failed: its pages were retired. The handle stays
 * valid until kvf_lease_free. */
KVF_API kvf_status kvf_lease_release(kvf_lease lease, uintptr_t stream, uintptr_t event);

/* Frees the handle, releasing the lease first if it is still live, with
 * stream = event = 0 (on a CUDA pool: after all work of the context, which
 * blocks until the GPU is idle; call kvf_lease_release with the engine's
 * stream first). The handle is invalid afterwards, whatever the status. */
KVF_API kvf_status kvf_lease_free(kvf_lease lease);

/* ---- Prefix cache (since ABI 2) ---------------------------------------- */

/* kvf_admit for a prompt given as its token IDs (n_tokens = prompt
 * tokens): the lease shares the longest prefix of full pages already
 * cached in the tenant's sharing domain under the same adapter (a LoRA ID;
 * NULL or "" for the base model). kvf_lease_hit_tokens says how many
 * leading tokens that is; their KV is in the lease's first pages and
 * prefill starts after them. The token array is read during the call
 * only. */
KVF_API kvf_status kvf_admit_tokens(kvf_pool pool, const char *request_id, const char *tenant,
                                    const int32_t *token_ids, size_t n_tokens, int64_t max_new_tokens,
                                    const char *adapter, int64_t wait_ms, kvf_lease *out);

/* kvf_admit_tokens that also copies the new lease's block table (as
 * kvf_lease_block_table would) into table, in the same call: one crossing
 * into the library per admission instead of two, for engines that call it
 * from Python. table_len must cover the most pages the lease can ever
 * hold, ceil((n_tokens + max_new_tokens) / tokens_per_page) of the pool's
 * (per-token) pages, whatever the sizing: an on-demand lease starts with
 * fewer and grows up to that. A shorter table (NULL with table_len 0 asks
 * for the size) returns KVF_ERR_BUFFER_TOO_SMALL before anything is
 * admitted: no lease, no refusal counted, the pool as it was; the number
 * needed is in *table_length and the last error's need (have: table_len).
 * That check comes after those of the pointers, the strings, the pool
 * handle and wait_ms, and applies to requests the admission can take: with n_tokens 0, a negative
 * max_new_tokens or more than the pool's max_context_tokens the call
 * returns kvf_admit_tokens's refusal whatever the table. On success
 * *out is the lease, table[0 .. *table_length) its block table (the pages
 * it holds now) and the rest of table untouched; on any failure table is
 * not written, *out is not set and *table_length (if not NULL) is 0,
 * except for the size of KVF_ERR_BUFFER_TOO_SMALL. Every other status and
 * error is kvf_admit_tokens's; table NULL with table_len > 0 is
 * KVF_ERR_NULL_POINTER. Since ABI 6. */
KVF_API kvf_status kvf_admit_tokens_table(kvf_pool pool, const char *request_id, const char *tenant,
                                          const int32_t *token_ids, size_t n_tokens, int64_t max_new_tokens,
                                          const char *adapter, int64_t wait_ms, int32_t *table, size_t table_len,
                                          size_t *table_length, kvf_lease *out);

/* kvf_admit_tokens_table whose prompt pages carry extra key material
 * (since ABI 8): bytes that name what else than its tokens a page's KV was
 * computed from, such as the images whose embeddings stand where a
 * multimodal prompt has its placeholder tokens. Page i's material is
 * page_extra[page_extra_ends[i-1] .. page_extra_ends[i]) (from 0 for page
 * 0), none when empty; n_extra_pages may be 0 (then it is
 * kvf_admit_tokens_table) and at most the prompt's pages, the partial last
 * one included; the ends must not decrease, page_extra must hold
 * page_extra_ends[n_extra_pages - 1] bytes, and one page's material is at
 * most 65536 bytes. A page with material has the extended key
 * SHA-256(parent || tokens_per_page | 1<<31 || tokens || len || bytes),
 * and every key after it chains from that one, so equal tokens with other
 * material never share a page while the pages before the first page with
 * material share with prompts that have none. Such a lease publishes its
 * pages by key alone (kvf_lease_cache_prefix, kvf_lease_preempt). Bad
 * material (decreasing ends, too much, material without token IDs) is
 * KVF_ERR_INVALID_REQUEST with nothing admitted; page_extra NULL with
 * bytes to read, or page_extra_ends NULL with n_extra_pages > 0, is
 * KVF_ERR_NULL_POINTER. Everything else is kvf_admit_tokens_table's. The
 * buffers are read during the call only. */
KVF_API kvf_status kvf_admit_tokens_keyed(kvf_pool pool, const char *request_id, const char *tenant,
                                          const int32_t *token_ids, size_t n_tokens, int64_t max_new_tokens,
                                          const char *adapter, const uint8_t *page_extra,
                                          const uint64_t *page_extra_ends, size_t n_extra_pages, int64_t wait_ms,
                                          int32_t *table, size_t table_len, size_t *table_length, kvf_lease *out);

/* Drops the pool's prefix cache in every sharing domain, as after a model
 * weight update (since ABI 8): no later admission matches a page
 * published before the call. Cached pages no lease holds are scrubbed as
 * released pages are (after all work of the pool's CUDA context; on a
 * remote pool at each rank's next steps) and reused only once the scrub
 * has completed; pages that live leases hold stay theirs and are scrubbed
 * when the last of them ends. The call does not wait for the scrub. With
 * events on, a "cleared" event follows. */
KVF_API kvf_status kvf_pool_clear_prefix_cache(kvf_pool pool);

/* Leading prompt tokens the lease shares from the prefix cache (a multiple
 * of tokens_per_page; never the page holding the last prompt token). */
KVF_API kvf_status kvf_lease_hit_tokens(kvf_lease lease, int64_t *out);

/* Publishes the lease's full prompt pages holding its first `tokens`
 * tokens to its domain's prefix cache. `tokens` must not pass the written
 * watermark (kvf_lease_commit) or the prompt (KVF_ERR_INVALID_ARGUMENT).
 * Published pages are immutable: the engine must not write them again.
 * *shared_tokens (if not NULL) gets the prompt tokens now shared or
 * published; 0 for a lease admitted without token IDs or with the prefix
 * cache disabled. In a pool with sliding-window or state groups it takes
 * a state checkpoint at `tokens` when that is a page boundary (below;
 * ordered after all work of the pool's CUDA context, with that call's
 * refusals), and *shared_tokens is what a later request can use: the
 * prefix up to the lease's deepest checkpoint (since ABI 10). */
KVF_API kvf_status kvf_lease_cache_prefix(kvf_lease lease, int64_t tokens, int64_t *shared_tokens);

/* ---- State checkpoints (since ABI 10) ---------------------------------- *
 *
 * A pool with sliding-window or state groups (a hybrid model: recurrent
 * state plus attention) caches a prefix only with the state at its end:
 * its KV is useless without the recurrent state that summarises it and
 * the window's pages there. A checkpoint is that state, taken when the
 * lease's state reflects exactly n tokens, n at a page boundary: its
 * state slot and the window pages inside the window at n, copied on the
 * device into slots the prefix cache owns, published with the pages below
 * n in the lease's sharing domain. A later admission by token IDs in the
 * domain whose prompt starts with those n tokens, and has at least one
 * more, shares the pages and receives the state: copied into its own
 * slot before the admission returns, its written watermark at n
 * (kvf_lease_hit_tokens, kvf_lease_describe) and its windows starting
 * where they did at n; every other slot or window page it gets is
 * scrubbed. The hit is the longest cached prefix ending at a checkpoint:
 * pages matched past it are not shared (counted as a checkpoint miss).
 *
 *   kvf_lease_prefill_checkpoint(lease, &at);   where to end a chunk
 *   ... prefill tokens [hit, at), commit(at) ...
 *   kvf_lease_checkpoint_state(lease, at, stream, 0);
 *   ... prefill the rest ...
 *
 * kvf_lease_cache_prefix and kvf_lease_preempt on such a pool take the
 * checkpoint at their page boundary themselves (ordered after all work
 * of the context). Checkpoints pin their pages, are evicted least
 * recently used for slots or pages and scrubbed before reuse, and are
 * bounded by the config's "prefix": {"max_checkpoints",
 * "checkpoint_slots"} and each tenant's "max_checkpoints" and quota. */

/* Takes a state checkpoint of the lease at `tokens` tokens: the engine
 * says its state (and windows) reflect exactly the first `tokens` tokens,
 * after a chunk of prefill or at the end of a shared system prompt. The
 * copy is ordered after the engine work named by stream and event (the
 * rules of kvf_lease_release; a host pool ignores them, and stream =
 * event = 0 waits for all work of the pool's CUDA context) and has
 * completed when the call returns. The full pages below `tokens` are
 * published (as kvf_lease_cache_prefix) and must not be written again.
 * A checkpoint at `tokens` that exists already in the domain is kept:
 * KVF_OK, counted as "existing".
 *
 * Refusals change nothing (no page published, nothing counted, the lease
 * live), each with its status:
 *   KVF_ERR_INVALID_ARGUMENT: tokens not a positive multiple of
 *     tokens_per_page, past the written watermark (kvf_lease_commit) or
 *     the prompt, a window that has slid or been written past its pages at
 *     `tokens`, a lease admitted without token IDs, or a pool with the
 *     prefix cache disabled;
 *   KVF_ERR_NO_STATE_GROUP: the pool has no sliding-window or state group
 *     (its prefixes need no checkpoint: kvf_lease_cache_prefix);
 *   KVF_ERR_CHECKPOINT_CAPACITY: the pool's "max_checkpoints" or the
 *     tenant's is reached, the tenant's quota in a group would be passed,
 *     or a group has no slot free or held by an evictable checkpoint; the
 *     skip is counted ("capacity_skips") and logged once per tenant.
 *     Where only slots still being scrubbed (a lease released just
 *     before, its scrub in flight on the GPU) can make the room, the
 *     call waits for those scrubs instead of refusing;
 *   KVF_ERR_LEASE_RELEASED, KVF_ERR_LEASE_PHASE (an exported or sealed
 *     lease), KVF_ERR_BAD_ORDERING (stream or event unusable, as for
 *     kvf_lease_release), KVF_ERR_INVALID_HANDLE.
 * A failed device copy is KVF_ERR_DEVICE_FAILED, with nothing published. */
KVF_API kvf_status kvf_lease_checkpoint_state(kvf_lease lease, int64_t tokens, uintptr_t stream, uintptr_t event);

/* *out gets where the engine should checkpoint the lease's prefill
 * (kvf_lease_checkpoint_state) so that a later request with the same
 * prompt reuses all it can: the last page boundary before the prompt's
 * last token, the deepest a hit can reach. 0 for a prompt within one page,
 * and in a pool without sliding-window or state groups. Works on a
 * released lease until it is freed. */
KVF_API kvf_status kvf_lease_prefill_checkpoint(kvf_lease lease, int64_t *out);

/* ---- Lease phases (since ABI 2) ---------------------------------------- */

/* The lease's KVF_PHASE_*; works on a released lease until it is freed. */
KVF_API kvf_status kvf_lease_phase(kvf_lease lease, int32_t *out);

/* admitted -> prefilling. KVF_ERR_LEASE_PHASE from any other phase. */
KVF_API kvf_status kvf_lease_begin_prefill(kvf_lease lease);

/* prefilling -> prefilled; the written watermark must equal the prompt
 * (KVF_ERR_LEASE_PHASE otherwise: a prefill that stopped short, or a
 * placeholder, can never be exported). */
KVF_API kvf_status kvf_lease_finish_prefill(kvf_lease lease);

/* Ends the lease from any phase, its pages scrubbed, recorded as aborted.
 * KVF_ERR_LEASE_RELEASED if it had already ended. */
KVF_API kvf_status kvf_lease_abort(kvf_lease lease);

/* ---- Handoff: prefill side (since ABI 2) ------------------------------- *
 *
 * Moves a prompt's KV from a prefill pool to a decode pool, the bytes
 * carried by the caller (any transport). Prefill:
 *
 *   kvf_export_create(lease, key, key_len, max_new, ttl_ms, &exp);
 *   kvf_export_manifest(exp, buf, len, &n);          -> send the manifest
 *   kvf_export_read_pages(exp, first, buf, k * page_bytes);  -> send pages
 *   ... once the decode side reports kvf_import_complete succeeded:
 *   kvf_export_ack(exp); kvf_export_free(exp); kvf_lease_free(lease);
 *
 * The key is a secret of at least 32 bytes shared by both sides (shorter:
 * KVF_ERR_INVALID_CONFIG); the manifest is HMAC-SHA256 signed with it.
 *
 * A handoff moves every cache group of the pool (since ABI 9), as units
 * (kvf_handoff_extent): the per-token group's prompt pages, each sliding
 * window's ring pages still inside the window at the prompt's end, each
 * state group's slot. The page calls (kvf_export_read_pages,
 * kvf_import_write_pages) move the per-token group's pages, which are
 * units 0 .. pages - 1: all a pool of one per-token group has. A pool
 * with sliding-window or state groups needs the unit calls
 * (kvf_export_read_units, kvf_export_read_unit_range and their import
 * twins) for the other groups' units: an import without them is refused
 * as incomplete, naming the group. Both sides' pools must have one cache
 * spec (KVF_ERR_GEOMETRY_MISMATCH names the first difference) and one
 * tensor-parallel shard (KVF_ERR_SHARD_MISMATCH).
 *
 *   kvf_export_extents(exp, ext, n, &groups, &units, &bytes);
 *   kvf_export_read_units(exp, first, buf, len);   whole units: send them
 *   kvf_export_read_unit_range(exp, u, off, buf, len);   a unit larger
 *                                                 than a message, in ranges
 */

/* Pins a prefilled lease's prompt pages, in every cache group
 * (KVF_ERR_LEASE_PHASE if it is not prefilled: nothing changes), reads
 * each once for the content checksum and signs their manifest.
 * max_new_tokens is the output budget the decode pool must reserve. The manifest is valid
 * for ttl_ms (0: 30 s); the pages stay pinned until kvf_export_ack,
 * kvf_export_abort, kvf_export_free, or 2 x ttl, then are scrubbed. */
KVF_API kvf_status kvf_export_create(kvf_lease lease, const uint8_t *key, size_t key_len,
                                     int64_t max_new_tokens, int64_t ttl_ms, kvf_export *out);

/* Copies the signed manifest (binary) into buf; *len (if not NULL) gets
 * its length. */
KVF_API kvf_status kvf_export_manifest(kvf_export exp, uint8_t *buf, size_t buf_len, size_t *len);

/* Pages, page size, sizes, checksum, and whether the pages are pinned. */
KVF_API kvf_status kvf_export_describe(kvf_export exp, kvf_transfer_info *out);

/* Copies exported pages first_page, first_page+1, ... of the per-token
 * group into buf (units first_page, ...: on a pool with window or state
 * groups their units need kvf_export_read_units). The range
 * must lie within the export: 0 <= first_page < pages, and buf_len a
 * positive multiple of page_bytes that ends at or before the last page.
 * Any other first_page or buf_len, however large or negative, returns
 * KVF_ERR_INVALID_ARGUMENT with both numbers in the message, copies
 * nothing and leaves the export as it was. KVF_ERR_RECLAIMED once the
 * pages were released: nothing is copied. */
KVF_API kvf_status kvf_export_read_pages(kvf_export exp, int64_t first_page, uint8_t *buf, size_t buf_len);

/* Copies the transfer's extents, one per cache group in the cache spec's
 * order, into buf (buf_len entries). *len (if not NULL) gets their
 * number, *units and *bytes (if not NULL) every group's units and the
 * bytes of them all, what the transfer moves; all three also with
 * KVF_ERR_BUFFER_TOO_SMALL, so NULL, 0 asks for every size in one call.
 * Works until the handle is freed, also once the export ended. Since
 * ABI 9. */
KVF_API kvf_status kvf_export_extents(kvf_export exp, kvf_handoff_extent *buf, size_t buf_len, size_t *len,
                                      int64_t *units, int64_t *bytes);

/* Copies exported units first_unit, first_unit+1, ... into buf: whole
 * units, each its regions in order, one after the other; the run may
 * cross from one group to the next (units of different sizes) and must
 * end where buf does, at a unit's end. Anything else (first_unit outside
 * 0 .. units - 1, buf_len 0 or ending inside a unit or past the last)
 * returns KVF_ERR_INVALID_ARGUMENT with the numbers in the message,
 * copies nothing and leaves the export as it was; KVF_ERR_RECLAIMED once
 * the units were released. Since ABI 9. */
KVF_API kvf_status kvf_export_read_units(kvf_export exp, int64_t first_unit, uint8_t *buf, size_t buf_len);

/* Copies bytes [offset, offset + buf_len) of exported unit `unit` into
 * buf, for a unit larger than the caller's message (a state slot is tens
 * or hundreds of MiB): any non-empty range inside the unit, in any order.
 * Errors are kvf_export_read_units'. Since ABI 9. */
KVF_API kvf_status kvf_export_read_unit_range(kvf_export exp, int64_t unit, int64_t offset, uint8_t *buf,
                                              size_t buf_len);

/* Ends the export after the decode side confirmed: the prefill pages are
 * scrubbed. KVF_ERR_RECLAIMED if they had been released already. */
KVF_API kvf_status kvf_export_ack(kvf_export exp);

/* Ends the export now (the transfer failed): the pages are scrubbed. Does
 * nothing if it had already ended. */
KVF_API kvf_status kvf_export_abort(kvf_export exp);

/* Aborts the export unless it was acked, and frees the handle. */
KVF_API kvf_status kvf_export_free(kvf_export exp);

/* ---- Handoff: decode side (since ABI 2) -------------------------------- *
 *
 *   kvf_receiver_create(decode_pool, key, key_len, NULL, &rcv);   once
 *   kvf_import_begin(rcv, manifest, manifest_len, &imp);   verify + admit
 *   kvf_import_write_pages(imp, first, buf, k * page_bytes);  as they come
 *     (every group's units: kvf_import_write_units, and ranges of a unit
 *      kvf_import_write_unit_range; since ABI 9)
 *   kvf_import_complete(imp, &lease);   every unit + checksum verified
 *   kvf_import_free(imp);  ... decode with lease ...
 */

/* A receiver imports into pool and verifies manifests with key. It
 * remembers the request IDs it imported (replay protection) while it
 * lives. config_json (NULL for defaults): {"max_ttl_ms": 300000 (refuse
 * manifests expiring further ahead), "admit_wait_ms": 0 (how long
 * kvf_import_begin waits for decode pages; 0 refuses a busy pool at once,
 * as kvf_admit's wait_ms), "transfer_timeout_ms": 120000 (abort an import
 * not completed in time)}. */
KVF_API kvf_status kvf_receiver_create(kvf_pool pool, const uint8_t *key, size_t key_len,
                                       const char *config_json, kvf_receiver *out);

/* Frees the receiver handle; imports it began stay valid until freed. */
KVF_API kvf_status kvf_receiver_destroy(kvf_receiver receiver);

/* Verifies a manifest (MAC first, then expiry, geometry, the tenant's
 * sharing domain in this pool, replay) and admits its import fail-closed:
 * prompt + max new tokens, with this pool's quota and capacity checks and
 * the admission statuses of kvf_admit. On any error nothing is allocated. */
KVF_API kvf_status kvf_import_begin(kvf_receiver receiver, const uint8_t *manifest, size_t manifest_len,
                                    kvf_import *out);

/* Pages and sizes the import expects; live until completed or aborted. */
KVF_API kvf_status kvf_import_describe(kvf_import imp, kvf_transfer_info *out);

/* Writes received pages first_page, first_page+1, ... of the per-token
 * group from buf (a positive multiple of page_bytes); on a pool with
 * window or state groups their units need kvf_import_write_units, or the
 * import is incomplete. A range outside the import (as for
 * kvf_export_read_pages: KVF_ERR_INVALID_ARGUMENT, naming the numbers)
 * and a NULL buf (KVF_ERR_NULL_POINTER) are refused before the import is
 * touched: nothing is written and the import stays live, so the call may
 * be retried with the right range. Any other error aborts the import: a
 * page twice (KVF_ERR_DUPLICATE_PAGE), an import that has ended
 * (KVF_ERR_STALE_TRANSFER, nothing written). */
KVF_API kvf_status kvf_import_write_pages(kvf_import imp, int64_t first_page, const uint8_t *buf, size_t buf_len);

/* The extents the import expects, as kvf_export_extents gives the
 * export's (the receiver checked that both pools have one cache spec).
 * Since ABI 9. */
KVF_API kvf_status kvf_import_extents(kvf_import imp, kvf_handoff_extent *buf, size_t buf_len, size_t *len,
                                      int64_t *units, int64_t *bytes);

/* Writes received units first_unit, first_unit+1, ... from buf: whole
 * units as kvf_export_read_units read them, the run ending where buf
 * does. A run outside the import (the rules of kvf_export_read_units:
 * KVF_ERR_INVALID_ARGUMENT, naming the numbers) and a NULL buf
 * (KVF_ERR_NULL_POINTER) are refused before the import is touched:
 * nothing is written and the import stays live. Any other error aborts
 * the import: a unit twice, or one received in ranges already
 * (KVF_ERR_DUPLICATE_PAGE), an import that has ended
 * (KVF_ERR_STALE_TRANSFER, nothing written). Calls for disjoint units may
 * run on several threads at once. Since ABI 9. */
KVF_API kvf_status kvf_import_write_units(kvf_import imp, int64_t first_unit, const uint8_t *buf, size_t buf_len);

/* Writes bytes [offset, offset + buf_len) of unit `unit`, received in
 * ranges. The import sums a unit as its ranges land, so a unit's ranges
 * are written one at a time and in order: the first at offset 0, each
 * next one where the last ended, every one but the unit's last a multiple
 * of 4096 bytes long; and one unit's ranges at a time (a run of whole
 * units may come between). A range outside the unit, empty, at an offset
 * that is not a multiple of 4096, or short of 4096 bytes' multiple while
 * not reaching the unit's end is refused as kvf_import_write_units'
 * ranges are (KVF_ERR_INVALID_ARGUMENT, the import live). A range out of
 * order (not where the unit's last ended, of another unit while one is
 * received in ranges, or while another range is being written) is also
 * KVF_ERR_INVALID_ARGUMENT, but it aborts the import: its bytes were lost
 * or reordered on the way. Other errors are kvf_import_write_units'. The
 * unit counts as received once its last range has landed. Since ABI 9. */
KVF_API kvf_status kvf_import_write_unit_range(kvf_import imp, int64_t unit, int64_t offset, const uint8_t *buf,
                                               size_t buf_len);

/* Verifies that every unit of every cache group arrived and the checksum
 * matches, and returns the decode lease: phase prefilled, written =
 * prompt tokens, its pages holding prompt + max new tokens, each sliding
 * window starting where the prompt's does. On failure the import is
 * aborted (KVF_ERR_INCOMPLETE_TRANSFER, whose message names the first
 * group some of whose units are missing; KVF_ERR_CHECKSUM_MISMATCH) and
 * its pages scrubbed in every group. */
KVF_API kvf_status kvf_import_complete(kvf_import imp, kvf_lease *out);

/* Ends an import that has not completed; its pages are scrubbed and its
 * request ID may be imported again. Does nothing after complete. */
KVF_API kvf_status kvf_import_abort(kvf_import imp);

/* Aborts the import unless it completed, and frees the handle; a
 * completed import's lease is unaffected. */
KVF_API kvf_status kvf_import_free(kvf_import imp);

/* ---- Handoff over UCX (since ABI 11) ------------------------------------ *
 *
 * The library moves the units itself, over UCX (handoff/ucxx): the decode
 * side's receiver serves on an address, the prefill side sends exports
 * there, and the decode engine takes the verified lease by request ID:
 *
 *   decode:  kvf_receiver_create(pool, key, key_len, NULL, &rcv);
 *            kvf_ucx_server_create(rcv, "10.0.0.2:13337", NULL, &srv);
 *            ... kvf_receiver_take(rcv, "req-1", &lease); (0 until it arrived)
 *   prefill: kvf_ucx_transport_create("10.0.0.2:13337", NULL, &tr);   once
 *            kvf_export_create(lease, key, key_len, max_new, 0, &exp);
 *            kvf_export_send_ucx(exp, tr, timeout_ms);  -> KVF_OK: delivered
 *            kvf_export_free(exp); kvf_lease_free(lease);
 *
 * The units are written into the decode pool's memory (host pools; a
 * CUDA pool's travel as messages), each verified before the lease is
 * handed out, exactly as a caller-carried import is. UCX's environment
 * (UCX_TLS, UCX_NET_DEVICES, ...) picks the fabric; the bytes are not
 * encrypted (see handoff/ucxx's package doc). options_json (NULL for
 * defaults): {"connect_timeout_ms": 10000, "message_timeout_ms": 60000,
 * "revoke_timeout_ms": 2000, "max_message_bytes": 67108864,
 * "max_conns": 256 (a server's), "data_path": "auto" | "messages" (a
 * server's: "messages" never writes the pool's memory remotely; "auto"
 * has the decode side receive each write into its pages itself where UCX
 * runs over TCP alone, and the prefill side write them with UCX's puts
 * elsewhere: handoff/ucxx's DataPath)}; bad JSON
 * is KVF_ERR_INVALID_CONFIG. Without UCX in the library every create
 * returns KVF_ERR_UNAVAILABLE.
 */

/* 1 if the library was built with UCX, else 0. */
KVF_API int kvf_ucx_available(void);

/* Serves the imports of receiver over UCX on addr ("host:port"; port 0
 * picks one, kvf_ucx_server_addr says which) until destroyed. */
KVF_API kvf_status kvf_ucx_server_create(kvf_receiver receiver, const char *addr, const char *options_json,
                                         kvf_ucx_server *out);

/* Writes the address the server listens on as a NUL-terminated string
 * into buf; *needed (if not NULL) gets its length + 1. */
KVF_API kvf_status kvf_ucx_server_addr(kvf_ucx_server server, char *buf, size_t buf_len, size_t *needed);

/* Stops the server: transfers in flight fail, their imports aborted and
 * scrubbed before it returns. */
KVF_API kvf_status kvf_ucx_server_destroy(kvf_ucx_server server);

/* A transport to the UCX server at addr; each send connects anew. */
KVF_API kvf_status kvf_ucx_transport_create(const char *addr, const char *options_json, kvf_ucx_transport *out);

/* Closes the transport: sends still going on it fail. */
KVF_API kvf_status kvf_ucx_transport_destroy(kvf_ucx_transport transport);

/* Sends the export and waits for the receiver's verdict, at most
 * timeout_ms (0: the transport's own timeouts only). KVF_OK: the decode
 * pool holds the verified lease, and the export has ended (its pages
 * scrubbed). Otherwise the receiver's reason (KVF_ERR_BAD_MAC,
 * KVF_ERR_REPLAY, KVF_ERR_CHECKSUM_MISMATCH, ...), KVF_ERR_TRANSPORT or
 * KVF_ERR_PROTOCOL, and the pages stay pinned for a retry until abort,
 * free or the reclaim deadline. */
KVF_API kvf_status kvf_export_send_ucx(kvf_export exp, kvf_ucx_transport transport, int64_t timeout_ms);

/* Takes the lease the receiver imported for request_id over a transport
 * (a UCX server), once: *out is its handle, or 0 if no such import has
 * completed (yet). */
KVF_API kvf_status kvf_receiver_take(kvf_receiver receiver, const char *request_id, kvf_lease *out);

/* ---- Rank workers (since ABI 5) ---------------------------------------- *
 *
 * Tensor parallelism with one process per rank (vLLM's and SGLang's
 * workers): the scheduler's process owns admission through a pool over
 * remote ranks (kvf_pool_create, "device": {"kind": "remote"}); each
 * rank's process holds the rank's shard of every region on its GPU and
 * runs a rank worker, which scrubs that shard when the scheduler frees
 * pages, on the worker's own stream, ordered after the engine's kernels:
 *
 *   kvf_region shard[2 * layers];   layer l's K shard in 2l, V in 2l+1
 *   kvf_rank_worker w;
 *   kvf_rank_worker_create("{\"connect\": \"unix:/run/kvf.sock\", \"rank\": 1,"
 *                          " \"device\": {\"kind\": \"cuda\", \"ordinal\": 1}}",
 *                          shard, 2 * layers, &w);
 *   each engine step:  ... queue the step's kernels on stream ...
 *                      kvf_rank_step(w, (uintptr_t)stream, 0, NULL);
 *   at the end:        kvf_rank_worker_close(w);
 *
 * Page IDs are the scheduler's: page p of shard region r is at
 * base + p * stride, and the pool's page p is page p of every rank.
 */

/* Opens the rank's device, registers its shard's regions, connects to the
 * scheduler and says hello as its rank. config_json:
 *   {"connect": "unix:PATH" or "tcp:HOST:PORT"   (the pool's "listen"),
 *    "rank": 0,                     (required; 0 <= rank < the pool's ranks)
 *    "device": {"kind": "cuda", "ordinal": 1}   (as a pool's; default host),
 *    "auto_step": false,            (true: launch each batch as it arrives)
 *    "step_lag": 0,                 (since ABI 8; 1: kvf_rank_step launches
 *                                    the batches that had arrived before
 *                                    the previous step, see kvf_rank_step)
 *    "connect_timeout_ms": 60000}   (0: 60 s)
 * The scheduler need not listen yet: the call tries again until
 * connect_timeout_ms, then returns KVF_ERR_NO_DEVICE. regions are the
 * rank's shard, n_regions of them (2 x layers, as the pool's regions):
 * base is the engine's memory, adopted (a CUDA device address, e.g. a
 * KV tensor's data_ptr(); on a host device the address of host memory),
 * which must stay allocated until kvf_rank_worker_close returns and be
 * written only under the scheduler's leases; base 0 asks the worker to
 * allocate the region (stride 0 or page_bytes; kvf_rank_worker_regions
 * gives the addresses). Every rank must describe shards of the same
 * number of regions; the scheduler's geometry must add up to the ranks'
 * page bytes. A bad region is KVF_ERR_INVALID_ARGUMENT, bad JSON
 * KVF_ERR_INVALID_CONFIG, and a failed call leaves nothing open: no
 * connection, no device. The worker owns a CUDA device's context retain
 * (the primary context, which the runtime and PyTorch share). */
KVF_API kvf_status kvf_rank_worker_create(const char *config_json, const kvf_region *regions, size_t n_regions,
                                          kvf_rank_worker *out);

/* Launches every scrub batch the scheduler handed to this rank since the
 * last step, ordered after stream and event with kvf_lease_release's rules
 * (a CUstream / cudaStream_t, KVF_STREAM_LEGACY, KVF_STREAM_PER_THREAD, a
 * CUevent; stream = event = 0: after all work of the device's context,
 * which blocks until the GPU is idle; a host device ignores them).
 * *launched (if not NULL) gets how many batches it launched, 0 if none
 * was waiting. Each batch is reported to the scheduler once its scrub has
 * completed; the scheduler frees its pages when every rank has. Call it
 * after queuing each engine step's kernels, and also while the engine is
 * idle, at least once per report_timeout_ms: a batch no step launches
 * makes the scheduler declare the rank lost. With "step_lag": 1 a batch
 * waits for one more step: it launches at the second step after it
 * arrived, ordered after everything the engine queued up to then. An
 * engine that runs a step ahead of the scheduler's bookkeeping (vLLM's
 * asynchronous scheduling: a request the scheduler frees may still be in
 * a step the worker has yet to queue) needs that step between; it must
 * then step twice within report_timeout_ms. Until the first call,
 * batches launch as they arrive with stream = event = 0 (the first is the
 * pool's initial scrub, which kvf_pool_create waits for before any engine
 * could step); with "auto_step" they always do, and a step seldom finds
 * one left. A stream or event the driver refuses is KVF_ERR_BAD_ORDERING:
 * nothing is launched and the batches wait for the next step. Once the
 * connection has ended, KVF_ERR_POOL_CLOSED if the scheduler closed it
 * (it destroyed its pool, or its process ended: the two look alike), or
 * KVF_ERR_DEVICE_FAILED with the reason if it broke; then close the
 * worker. */
KVF_API kvf_status kvf_rank_step(kvf_rank_worker worker, uintptr_t stream, uintptr_t event, size_t *launched);

/* Waits up to wait_ms for the connection to the scheduler to end (0 only
 * looks; wait_ms < 0 is KVF_ERR_INVALID_ARGUMENT). *ended (if not NULL)
 * gets 1 once it has ended and 0 if wait_ms passed first. The status is
 * KVF_OK, or KVF_ERR_DEVICE_FAILED with the reason when the connection
 * broke rather than closed (*ended is then 1). */
KVF_API kvf_status kvf_rank_worker_wait(kvf_rank_worker worker, int64_t wait_ms, int32_t *ended);

/* Copies the worker's regions into buf, as kvf_pool_regions does (base:
 * the device address, or the host memory's); *len (if not NULL) gets the
 * count. */
KVF_API kvf_status kvf_rank_worker_regions(kvf_rank_worker worker, kvf_region *buf, size_t buf_len, size_t *len);

/* Waits for steps in flight on other threads, closes the connection and
 * the device (memory it allocated is freed; adopted memory is not), and
 * invalidates the handle, whatever the status. Afterwards kvfence touches
 * the shard no more. A worker that closes while its pool lives makes the
 * scheduler lose the rank: scrubs in flight and every later one fail, and
 * the pool faults. */
KVF_API kvf_status kvf_rank_worker_close(kvf_rank_worker worker);

/* ---- Callbacks of language bindings (since ABI 7) ---------------------- *
 *
 * A binding that hands page memory to DLPack consumers (the Python
 * package: torch.from_dlpack) writes the DLManagedTensor deleter and the
 * capsule destructor in its own language. They run inside the consumer's
 * deallocation of a tensor, which may happen while an exception is
 * propagating (a frame unwinding drops its tensors): a callback into the
 * interpreter there sees that exception pending and fails, and the
 * interpreter's state is corrupted. These two C functions are safe there:
 * each takes the interpreter's lock, saves the pending exception, calls
 * the binding's callback, restores the exception and lets the lock go.
 * The binding registers its callbacks and its interpreter's functions
 * once, before its first export (the last registration wins); until then
 * both calls do nothing. */
typedef void (*kvf_py_err_fetch)(void **type, void **value, void **traceback);
typedef void (*kvf_py_err_restore)(void *type, void *value, void *traceback);
typedef int (*kvf_py_gil_ensure)(void);
typedef void (*kvf_py_gil_release)(int state);
typedef void (*kvf_py_callback)(void *arg);

/* Python's PyErr_Fetch, PyErr_Restore, PyGILState_Ensure and
 * PyGILState_Release. */
typedef struct kvf_py_api {
    kvf_py_err_fetch err_fetch;
    kvf_py_err_restore err_restore;
    kvf_py_gil_ensure gil_ensure;
    kvf_py_gil_release gil_release;
} kvf_py_api;

/* Registers the binding's deleter and capsule destructor, called by
 * kvf_py_dlpack_deleter and kvf_py_capsule_destructor with their
 * argument. Every pointer is required (KVF_ERR_NULL_POINTER). */
KVF_API kvf_status kvf_py_set_callbacks(const kvf_py_api *api, kvf_py_callback deleter, kvf_py_callback destructor);

/* The deleter to put in a DLManagedTensor the binding exports. */
KVF_API void kvf_py_dlpack_deleter(void *managed_tensor);

/* The destructor to give PyCapsule_New for such an export's capsule. */
KVF_API void kvf_py_capsule_destructor(void *capsule);

#endif /* KVFENCE_TYPES_ONLY */

#ifdef __cplusplus
}
#endif

#endif /* KVFENCE_H */
