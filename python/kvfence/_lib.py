"""The C ABI (capi/include/kvfence.h) through ctypes: the library, its
structs and its functions, nothing else. Standard library only.

The library is found, in this order, at $KVFENCE_LIB, next to this file
(where `pip install` puts the one it built), in a source checkout
(capi/libkvfence.so two directories up), then on the system's library
path.
"""

import ctypes
import ctypes.util
import os

ABI_VERSION = 5  # the library must implement at least this

# The causes of a KVF_ERR_POOL_EXHAUSTED refusal (kvf_error_info.cause,
# ABI 8): the names KvfenceError.cause takes.
CAUSES = {0: None, 1: "reserved", 2: "kept_for_growth"}

# The driver's special stream handles (KVF_STREAM_LEGACY, KVF_STREAM_PER_THREAD).
STREAM_LEGACY = 0x1
STREAM_PER_THREAD = 0x2


class ErrorInfo(ctypes.Structure):
    _fields_ = [
        ("status", ctypes.c_int32),
        ("retryable", ctypes.c_int32),
        ("permanent", ctypes.c_int32),
        ("cause", ctypes.c_int32),  # KVF_CAUSE_* (ABI 8; 0 before)
        ("need", ctypes.c_int64),
        ("have", ctypes.c_int64),
        ("limit", ctypes.c_int64),
        ("need_tokens", ctypes.c_int64),
        ("limit_tokens", ctypes.c_int64),
        ("message_len", ctypes.c_uint64),
    ]


class LeaseInfo(ctypes.Structure):
    _fields_ = [
        ("pages", ctypes.c_int64),
        ("capacity_tokens", ctypes.c_int64),
        ("prompt_tokens", ctypes.c_int64),
        ("max_new_tokens", ctypes.c_int64),
        ("written_tokens", ctypes.c_int64),
        ("live", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
    ]


class Region(ctypes.Structure):
    _fields_ = [
        ("base", ctypes.c_uint64),
        ("stride", ctypes.c_int64),
        ("page_bytes", ctypes.c_int64),
        ("pages", ctypes.c_int64),
    ]


class TransferInfo(ctypes.Structure):
    _fields_ = [
        ("pages", ctypes.c_int64),
        ("page_bytes", ctypes.c_int64),
        ("prompt_tokens", ctypes.c_int64),
        ("max_new_tokens", ctypes.c_int64),
        ("checksum", ctypes.c_uint32),
        ("live", ctypes.c_int32),
    ]


GROUP_NAME_MAX = 129  # KVF_GROUP_NAME_MAX

# Cache group kinds (KVF_GROUP_*): the names the package gives them, the
# config's.
GROUP_KINDS = {1: "per_token", 2: "sliding_window", 3: "state"}


class HandoffExtent(ctypes.Structure):
    """kvf_handoff_extent (ABI 9): one cache group's part of a handoff."""
    _fields_ = [
        ("first_unit", ctypes.c_int64),
        ("units", ctypes.c_int64),
        ("unit_bytes", ctypes.c_int64),
        ("first_page", ctypes.c_int64),
        ("kind", ctypes.c_int32),
        ("group", ctypes.c_char * GROUP_NAME_MAX),
    ]


def library_path():
    """Where the library is loaded from (see the module doc)."""
    env = os.environ.get("KVFENCE_LIB")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(here, "libkvfence.so"), os.path.join(here, "..", "..", "capi", "libkvfence.so")):
        if os.path.exists(cand):
            return os.path.normpath(cand)
    found = ctypes.util.find_library("kvfence")
    if found:
        return found
    raise OSError("libkvfence not found: `pip install ./python` builds it, or build it with "
                  "`go build -buildmode=c-shared -o capi/libkvfence.so ./capi` and set KVFENCE_LIB")


lib = ctypes.CDLL(library_path())

_st = ctypes.c_int32
_h = ctypes.c_uint64
_i64 = ctypes.c_int64
_sz = ctypes.c_size_t
_up = ctypes.c_size_t  # uintptr_t
_vp = ctypes.c_void_p  # buffers: passed as integer addresses (no ctypes casts on the hot path)
# Out-parameters (POINTER(T)) take a T instance as it is: ctypes passes its
# address, which costs less than a byref() per call.
_s = ctypes.c_char_p
_P = ctypes.POINTER


def _fn(name, restype, *argtypes):
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


version = _fn("kvf_version", _s)
abi_version = _fn("kvf_abi_version", ctypes.c_uint32)
if abi_version() < ABI_VERSION:
    raise ImportError("libkvfence at %s implements ABI %d, this package needs %d"
                      % (library_path(), abi_version(), ABI_VERSION))

