//go:build cgo

// The C half of libkvfence: what needs no Go (version, status names) and
// the per-thread last error, which lives in C thread-local storage because
// Go has no notion of the calling OS thread. Fixed-size storage keeps it
// free of allocations, so threads that exit leak nothing.

#include <string.h>

#include "kvfence.h"
#include "lasterror.h"

#define KVF_VERSION_STRING "0.1.0"

static __thread kvf_error_info last_info;
static __thread char last_message[KVF_ERROR_MESSAGE_MAX];

void kvf__set_last_error(const kvf_error_info *info, const char *msg, size_t len) {
    last_info = *info;
    if (len > KVF_ERROR_MESSAGE_MAX - 1) {
        len = KVF_ERROR_MESSAGE_MAX - 1;
    }
    if (len > 0) {
        memcpy(last_message, msg, len);
    }
    last_message[len] = '\0';
    last_info.message_len = len;
}

const char *kvf_version(void) { return KVF_VERSION_STRING; }

uint32_t kvf_abi_version(void) { return KVF_ABI_VERSION; }

kvf_status kvf_last_error(kvf_error_info *info) {
    if (info == NULL) {
        return KVF_ERR_NULL_POINTER;
    }
    *info = last_info;
    return KVF_OK;
}

kvf_status kvf_last_error_message(char *buf, size_t buf_len, size_t *needed) {
    size_t len = (size_t)last_info.message_len;
    if (needed != NULL) {
        *needed = len + 1;
    }
    if (buf == NULL && buf_len > 0) {
        return KVF_ERR_NULL_POINTER;
    }
    if (buf_len < len + 1) {
        if (buf_len > 0) {
            memcpy(buf, last_message, buf_len - 1);
            buf[buf_len - 1] = '\0';
        }
        return KVF_ERR_BUFFER_TOO_SMALL;
    }
    memcpy(buf, last_message, len + 1);
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
    }
    return "KVF_ERR_UNKNOWN_STATUS";
}
