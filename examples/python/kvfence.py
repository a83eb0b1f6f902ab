"""kvfence: a ctypes wrapper of libkvfence (capi/include/kvfence.h).

Standard library only. The shared library is found through $KVFENCE_LIB,
then ../../capi/libkvfence.so next to this file (the repository layout),
then the system's library path. Build it with

    go build -buildmode=c-shared -o capi/libkvfence.so ./capi

Every failed call raises KvfenceError carrying the C status, the message
and the numbers of the refusal (need, have, limit ...), read from the
library's per-thread last error right after the call, on the same thread.
"""

import ctypes
import ctypes.util
import json
import os
import sys

ABI_VERSION = 5  # the library must implement at least this

# Status codes, as in kvfence.h.
OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_NULL_POINTER = 2
ERR_INVALID_HANDLE = 3
ERR_BUFFER_TOO_SMALL = 4
ERR_INTERNAL = 5
ERR_INVALID_CONFIG = 10
ERR_UNDERSIZED_POOL = 11
ERR_INVALID_REQUEST = 20
ERR_UNKNOWN_TENANT = 21
ERR_DUPLICATE_REQUEST = 22
ERR_EXCEEDS_MAX_CONTEXT = 23
ERR_EXCEEDS_CAPACITY = 24
ERR_EXCEEDS_QUOTA = 25
ERR_POOL_EXHAUSTED = 26
ERR_POOL_CLOSED = 30
ERR_POOL_FAULTED = 31
ERR_LEASE_RELEASED = 32
ERR_SCRUB_FAILED = 33
ERR_CANARY_MISMATCH = 34
ERR_INVALID_TENANT = 40
ERR_DUPLICATE_TENANT = 41
ERR_OVER_RESERVED = 42
ERR_NO_DEVICE = 50
ERR_DEVICE_OUT_OF_MEMORY = 51
ERR_DEVICE_FAILED = 52
ERR_BAD_ORDERING = 53

# The driver's special stream handles (kvfence.h: KVF_STREAM_LEGACY,
# KVF_STREAM_PER_THREAD).
STREAM_LEGACY = 0x1
STREAM_PER_THREAD = 0x2


