//go:build cgo

// The C half of libkvfence: what needs no Go (version, status names, the
// trampolines of language bindings' callbacks) and the per-thread last
// error, which lives on the C side because Go has no notion of the calling
// OS thread.
//
// The last error is kept in a heap block per thread, reached through a
// pthread key, not in __thread storage: a Go c-shared library is marked
// STATIC_TLS, and glibc has only a small surplus of static TLS for
// libraries loaded with dlopen (Python's ctypes), so kilobytes of __thread
// data would make dlopen fail. The key's destructor frees the block when
// the thread exits; a thread that never failed never allocates one.

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kvfence.h"
#include "lasterror.h"

#define KVF_VERSION_STRING "0.2.0"

struct last_error {
    kvf_error_info info;
    char message[KVF_ERROR_MESSAGE_MAX];
};

static pthread_key_t last_error_key;
static pthread_once_t last_error_once = PTHREAD_ONCE_INIT;
static int last_error_key_ok;

static void last_error_init(void) { last_error_key_ok = pthread_key_create(&last_error_key, free) == 0; }

// current returns this thread's block, allocating it if create is set; NULL
// if there is none (or no memory, in which case the error is dropped).
static struct last_error *current(int create) {
    pthread_once(&last_error_once, last_error_init);
    if (!last_error_key_ok) {
        return NULL;
    }
    struct last_error *e = pthread_getspecific(last_error_key);
    if (e == NULL && create) {
        e = calloc(1, sizeof *e);
        if (e != NULL && pthread_setspecific(last_error_key, e) != 0) {
            free(e);
            e = NULL;
        }
    }
    return e;
}

void kvf__set_last_error(const kvf_error_info *info, const char *msg, size_t len) {
    struct last_error *e = current(1);
    if (e == NULL) {
        return;
    }
    e->info = *info;
    if (len > KVF_ERROR_MESSAGE_MAX - 1) {
        len = KVF_ERROR_MESSAGE_MAX - 1;
    }
    if (len > 0) {
        memcpy(e->message, msg, len);
    }
    e->message[len] = '\0';
    e->info.message_len = len;
}

const char *kvf_version(void) { return KVF_VERSION_STRING; }

uint32_t kvf_abi_version(void) { return KVF_ABI_VERSION; }

kvf_status kvf_last_error(kvf_error_info *info) {
    if (info == NULL) {
        return KVF_ERR_NULL_POINTER;
    }
    const struct last_error *e = current(0);
    if (e == NULL) {
        memset(info, 0, sizeof *info);
    } else {
        *info = e->info;
    }
    return KVF_OK;
}

kvf_status kvf_last_error_message(char *buf, size_t buf_len, size_t *needed) {
    const struct last_error *e = current(0);
    const char *message = e == NULL ? "" : e->message;
    size_t len = e == NULL ? 0 : (size_t)e->info.message_len;
    if (needed != NULL) {
        *needed = len + 1;
    }
    if (buf == NULL && buf_len > 0) {
        return KVF_ERR_NULL_POINTER;
    }
    if (buf_len < len + 1) {
        if (buf_len > 0) {
            memcpy(buf, message, buf_len - 1);
            buf[buf_len - 1] = '\0';
        }
        return KVF_ERR_BUFFER_TOO_SMALL;
    }
    memcpy(buf, message, len + 1);
    return KVF_OK;
}