status_name = _fn("kvf_status_name", _s, _st)
last_error = _fn("kvf_last_error", _st, _P(ErrorInfo))
last_error_message = _fn("kvf_last_error_message", _st, _s, _sz, _P(_sz))

pool_create = _fn("kvf_pool_create", _st, _s, _P(_h))
pool_destroy = _fn("kvf_pool_destroy", _st, _h)
pool_add_tenant = _fn("kvf_pool_add_tenant", _st, _h, _s, _i64, _i64)
pool_update_tenant = _fn("kvf_pool_update_tenant", _st, _h, _s, _i64, _i64)
pool_add_tenant_json = _fn("kvf_pool_add_tenant_json", _st, _h, _s)
pool_update_tenant_json = _fn("kvf_pool_update_tenant_json", _st, _h, _s)
pool_stats_json = _fn("kvf_pool_stats_json", _st, _h, _s, _sz, _P(_sz))
pool_check = _fn("kvf_pool_check", _st, _h)
pool_clear_fault = _fn("kvf_pool_clear_fault", _st, _h)
pool_regions = _fn("kvf_pool_regions", _st, _h, _P(Region), _sz, _P(_sz))
pool_events_json = _fn("kvf_pool_events_json", _st, _h, _s, _sz, _P(_sz))

admit = _fn("kvf_admit", _st, _h, _s, _s, _i64, _i64, _i64, _P(_h))
admit_tokens = _fn("kvf_admit_tokens", _st, _h, _s, _s, _vp, _sz, _i64, _s, _i64, _P(_h))
# ABI 6: admission by token IDs that writes the block table in the same
# call; None with an older library (the package then makes two calls).
admit_tokens_table = (_fn("kvf_admit_tokens_table", _st, _h, _s, _s, _vp, _sz, _i64, _s, _i64, _vp, _sz, _P(_sz),
                          _P(_h)) if abi_version() >= 6 else None)
lease_block_table = _fn("kvf_lease_block_table", _st, _h, _vp, _sz, _P(_sz))
# ABI 8: extra key material per prompt page, and dropping the prefix
# cache; None with an older library.
admit_tokens_keyed = (_fn("kvf_admit_tokens_keyed", _st, _h, _s, _s, _vp, _sz, _i64, _s, _vp, _vp, _sz, _i64, _vp, _sz,
                          _P(_sz), _P(_h)) if abi_version() >= 8 else None)
pool_clear_prefix_cache = _fn("kvf_pool_clear_prefix_cache", _st, _h) if abi_version() >= 8 else None


class PyAPI(ctypes.Structure):
    """kvf_py_api: the interpreter's functions the library's callback
    trampolines call."""
    _fields_ = [("err_fetch", _vp), ("err_restore", _vp), ("gil_ensure", _vp), ("gil_release", _vp)]


# ABI 7: C trampolines for the DLPack deleter and capsule destructor, safe
# while an exception is pending; None with an older library (_dlpack then
# hands out its ctypes callbacks themselves).
py_set_callbacks = _fn("kvf_py_set_callbacks", _st, _P(PyAPI), _vp, _vp) if abi_version() >= 7 else None
py_dlpack_deleter = lib.kvf_py_dlpack_deleter if abi_version() >= 7 else None
py_capsule_destructor = lib.kvf_py_capsule_destructor if abi_version() >= 7 else None
lease_slot_mapping = _fn("kvf_lease_slot_mapping", _st, _h, _i64, _i64, _vp, _sz, _P(_sz))
lease_commit = _fn("kvf_lease_commit", _st, _h, _i64)
lease_grow = _fn("kvf_lease_grow", _st, _h, _i64, _i64)
lease_preempt = _fn("kvf_lease_preempt", _st, _h, _vp, _sz, _P(_i64))
lease_describe = _fn("kvf_lease_describe", _st, _h, _P(LeaseInfo))
lease_group_table = _fn("kvf_lease_group_table", _st, _h, _s, _vp, _sz, _P(_sz), _P(_i64))
lease_slide_windows = _fn("kvf_lease_slide_windows", _st, _h, _up, _up, _P(_i64))
lease_release = _fn("kvf_lease_release", _st, _h, _up, _up)
lease_free = _fn("kvf_lease_free", _st, _h)
lease_hit_tokens = _fn("kvf_lease_hit_tokens", _st, _h, _P(_i64))
lease_cache_prefix = _fn("kvf_lease_cache_prefix", _st, _h, _i64, _P(_i64))
# ABI 10: state checkpoints, the prefix cache of a pool with window or
# state groups; None with an older library.
lease_checkpoint_state = _fn("kvf_lease_checkpoint_state", _st, _h, _i64, _up, _up) if abi_version() >= 10 else None
lease_prefill_checkpoint = _fn("kvf_lease_prefill_checkpoint", _st, _h, _P(_i64)) if abi_version() >= 10 else None
lease_phase = _fn("kvf_lease_phase", _st, _h, _P(ctypes.c_int32))
lease_begin_prefill = _fn("kvf_lease_begin_prefill", _st, _h)
lease_finish_prefill = _fn("kvf_lease_finish_prefill", _st, _h)
lease_abort = _fn("kvf_lease_abort", _st, _h)