def default_stream():
    """The stream a release is ordered after when none is given: PyTorch's
    current stream on the current device, if PyTorch is loaded and CUDA is
    initialized. Its default stream, whose cuda_stream reads 0, is the
    legacy default stream: returned as STREAM_LEGACY, since a 0 ordering
    means "all work of the context" to kvfence and would stall until the
    GPU is idle. Without PyTorch (or CUDA) it is 0: host pools ignore
    orderings. PyTorch is never imported here."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    s = torch.cuda.current_stream().cuda_stream
    return s if s else STREAM_LEGACY
ERR_LEASE_PHASE = 60
ERR_RECLAIMED = 61
ERR_STALE_TRANSFER = 62
ERR_DUPLICATE_PAGE = 63
ERR_INCOMPLETE_TRANSFER = 64
ERR_CHECKSUM_MISMATCH = 65
ERR_MALFORMED_MANIFEST = 66
ERR_BAD_MAC = 67
ERR_MANIFEST_EXPIRED = 68
ERR_GEOMETRY_MISMATCH = 69
ERR_DOMAIN_MISMATCH = 70
ERR_REPLAY = 71

# Lease phases (kvf_lease_phase).
PHASES = ("admitted", "prefilling", "prefilled", "exported", "importing", "released", "aborted")


class _ErrorInfo(ctypes.Structure):
    _fields_ = [
        ("status", ctypes.c_int32),
        ("retryable", ctypes.c_int32),
        ("permanent", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
        ("need", ctypes.c_int64),
        ("have", ctypes.c_int64),
        ("limit", ctypes.c_int64),
        ("need_tokens", ctypes.c_int64),
        ("limit_tokens", ctypes.c_int64),
        ("message_len", ctypes.c_uint64),
    ]


class _LeaseInfo(ctypes.Structure):
    _fields_ = [
        ("pages", ctypes.c_int64),
        ("capacity_tokens", ctypes.c_int64),
        ("prompt_tokens", ctypes.c_int64),
        ("max_new_tokens", ctypes.c_int64),
        ("written_tokens", ctypes.c_int64),
        ("live", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
    ]


class _Region(ctypes.Structure):
    _fields_ = [
        ("base", ctypes.c_uint64),
        ("stride", ctypes.c_int64),
        ("page_bytes", ctypes.c_int64),
        ("pages", ctypes.c_int64),
    ]


class _TransferInfo(ctypes.Structure):
    _fields_ = [
        ("pages", ctypes.c_int64),
        ("page_bytes", ctypes.c_int64),
        ("prompt_tokens", ctypes.c_int64),
        ("max_new_tokens", ctypes.c_int64),
        ("checksum", ctypes.c_uint32),
        ("live", ctypes.c_int32),
    ]


def _find_library():
    env = os.environ.get("KVFENCE_LIB")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    local = os.path.join(here, "..", "..", "capi", "libkvfence.so")
    if os.path.exists(local):
        return local
    found = ctypes.util.find_library("kvfence")
    if found:
        return found
    raise OSError("libkvfence not found: build it (go build -buildmode=c-shared "
                  "-o capi/libkvfence.so ./capi) or set KVFENCE_LIB")


_lib = ctypes.CDLL(_find_library())

_status = ctypes.c_int32
_handle = ctypes.c_uint64
_i64 = ctypes.c_int64
_size = ctypes.c_size_t
_P = ctypes.POINTER


def _fn(name, restype, *argtypes):
    f = getattr(_lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


_version = _fn("kvf_version", ctypes.c_char_p)
_abi_version = _fn("kvf_abi_version", ctypes.c_uint32)
_status_name = _fn("kvf_status_name", ctypes.c_char_p, _status)
_last_error = _fn("kvf_last_error", _status, _P(_ErrorInfo))
_last_error_message = _fn("kvf_last_error_message", _status, ctypes.c_char_p, _size, _P(_size))
_pool_create = _fn("kvf_pool_create", _status, ctypes.c_char_p, _P(_handle))
_pool_destroy = _fn("kvf_pool_destroy", _status, _handle)
_pool_add_tenant = _fn("kvf_pool_add_tenant", _status, _handle, ctypes.c_char_p, _i64, _i64)
_pool_update_tenant = _fn("kvf_pool_update_tenant", _status, _handle, ctypes.c_char_p, _i64, _i64)
_pool_stats_json = _fn("kvf_pool_stats_json", _status, _handle, ctypes.c_char_p, _size, _P(_size))
_pool_check = _fn("kvf_pool_check", _status, _handle)
_pool_clear_fault = _fn("kvf_pool_clear_fault", _status, _handle)
_admit = _fn("kvf_admit", _status, _handle, ctypes.c_char_p, ctypes.c_char_p, _i64, _i64, _i64, _P(_handle))
_block_table = _fn("kvf_lease_block_table", _status, _handle, _P(ctypes.c_int32), _size, _P(_size))
_slot_mapping = _fn("kvf_lease_slot_mapping", _status, _handle, _i64, _i64, _P(ctypes.c_int64), _size, _P(_size))
_commit = _fn("kvf_lease_commit", _status, _handle, _i64)
_describe = _fn("kvf_lease_describe", _status, _handle, _P(_LeaseInfo))
_release = _fn("kvf_lease_release", _status, _handle, ctypes.c_size_t, ctypes.c_size_t)
_free = _fn("kvf_lease_free", _status, _handle)

if _abi_version() < ABI_VERSION:
    raise ImportError("libkvfence ABI %d, this module needs %d" % (_abi_version(), ABI_VERSION))

# ABI 2.
_u8p = _P(ctypes.c_uint8)
_pool_add_tenant_json = _fn("kvf_pool_add_tenant_json", _status, _handle, ctypes.c_char_p)
_pool_update_tenant_json = _fn("kvf_pool_update_tenant_json", _status, _handle, ctypes.c_char_p)
_pool_regions = _fn("kvf_pool_regions", _status, _handle, _P(_Region), _size, _P(_size))
_pool_events_json = _fn("kvf_pool_events_json", _status, _handle, ctypes.c_char_p, _size, _P(_size))
_admit_tokens = _fn("kvf_admit_tokens", _status, _handle, ctypes.c_char_p, ctypes.c_char_p, _P(ctypes.c_int32), _size,
                    _i64, ctypes.c_char_p, _i64, _P(_handle))
_hit_tokens = _fn("kvf_lease_hit_tokens", _status, _handle, _P(_i64))
_cache_prefix = _fn("kvf_lease_cache_prefix", _status, _handle, _i64, _P(_i64))
_phase = _fn("kvf_lease_phase", _status, _handle, _P(ctypes.c_int32))
_begin_prefill = _fn("kvf_lease_begin_prefill", _status, _handle)
_finish_prefill = _fn("kvf_lease_finish_prefill", _status, _handle)
_abort = _fn("kvf_lease_abort", _status, _handle)
_export_create = _fn("kvf_export_create", _status, _handle, ctypes.c_char_p, _size, _i64, _i64, _P(_handle))
_export_manifest = _fn("kvf_export_manifest", _status, _handle, ctypes.c_char_p, _size, _P(_size))
_export_describe = _fn("kvf_export_describe", _status, _handle, _P(_TransferInfo))
_export_read_pages = _fn("kvf_export_read_pages", _status, _handle, _i64, ctypes.c_char_p, _size)
_export_ack = _fn("kvf_export_ack", _status, _handle)
_export_abort = _fn("kvf_export_abort", _status, _handle)
_export_free = _fn("kvf_export_free", _status, _handle)
_receiver_create = _fn("kvf_receiver_create", _status, _handle, ctypes.c_char_p, _size, ctypes.c_char_p, _P(_handle))
_receiver_destroy = _fn("kvf_receiver_destroy", _status, _handle)
_import_begin = _fn("kvf_import_begin", _status, _handle, ctypes.c_char_p, _size, _P(_handle))
_import_describe = _fn("kvf_import_describe", _status, _handle, _P(_TransferInfo))
_import_write_pages = _fn("kvf_import_write_pages", _status, _handle, _i64, ctypes.c_char_p, _size)
_import_complete = _fn("kvf_import_complete", _status, _handle, _P(_handle))
_import_abort = _fn("kvf_import_abort", _status, _handle)
_import_free = _fn("kvf_import_free", _status, _handle)

# ABI 3.
_grow = _fn("kvf_lease_grow", _status, _handle, _i64, _i64)
_preempt = _fn("kvf_lease_preempt", _status, _handle, _P(ctypes.c_int32), _size, _P(_i64))

# ABI 4.
_group_table = _fn("kvf_lease_group_table", _status, _handle, ctypes.c_char_p, _P(ctypes.c_int32), _size, _P(_size), _P(_i64))
_slide_windows = _fn("kvf_lease_slide_windows", _status, _handle, ctypes.c_size_t, ctypes.c_size_t, _P(_i64))

# ABI 5.
_rank_worker_create = _fn("kvf_rank_worker_create", _status, ctypes.c_char_p, _P(_Region), _size, _P(_handle))
_rank_step = _fn("kvf_rank_step", _status, _handle, ctypes.c_size_t, ctypes.c_size_t, _P(_size))
_rank_worker_wait = _fn("kvf_rank_worker_wait", _status, _handle, _i64, _P(ctypes.c_int32))
_rank_worker_regions = _fn("kvf_rank_worker_regions", _status, _handle, _P(_Region), _size, _P(_size))
_rank_worker_close = _fn("kvf_rank_worker_close", _status, _handle)


def version():
    return _version().decode()


def status_name(status):
    return _status_name(status).decode()


class KvfenceError(Exception):
    """A failed kvfence call: status (int), name, message and numbers."""

    def __init__(self, status):
        info = _ErrorInfo()
        _last_error(ctypes.byref(info))
        buf = ctypes.create_string_buffer(int(info.message_len) + 1)
        _last_error_message(buf, len(buf), None)
        self.status = status
        self.name = status_name(status)
        self.message = buf.value.decode(errors="replace")
        self.retryable = bool(info.retryable)
        self.permanent = bool(info.permanent)
        self.need, self.have, self.limit = info.need, info.have, info.limit
        self.need_tokens, self.limit_tokens = info.need_tokens, info.limit_tokens
        super().__init__(self.message)


def _check(status):
    if status != OK:
        raise KvfenceError(status)


def _bytes(s):
    return s.encode() if isinstance(s, str) else s


def _sized(call):
    """Runs call(buf, len, &needed) with the size-query protocol and returns
    the bytes written (NUL excluded for text)."""
    need = _size()
    st = call(None, 0, ctypes.byref(need))
    if st != ERR_BUFFER_TOO_SMALL:
        _check(st)
    buf = ctypes.create_string_buffer(need.value)
    _check(call(buf, len(buf), ctypes.byref(need)))
    return buf.raw[: need.value]


def _info(describe, h):
    ti = _TransferInfo()
    _check(describe(h, ctypes.byref(ti)))
    return {f: getattr(ti, f) for f, _ in _TransferInfo._fields_}


class Pool:
    """A kvfence pool. config is a dict or a JSON string (kvfence.h)."""

    def __init__(self, config):
        if not isinstance(config, (str, bytes)):
            config = json.dumps(config)
        h = _handle()
        _check(_pool_create(_bytes(config), ctypes.byref(h)))
        self._h = h.value

    def close(self):
        """Destroys the pool; its live leases are released and scrubbed."""
        if self._h:
            h, self._h = self._h, 0
            _check(_pool_destroy(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def add_tenant(self, name, quota_pages=0, reserved_pages=0):
        _check(_pool_add_tenant(self._h, _bytes(name), quota_pages, reserved_pages))

    def update_tenant(self, name, quota_pages=0, reserved_pages=0):
        """Changes quota and reservation; the tenant keeps its domain."""
        _check(_pool_update_tenant(self._h, _bytes(name), quota_pages, reserved_pages))

    def add_tenant_config(self, tenant):
        """Registers a tenant from a dict like the config's "tenants" items
        (name, quota_pages, reserved_pages, domain)."""
        _check(_pool_add_tenant_json(self._h, _bytes(json.dumps(tenant))))

    def replace_tenant_config(self, tenant):
        """Replaces a tenant's whole configuration; no "domain" means its own."""
        _check(_pool_update_tenant_json(self._h, _bytes(json.dumps(tenant))))

    def admit_tokens(self, request_id, tenant, token_ids, max_new_tokens=0, adapter=None, wait_ms=0):
        """Admits a prompt given as token IDs; the lease shares the longest
        prefix cached in the tenant's domain (Lease.hit_tokens())."""
        arr = (ctypes.c_int32 * len(token_ids))(*token_ids)
        h = _handle()
        _check(_admit_tokens(self._h, _bytes(request_id), _bytes(tenant), arr, len(token_ids), max_new_tokens,
                             _bytes(adapter) if adapter else None, wait_ms, ctypes.byref(h)))
        return Lease(h.value)

    def regions(self):
        """The pool's regions (layer l's K = 2l, V = 2l+1) as dicts with the
        device address of page 0 ("base", 0 for host memory) and "stride"."""
        n = _size()
        st = _pool_regions(self._h, None, 0, ctypes.byref(n))
        if st != ERR_BUFFER_TOO_SMALL:
            _check(st)
        buf = (_Region * n.value)()
        _check(_pool_regions(self._h, buf, n.value, ctypes.byref(n)))
        return [{f: getattr(r, f) for f, _ in _Region._fields_} for r in buf[: n.value]]

    def events(self):
        """The next batch of prefix-cache events (needs prefix.event_buffer)."""
        return json.loads(_sized(lambda b, n, need: _pool_events_json(self._h, b, n, need)).rstrip(b"\0"))["events"]

    def receiver(self, key, config=None):
        """A Receiver importing handoffs into this pool, verifying with key."""
        return Receiver(self, key, config)

    def admit(self, request_id, tenant, prompt_tokens, max_new_tokens=0, wait_ms=0):
        """Returns a Lease holding every page the request can need, or
        raises KvfenceError (nothing allocated)."""
        h = _handle()
        _check(_admit(self._h, _bytes(request_id), _bytes(tenant), prompt_tokens, max_new_tokens,
                      wait_ms, ctypes.byref(h)))
        return Lease(h.value)

    def stats(self):
        return json.loads(_sized(lambda b, n, need: _pool_stats_json(self._h, b, n, need)).rstrip(b"\0"))

    def check(self):
        _check(_pool_check(self._h))

    def clear_fault(self):
        _check(_pool_clear_fault(self._h))