const char *kvf_status_name(kvf_status status) {
    switch (status) {
    case KVF_OK: return "KVF_OK";
    case KVF_ERR_INVALID_ARGUMENT: return "KVF_ERR_INVALID_ARGUMENT";
    case KVF_ERR_NULL_POINTER: return "KVF_ERR_NULL_POINTER";
    case KVF_ERR_INVALID_HANDLE: return "KVF_ERR_INVALID_HANDLE";
    case KVF_ERR_BUFFER_TOO_SMALL: return "KVF_ERR_BUFFER_TOO_SMALL";
    case KVF_ERR_INTERNAL: return "KVF_ERR_INTERNAL";
    case KVF_ERR_INVALID_CONFIG: return "KVF_ERR_INVALID_CONFIG";
    case KVF_ERR_UNDERSIZED_POOL: return "KVF_ERR_UNDERSIZED_POOL";
    case KVF_ERR_INVALID_REQUEST: return "KVF_ERR_INVALID_REQUEST";
    case KVF_ERR_UNKNOWN_TENANT: return "KVF_ERR_UNKNOWN_TENANT";
    case KVF_ERR_DUPLICATE_REQUEST: return "KVF_ERR_DUPLICATE_REQUEST";
    case KVF_ERR_EXCEEDS_MAX_CONTEXT: return "KVF_ERR_EXCEEDS_MAX_CONTEXT";
    case KVF_ERR_EXCEEDS_CAPACITY: return "KVF_ERR_EXCEEDS_CAPACITY";
    case KVF_ERR_EXCEEDS_QUOTA: return "KVF_ERR_EXCEEDS_QUOTA";
    case KVF_ERR_POOL_EXHAUSTED: return "KVF_ERR_POOL_EXHAUSTED";
    case KVF_ERR_POOL_CLOSED: return "KVF_ERR_POOL_CLOSED";
    case KVF_ERR_POOL_FAULTED: return "KVF_ERR_POOL_FAULTED";
    case KVF_ERR_LEASE_RELEASED: return "KVF_ERR_LEASE_RELEASED";
    case KVF_ERR_SCRUB_FAILED: return "KVF_ERR_SCRUB_FAILED";
    case KVF_ERR_CANARY_MISMATCH: return "KVF_ERR_CANARY_MISMATCH";
    case KVF_ERR_INVALID_TENANT: return "KVF_ERR_INVALID_TENANT";
    case KVF_ERR_DUPLICATE_TENANT: return "KVF_ERR_DUPLICATE_TENANT";
    case KVF_ERR_OVER_RESERVED: return "KVF_ERR_OVER_RESERVED";
    case KVF_ERR_NO_DEVICE: return "KVF_ERR_NO_DEVICE";
    case KVF_ERR_DEVICE_OUT_OF_MEMORY: return "KVF_ERR_DEVICE_OUT_OF_MEMORY";
    case KVF_ERR_DEVICE_FAILED: return "KVF_ERR_DEVICE_FAILED";
    case KVF_ERR_BAD_ORDERING: return "KVF_ERR_BAD_ORDERING";
    case KVF_ERR_LEASE_PHASE: return "KVF_ERR_LEASE_PHASE";
    case KVF_ERR_RECLAIMED: return "KVF_ERR_RECLAIMED";
    case KVF_ERR_STALE_TRANSFER: return "KVF_ERR_STALE_TRANSFER";
    case KVF_ERR_DUPLICATE_PAGE: return "KVF_ERR_DUPLICATE_PAGE";
    case KVF_ERR_INCOMPLETE_TRANSFER: return "KVF_ERR_INCOMPLETE_TRANSFER";
    case KVF_ERR_CHECKSUM_MISMATCH: return "KVF_ERR_CHECKSUM_MISMATCH";
    case KVF_ERR_MALFORMED_MANIFEST: return "KVF_ERR_MALFORMED_MANIFEST";
    case KVF_ERR_BAD_MAC: return "KVF_ERR_BAD_MAC";
    case KVF_ERR_MANIFEST_EXPIRED: return "KVF_ERR_MANIFEST_EXPIRED";
    case KVF_ERR_GEOMETRY_MISMATCH: return "KVF_ERR_GEOMETRY_MISMATCH";
    case KVF_ERR_DOMAIN_MISMATCH: return "KVF_ERR_DOMAIN_MISMATCH";
    case KVF_ERR_REPLAY: return "KVF_ERR_REPLAY";
    case KVF_ERR_IN_PROGRESS: return "KVF_ERR_IN_PROGRESS";
    case KVF_ERR_SHARD_MISMATCH: return "KVF_ERR_SHARD_MISMATCH";
    case KVF_ERR_NO_STATE_GROUP: return "KVF_ERR_NO_STATE_GROUP";
    case KVF_ERR_CHECKPOINT_CAPACITY: return "KVF_ERR_CHECKPOINT_CAPACITY";
    case KVF_ERR_TRANSPORT: return "KVF_ERR_TRANSPORT";
    case KVF_ERR_PROTOCOL: return "KVF_ERR_PROTOCOL";
    case KVF_ERR_UNAVAILABLE: return "KVF_ERR_UNAVAILABLE";
    case KVF_ERR_TIER_UNSUPPORTED: return "KVF_ERR_TIER_UNSUPPORTED";
    case KVF_ERR_ONLOAD_FAILED: return "KVF_ERR_ONLOAD_FAILED";
    case KVF_ERR_OFFLOAD_FAILED: return "KVF_ERR_OFFLOAD_FAILED";
    }
    return "KVF_ERR_UNKNOWN_STATUS";
}

// The binding's callbacks (kvf_py_set_callbacks). Registered once, before
// the first export they serve, and only read afterwards; a trampoline
// called before any registration does nothing.
static kvf_py_api py_api;
static kvf_py_callback py_deleter, py_destructor;

kvf_status kvf_py_set_callbacks(const kvf_py_api *api, kvf_py_callback deleter, kvf_py_callback destructor) {
    if (api == NULL || api->err_fetch == NULL || api->err_restore == NULL || api->gil_ensure == NULL ||
        api->gil_release == NULL || deleter == NULL || destructor == NULL) {
        return KVF_ERR_NULL_POINTER;
    }
    py_api = *api;
    py_deleter = deleter;
    py_destructor = destructor;
    return KVF_OK;
}

// py_call runs cb(arg) holding the interpreter's lock with no exception
// pending, and puts back whatever was pending before.
static void py_call(kvf_py_callback cb, void *arg) {
    if (cb == NULL) {
        return;
    }
    int gil = py_api.gil_ensure();
    void *type, *value, *traceback;
    py_api.err_fetch(&type, &value, &traceback);
    cb(arg);
    py_api.err_restore(type, value, traceback);
    py_api.gil_release(gil);
}

void kvf_py_dlpack_deleter(void *managed_tensor) { py_call(py_deleter, managed_tensor); }

void kvf_py_capsule_destructor(void *capsule) { py_call(py_destructor, capsule); }