export_create = _fn("kvf_export_create", _st, _h, _s, _sz, _i64, _i64, _P(_h))
export_manifest = _fn("kvf_export_manifest", _st, _h, _s, _sz, _P(_sz))
export_describe = _fn("kvf_export_describe", _st, _h, _P(TransferInfo))
export_read_pages = _fn("kvf_export_read_pages", _st, _h, _i64, _vp, _sz)
export_ack = _fn("kvf_export_ack", _st, _h)
export_abort = _fn("kvf_export_abort", _st, _h)
export_free = _fn("kvf_export_free", _st, _h)
receiver_create = _fn("kvf_receiver_create", _st, _h, _s, _sz, _s, _P(_h))
receiver_destroy = _fn("kvf_receiver_destroy", _st, _h)
import_begin = _fn("kvf_import_begin", _st, _h, _s, _sz, _P(_h))
import_describe = _fn("kvf_import_describe", _st, _h, _P(TransferInfo))
import_write_pages = _fn("kvf_import_write_pages", _st, _h, _i64, _vp, _sz)
import_complete = _fn("kvf_import_complete", _st, _h, _P(_h))
# ABI 9: every cache group's units, whole or in ranges of one; None with
# an older library (a pool with window or state groups then takes no
# handoff through the package).
if abi_version() >= 9:
    export_extents = _fn("kvf_export_extents", _st, _h, _P(HandoffExtent), _sz, _P(_sz), _P(_i64), _P(_i64))
    export_read_units = _fn("kvf_export_read_units", _st, _h, _i64, _vp, _sz)
    export_read_unit_range = _fn("kvf_export_read_unit_range", _st, _h, _i64, _i64, _vp, _sz)
    import_extents = _fn("kvf_import_extents", _st, _h, _P(HandoffExtent), _sz, _P(_sz), _P(_i64), _P(_i64))
    import_write_units = _fn("kvf_import_write_units", _st, _h, _i64, _vp, _sz)
    import_write_unit_range = _fn("kvf_import_write_unit_range", _st, _h, _i64, _i64, _vp, _sz)
else:
    export_extents = export_read_units = export_read_unit_range = None
    import_extents = import_write_units = import_write_unit_range = None
import_abort = _fn("kvf_import_abort", _st, _h)
import_free = _fn("kvf_import_free", _st, _h)
# ABI 11: handoffs over UCX, moved by the library; None with an older one.
if abi_version() >= 11:
    ucx_available = _fn("kvf_ucx_available", ctypes.c_int)
    ucx_server_create = _fn("kvf_ucx_server_create", _st, _h, _s, _s, _P(_h))
    ucx_server_addr = _fn("kvf_ucx_server_addr", _st, _h, _s, _sz, _P(_sz))
    ucx_server_destroy = _fn("kvf_ucx_server_destroy", _st, _h)
    ucx_transport_create = _fn("kvf_ucx_transport_create", _st, _s, _s, _P(_h))
    ucx_transport_destroy = _fn("kvf_ucx_transport_destroy", _st, _h)
    export_send_ucx = _fn("kvf_export_send_ucx", _st, _h, _h, _i64)
    receiver_take = _fn("kvf_receiver_take", _st, _h, _s, _P(_h))
else:
    ucx_available = ucx_server_create = ucx_server_addr = ucx_server_destroy = None
    ucx_transport_create = ucx_transport_destroy = export_send_ucx = receiver_take = None

rank_worker_create = _fn("kvf_rank_worker_create", _st, _s, _P(Region), _sz, _P(_h))
rank_step = _fn("kvf_rank_step", _st, _h, _up, _up, _P(_sz))
rank_worker_wait = _fn("kvf_rank_worker_wait", _st, _h, _i64, _P(ctypes.c_int32))
rank_worker_regions = _fn("kvf_rank_worker_regions", _st, _h, _P(Region), _sz, _P(_sz))
rank_worker_close = _fn("kvf_rank_worker_close", _st, _h)