class Lease:
    """An admitted request's pages. Use as a context manager, or call
    release() and free()."""

    def __init__(self, handle):
        self._h = handle

    def block_table(self):
        n = _size()
        st = _block_table(self._h, None, 0, ctypes.byref(n))
        if st != ERR_BUFFER_TOO_SMALL:
            _check(st)
        buf = (ctypes.c_int32 * n.value)()
        _check(_block_table(self._h, buf, n.value, ctypes.byref(n)))
        return list(buf[: n.value])

    def slot_mapping(self, start, end):
        buf = (ctypes.c_int64 * max(0, end - start))()
        n = _size()
        _check(_slot_mapping(self._h, start, end, buf, len(buf), ctypes.byref(n)))
        return list(buf[: n.value])

    def commit(self, tokens):
        _check(_commit(self._h, tokens))

    def group_table(self, group):
        """The pages (slots) the lease holds in cache group `group` of a
        pool made from a cache spec, and the logical page the first holds:
        (first, [ids]). A sliding window's ring comes in logical order from
        its oldest page; a state group gives the lease's one slot."""
        name = _bytes(group)
        n, first = _size(), _i64()
        st = _group_table(self._h, name, None, 0, ctypes.byref(n), ctypes.byref(first))
        if st != ERR_BUFFER_TOO_SMALL:
            _check(st)
        buf = (ctypes.c_int32 * max(1, n.value))()
        _check(_group_table(self._h, name, buf, n.value, ctypes.byref(n), ctypes.byref(first)))
        return first.value, list(buf[: n.value])

    def slide_windows(self, stream=None, event=0):
        """Moves the sliding windows to the written watermark: pages that
        fell out of a window are scrubbed (after the engine's work, as
        release() orders it) before this returns, and become the ring's
        pages for the next tokens. Returns the pages scrubbed."""
        if stream is None:
            stream = default_stream()
        n = _i64()
        _check(_slide_windows(self._h, stream, event, ctypes.byref(n)))
        return n.value

    def grow(self, tokens, wait_ms=0):
        """Makes room for tokens more tokens after the written watermark
        (a lease sized on demand). A refusal (KvfenceError: POOL_EXHAUSTED,
        EXCEEDS_QUOTA, EXCEEDS_MAX_CONTEXT, ...) tells the engine to finish
        or preempt the request; wait_ms > 0 waits that long for pages."""
        _check(_grow(self._h, tokens, wait_ms))

    def preempt(self, token_ids=None):
        """Gives the pages back, keeping the full pages of the written
        tokens (token_ids: all of them, prompt then output) in the prefix
        cache; returns the tokens kept. Admit the request again with
        admit_tokens(token_ids) to resume."""
        toks = list(token_ids or [])
        arr = (ctypes.c_int32 * len(toks))(*toks) if toks else None
        kept = _i64()
        _check(_preempt(self._h, arr, len(toks), ctypes.byref(kept)))
        return kept.value

    def info(self):
        li = _LeaseInfo()
        _check(_describe(self._h, ctypes.byref(li)))
        return {f: getattr(li, f) for f, _ in _LeaseInfo._fields_ if f != "reserved0"}

    def hit_tokens(self):
        n = _i64()
        _check(_hit_tokens(self._h, ctypes.byref(n)))
        return n.value

    def cache_prefix(self, tokens):
        """Publishes the computed prompt pages holding the first tokens
        tokens to the domain's prefix cache; returns the tokens shared."""
        n = _i64()
        _check(_cache_prefix(self._h, tokens, ctypes.byref(n)))
        return n.value

    def phase(self):
        ph = ctypes.c_int32()
        _check(_phase(self._h, ctypes.byref(ph)))
        return PHASES[ph.value] if 0 <= ph.value < len(PHASES) else ph.value

    def begin_prefill(self):
        _check(_begin_prefill(self._h))

    def finish_prefill(self):
        _check(_finish_prefill(self._h))

    def abort(self):
        _check(_abort(self._h))

    def export(self, key, max_new_tokens, ttl_ms=0):
        """Pins this prefilled lease's prompt pages for a handoff."""
        key = _bytes(key)
        h = _handle()
        _check(_export_create(self._h, key, len(key), max_new_tokens, ttl_ms, ctypes.byref(h)))
        return Export(h.value)

    def release(self, stream=None, event=0):
        """Ends the lease; the scrub runs after the engine's work on its
        pages: the CUDA stream (an integer handle; default: default_stream(),
        PyTorch's current stream) and event. stream=0 with event=0 orders it
        after all work of the pool's CUDA context (safe, but it blocks until
        the GPU is idle). A stream or event kvfence cannot use raises
        KvfenceError with ERR_BAD_ORDERING and leaves the lease live."""
        if stream is None:
            stream = default_stream()
        _check(_release(self._h, stream, event))

    def free(self):
        """Releases the lease if still live (after default_stream()) and
        frees the handle."""
        if self._h:
            if self.info()["live"]:
                try:
                    self.release()
                except KvfenceError as e:
                    if e.status not in (ERR_LEASE_RELEASED, ERR_POOL_CLOSED):
                        raise
            h, self._h = self._h, 0
            _check(_free(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


class Export:
    """The prefill side of a handoff: manifest() and read_pages() give the
    bytes to carry; ack() once the decode side completed the import."""

    def __init__(self, handle):
        self._h = handle

    def manifest(self):
        return _sized(lambda b, n, need: _export_manifest(self._h, b, n, need))

    def info(self):
        return _info(_export_describe, self._h)

    def read_pages(self, first, count):
        pb = self.info()["page_bytes"]
        buf = ctypes.create_string_buffer(count * pb)
        _check(_export_read_pages(self._h, first, buf, len(buf)))
        return buf.raw

    def ack(self):
        _check(_export_ack(self._h))

    def abort(self):
        _check(_export_abort(self._h))

    def free(self):
        if self._h:
            h, self._h = self._h, 0
            _check(_export_free(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


class Receiver:
    """The decode side of a handoff for one pool."""

    def __init__(self, pool, key, config=None):
        key = _bytes(key)
        cfg = _bytes(json.dumps(config)) if config else None
        h = _handle()
        _check(_receiver_create(pool._h, key, len(key), cfg, ctypes.byref(h)))
        self._h = h.value

    def begin(self, manifest):
        """Verifies the manifest and admits its import fail-closed."""
        h = _handle()
        _check(_import_begin(self._h, manifest, len(manifest), ctypes.byref(h)))
        return Import(h.value)

    def close(self):
        if self._h:
            h, self._h = self._h, 0
            _check(_receiver_destroy(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Import:
    """An import in progress; complete() returns the decode Lease."""

    def __init__(self, handle):
        self._h = handle

    def info(self):
        return _info(_import_describe, self._h)

    def write_pages(self, first, data):
        """Writes whole pages from page first. A range outside the import
        raises KvfenceError (KVF_ERR_INVALID_ARGUMENT) and leaves the import
        live; any other error aborts it."""
        _check(_import_write_pages(self._h, first, data, len(data)))

    def complete(self):
        h = _handle()
        _check(_import_complete(self._h, ctypes.byref(h)))
        return Lease(h.value)

    def abort(self):
        _check(_import_abort(self._h))

    def free(self):
        if self._h:
            h, self._h = self._h, 0
            _check(_import_free(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


class RankWorker:
    """One rank of a tensor-parallel group with one process per rank, as
    vLLM's and SGLang's worker processes run: the scheduler's process owns
    the Pool (config "device": {"kind": "remote", "listen": ..., "ranks":
    N}), and each rank's process serves its shard of every region with a
    RankWorker, which scrubs the pages the scheduler frees on this rank,
    after the engine's own kernels, when step() is called.

    connect is the pool's "listen" address ("unix:PATH" or "tcp:HOST:PORT");
    the scheduler need not listen yet (the worker keeps trying for
    connect_timeout_ms, 0: 60 s). regions is the rank's shard, one item per
    region (layer l's K is 2l, V is 2l+1), each a dict with "pages",
    "page_bytes" and either "base" (the engine's memory: a CUDA tensor's
    data_ptr(), with its "stride" between pages; base 0 or absent: the
    worker allocates the region) or, on a host device, "memory": a
    writable buffer (bytearray, ctypes array) that the worker adopts and
    keeps a reference to until close(). device is a pool's "device" dict
    ({"kind": "cuda", "ordinal": N}; default: host). With auto_step,
    batches launch as they arrive, after all work of the device's context,
    and step() is never needed. Use as a context manager, or call close().
    """

    def __init__(self, connect, rank, regions, device=None, auto_step=False, connect_timeout_ms=0):
        cfg = {"connect": connect, "rank": rank}
        if device is not None:
            cfg["device"] = device
        if auto_step:
            cfg["auto_step"] = True
        if connect_timeout_ms:
            cfg["connect_timeout_ms"] = connect_timeout_ms
        self._keep = []  # adopted buffers, alive until close()
        arr = (_Region * len(regions))()
        for i, r in enumerate(regions):
            base = r.get("base", 0)
            stride = r.get("stride", r["page_bytes"] if base or r.get("memory") is not None else 0)
            if r.get("memory") is not None:
                size = memoryview(r["memory"]).nbytes
                if size < (r["pages"] - 1) * stride + r["page_bytes"]:
                    raise ValueError("region %d: memory of %d bytes for %d pages %d bytes apart" % (i, size, r["pages"], stride))
                view = (ctypes.c_char * size).from_buffer(r["memory"])
                self._keep.append(view)
                base = ctypes.addressof(view)
            arr[i] = _Region(base, stride, r["page_bytes"], r["pages"])
        h = _handle()
        _check(_rank_worker_create(_bytes(json.dumps(cfg)), arr, len(arr), ctypes.byref(h)))
        self._h = h.value

    def step(self, stream=None, event=0):
        """Launches the scrubs the scheduler handed to this rank since the
        last step, after the engine's work: the CUDA stream (an integer
        handle; default: default_stream(), PyTorch's current stream, as
        Lease.release) and event. Returns how many batches it launched.
        Call it after each engine step, and while idle at least once per
        the pool's report_timeout_ms. Raises KvfenceError: ERR_BAD_ORDERING
        (nothing launched; step again with a usable stream),
        ERR_POOL_CLOSED once the scheduler closed the connection,
        ERR_DEVICE_FAILED if it broke."""
        if stream is None:
            stream = default_stream()
        n = _size()
        _check(_rank_step(self._h, stream, event, ctypes.byref(n)))
        return n.value

    def wait(self, wait_ms=0):
        """Waits up to wait_ms for the connection to the scheduler to end;
        True once it has (the scheduler destroyed its pool or is gone).
        Raises KvfenceError (ERR_DEVICE_FAILED) if it broke."""
        ended = ctypes.c_int32()
        _check(_rank_worker_wait(self._h, wait_ms, ctypes.byref(ended)))
        return bool(ended.value)

    def regions(self):
        """The worker's regions, as Pool.regions()."""
        n = _size()
        st = _rank_worker_regions(self._h, None, 0, ctypes.byref(n))
        if st != ERR_BUFFER_TOO_SMALL:
            _check(st)
        buf = (_Region * n.value)()
        _check(_rank_worker_regions(self._h, buf, n.value, ctypes.byref(n)))
        return [{f: getattr(r, f) for f, _ in _Region._fields_} for r in buf[: n.value]]

    def close(self):
        """Closes the connection and the device; kvfence touches the shard
        no more. While the scheduler's pool lives, it loses this rank and
        faults."""
        if self._h:
            h, self._h = self._h, 0
            try:
                _check(_rank_worker_close(h))
            finally:
                self._keep = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
