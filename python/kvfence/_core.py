"""Pools, leases, handoffs and rank workers over the C ABI."""

import array
import ctypes
import gc
import json
import sys
import warnings
import weakref

from . import _lib, _views
from ._lib import STREAM_LEGACY
from .errors import (BufferTooSmall, InvalidArgument, InvalidConfig, InvalidRequest, InvalidTenant, PoolClosed,
                     UnknownTenant, check, from_last_error)

PHASES = ("admitted", "prefilling", "prefilled", "exported", "importing", "released", "aborted")

_ERR_BUFFER_TOO_SMALL = BufferTooSmall.status
_ERR_LEASE_RELEASED = 32
_ERR_POOL_CLOSED = PoolClosed.status

# Pool.admit_tokens passes a max_new_tokens or wait_ms that is the int 0
# object itself (the defaults) as this one c_int64, which ctypes passes
# without converting; every other value, 0.0 and False included, goes
# through ctypes' conversion as before.
_ZERO = 0
_I64_ZERO = ctypes.c_int64(0)


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


def _b(s):
    return s.encode() if isinstance(s, str) else s


def _nul(what, s, exc):
    """The error for a string argument with a NUL byte in it: C reads a
    string up to its first NUL, so "acme\\0x" would reach the library as
    "acme", another tenant's name (or another request's ID). exc is the
    class of the status the library gives a bad value of the argument."""
    return exc("kvfence: %s %r contains a NUL byte, which a C string cannot carry" % (what, s), exc.status)


def _cstr(s, what, exc):
    """s (str or bytes) as the bytes of a C string argument; a NUL byte in
    it is refused with exc (_nul)."""
    b = s.encode() if isinstance(s, str) else s
    if type(b) is bytes and b"\0" in b:
        raise _nul(what, s, exc)
    return b


# torch.Tensor, torch.int32 and torch.strided once torch is loaded (and
# has Tensor.is_cpu): `type(x) is _Tensor and x.dtype is _INT32 and
# x.layout is _STRIDED and x.is_cpu ...` is the fast test of a tensor that
# C may read or write as it is. Until then nothing passes it.
_Tensor = None


class _NoDtype:
    pass


_INT32 = _STRIDED = _NoDtype


def _tensor_type():
    global _Tensor, _INT32, _STRIDED
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch.Tensor, "is_cpu"):
        _Tensor, _INT32, _STRIDED = torch.Tensor, torch.int32, torch.strided
    return torch


def _int32s(ids, what="token_ids"):
    """(address, count, keep-alive) of ids as contiguous int32: a torch
    tensor or numpy array of int32 is passed as it is (no copy); other
    integer tensors and arrays are converted after a range check; any
    other sequence of ints goes through array('i'). (Pool.admit_tokens
    repeats the first test inline: a dense 1-D int32 CPU tensor.)"""
    if (type(ids) is _Tensor and ids.dtype is _INT32 and ids.layout is _STRIDED and ids.is_cpu and ids.ndim == 1
            and ids.is_contiguous()):
        return ids.data_ptr(), ids.numel(), ids  # read in place
    torch = _tensor_type()
    if torch is not None and isinstance(ids, torch.Tensor):
        if ids.layout != torch.strided:
            raise TypeError("kvfence: %s must be a dense tensor, not %s" % (what, ids.layout))
        if ids.dim() != 1:
            raise ValueError("kvfence: %s must be 1-D, got shape %s" % (what, tuple(ids.shape)))
        if ids.device.type == "meta":
            raise ValueError("kvfence: %s is a meta tensor, which holds no values" % what)
        if ids.dtype != torch.int32:
            if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                raise TypeError("kvfence: %s must be integers, got %s" % (what, ids.dtype))
            if ids.numel() and (int(ids.min()) < -(1 << 31) or int(ids.max()) >= (1 << 31)):
                raise ValueError("kvfence: %s outside int32" % what)
            ids = ids.to(torch.int32)
        if ids.device.type != "cpu":
            ids = ids.cpu()
        ids = ids.contiguous()
        return ids.data_ptr(), ids.numel(), ids
    np = sys.modules.get("numpy")
    if np is not None and isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            raise ValueError("kvfence: %s must be 1-D, got shape %s" % (what, ids.shape))
        if ids.dtype != np.int32:
            if ids.dtype.kind not in "iu":
                raise TypeError("kvfence: %s must be integers, got %s" % (what, ids.dtype))
            if ids.size and (int(ids.min()) < -(1 << 31) or int(ids.max()) >= (1 << 31)):
                raise ValueError("kvfence: %s outside int32" % what)
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        return ids.ctypes.data, ids.size, ids
    if isinstance(ids, array.array) and ids.typecode == "i" and ids.itemsize == 4:
        return ids.buffer_info()[0], len(ids), ids
    if isinstance(ids, (bytes, bytearray, memoryview, str)):
        raise TypeError("kvfence: %s must be integers, not %s" % (what, type(ids).__name__))
    try:
        a = array.array("i", ids)
    except OverflowError as e:
        raise ValueError("kvfence: %s outside int32: %s" % (what, e)) from None
    return a.buffer_info()[0], len(a), a


def _int32_out(out):
    """(address, capacity) of a writable contiguous int32 buffer: a dense
    CPU tensor, a numpy array or an array('i'). (Lease.write_block_table
    and Pool.admit_tokens repeat the tensor test inline.)"""
    if type(out) is _Tensor and out.dtype is _INT32 and out.layout is _STRIDED and out.is_cpu and out.is_contiguous():
        return out.data_ptr(), out.numel()
    torch = _tensor_type()
    if torch is not None and isinstance(out, torch.Tensor):
        if (out.dtype != torch.int32 or out.layout != torch.strided or out.device.type != "cpu"
                or not out.is_contiguous()):
            raise ValueError("kvfence: out must be a contiguous int32 CPU tensor, not a %s %s tensor on %s"
                             % (out.layout, out.dtype, out.device))
        return out.data_ptr(), out.numel()
    np = sys.modules.get("numpy")
    if np is not None and isinstance(out, np.ndarray):
        if out.dtype != np.int32 or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("kvfence: out must be a writable contiguous int32 array")
        return out.ctypes.data, out.size
    if isinstance(out, array.array) and out.typecode == "i" and out.itemsize == 4:
        return out.buffer_info()
    raise TypeError("kvfence: out must be an int32 tensor, numpy array or array('i'), not %s" % type(out).__name__)


class _PyBuffer(ctypes.Structure):
    """Py_buffer, the buffer protocol's view (in the stable ABI since
    Python 3.11, and unchanged since 3.3)."""
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


try:  # CPython's own buffer calls: read-only buffers in place (elsewhere: copied)
    _get_buffer = ctypes.pythonapi.PyObject_GetBuffer
    _get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
    _get_buffer.restype = ctypes.c_int
    _release_buffer = ctypes.pythonapi.PyBuffer_Release
    _release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
    _release_buffer.restype = None
except AttributeError:
    _get_buffer = None


class _Exported:
    """A read-only buffer's memory (PyBUF_SIMPLE: contiguous bytes),
    exported by its owner while this lives: a slice of a received message
    (memoryview(msg)[a:b]) is written from where it lies, with no copy."""

    __slots__ = ("view", "held")

    def __init__(self, obj):
        self.view, self.held = _PyBuffer(), False
        _get_buffer(obj, self.view, 0)  # raises the owner's error if it cannot
        self.held = True

    def __del__(self):
        if self.held:
            self.held = False
            _release_buffer(self.view)


def _buffer(data, writable):
    """(address, bytes, keep-alive) of a contiguous buffer: bytes (read
    only), bytearray, memoryview, a ctypes array, a numpy array or a CPU
    torch tensor. None is copied: a read-only buffer other than bytes is
    read where it lies too, where CPython's buffer calls are at hand."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError("kvfence: a page buffer must be a contiguous CPU tensor")
        return data.data_ptr(), data.numel() * data.element_size(), data
    if isinstance(data, bytes):
        if writable:
            raise TypeError("kvfence: bytes are read-only; pass a bytearray or a tensor")
        c = ctypes.c_char_p(data)
        return ctypes.cast(c, ctypes.c_void_p).value or 0, len(data), (data, c)
    mv = memoryview(data)
    if not mv.contiguous:
        raise ValueError("kvfence: a page buffer must be contiguous")
    if mv.readonly:
        if writable:
            raise TypeError("kvfence: a read-only buffer cannot receive pages")
        if _get_buffer is None:
            return _buffer(mv.tobytes(), False)
        ex = _Exported(mv)
        return ex.view.buf or 0, mv.nbytes, (mv, ex)
    c = (ctypes.c_char * mv.nbytes).from_buffer(mv)
    return ctypes.addressof(c), mv.nbytes, (mv, c)


def _sized_text(call):
    """The bytes of a call that writes into a caller buffer (stats, events,
    a manifest): the size first, then the copy; asked again while the text
    outgrows the buffer, which another thread's change of the pool between
    the two calls can make it do."""
    need = ctypes.c_size_t()
    st, text, have = call(None, 0, ctypes.byref(need)), b"", 0
    while st == _ERR_BUFFER_TOO_SMALL and need.value > have:
        buf = ctypes.create_string_buffer(need.value)
        have = len(buf)
        st = call(buf, have, ctypes.byref(need))
        text = buf.raw[: need.value]
    check(st)
    return text


def _regions(call, h):
    n = ctypes.c_size_t()
    st = call(h, None, 0, ctypes.byref(n))
    if st != _ERR_BUFFER_TOO_SMALL:
        check(st)
    buf = (_lib.Region * max(1, n.value))()
    check(call(h, buf, n.value, ctypes.byref(n)))
    return [{f: getattr(r, f) for f, _ in _lib.Region._fields_} for r in buf[: n.value]]


class _PoolState:
    """What a pool's handle, its leases, views and finalizer share."""

    __slots__ = ("handle", "harg", "closed", "destroyed", "error", "keep", "__weakref__")

    def __init__(self, handle, keep):
        self.handle = handle
        # The handle as a ctypes argument, for the admission's calls: an
        # instance of the argument's type passes as it is, with no
        # conversion per call.
        self.harg = ctypes.c_uint64(handle)
        self.closed = False
        self.destroyed = False
        self.error = None
        self.keep = keep  # adopted engine memory: alive until the Go pool is destroyed


def _destroy(state):
    """Runs once the pool is closed (or unreachable) and no view of its
    memory is left: destroys the Go pool, which frees its memory."""
    st = _lib.pool_destroy(state.handle)
    state.destroyed = True
    if st:
        state.error = from_last_error(st)
    state.keep = None


class Pool:
    """A kvfence pool. config is a dict or a JSON string (capi/README.md
    has the schema); adopt, instead of the config's "geometry"/"cache", is
    an engine cache of kvfence.layouts (tensors the engine allocated, which
    the pool adopts: the pool keeps them referenced until it is destroyed).

    Use as a context manager, or call close(). See _views for what views
    of the pool's memory may do, and close() for their lifetime."""

    def __init__(self, config, adopt=None):
        if isinstance(config, (str, bytes)):
            config = json.loads(config)
        config = dict(config)
        if adopt is not None:
            clash = [k for k in ("geometry", "cache", "preset") if k in config]
            if clash:
                raise ValueError("kvfence: adopt= gives the cache; the config must not have %s" % ", ".join(clash))
            config["cache"] = adopt.cache_spec()
            config.setdefault("pages", adopt.num_blocks)
        self.config = config
        tier = config.get("host_tier")
        if isinstance(tier, dict) and "checkpoints" in tier and _lib.abi_version() < 13:
            # An older library refuses the key as unknown; say why.
            raise InvalidConfig("kvfence: host_tier's \"checkpoints\" (a hybrid pool's state checkpoints in the tier) "
                                "needs a library of ABI 13 (this one is %d)" % _lib.abi_version(), InvalidConfig.status)
        dev = config.get("device") or {}
        kind = dev.get("kind", "host")
        self.device = ("cuda", int(dev.get("ordinal", 0))) if kind == "cuda" else ("remote" if kind == "remote" else "cpu")
        if adopt is not None and adopt.device != self.device:
            raise ValueError("kvfence: the adopted cache is on %s, the pool's device is %s" % (adopt.device, self.device))
        h = ctypes.c_uint64()
        check(_lib.pool_create(_b(json.dumps(config)), ctypes.byref(h)))
        self._state = _PoolState(h.value, adopt)
        self._mem = _views.Memory(self._state)
        self._finalizer = weakref.finalize(self._mem, _destroy, self._state)
        # Handles of the leases not yet freed (a set of ints, cheaper than
        # weak references on the admission path): close() releases them.
        self._live = set()
        self.adopted = adopt
        stats = self.stats()
        self.tokens_per_page = stats["tokens_per_page"]
        self.num_pages = stats["total_pages"]
        self._max_context = int(config.get("max_context_tokens", 0))  # for admit_tokens(block_table=) before ABI 6

    # ---- lifetime

    @property
    def closed(self):
        return self._state.closed

    @property
    def destroyed(self):
        """True once the Go pool is destroyed and its memory freed (after
        close() and the last view's end)."""
        return self._state.destroyed

    def _handle(self):
        if self._state.closed:
            raise PoolClosed("the pool is closed", _ERR_POOL_CLOSED)
        return self._state.handle

    def close(self):
        """Closes the pool: live leases are released (ordered after
        default_stream()) and scrubbed, and every later call on the pool,
        its views and its leases' admissions raises PoolClosed. The Go pool
        (kvf_pool_destroy: the prefix cache dropped and scrubbed, memory
        freed) is destroyed now if no view of its memory is left, else
        when the last one dies, with a ResourceWarning: no view ever points
        into freed memory. Raises the final scrub's error, if any."""
        st = self._state
        if st.closed:
            return
        stream = default_stream()
        for h in list(self._live):
            _lib.lease_release(h, stream, 0)  # already released or freed: a refusal, nothing else
        st.closed = True
        self._mem = None  # the last reference but the views': destroys now if there are none
        if not st.destroyed:
            gc.collect()  # views in reference cycles
        if not st.destroyed:
            warnings.warn("kvfence: pool closed while views of its memory are alive; the pool (and its "
                          "memory) is destroyed when the last of them dies", ResourceWarning, stacklevel=2)
        elif st.error is not None:
            err, st.error = st.error, None
            raise err

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- tenants, stats

    def add_tenant(self, name, quota_pages=0, reserved_pages=0):
        check(_lib.pool_add_tenant(self._handle(), _cstr(name, "tenant name", InvalidTenant), quota_pages,
                                   reserved_pages))

    def update_tenant(self, name, quota_pages=0, reserved_pages=0):
        """Changes quota and reservation; the tenant keeps its domain."""
        check(_lib.pool_update_tenant(self._handle(), _cstr(name, "tenant name", UnknownTenant), quota_pages,
                                      reserved_pages))

    def add_tenant_config(self, tenant):
        """Registers a tenant from a dict like the config's "tenants" items."""
        check(_lib.pool_add_tenant_json(self._handle(), _b(json.dumps(tenant))))

    def replace_tenant_config(self, tenant):
        """Replaces a tenant's whole configuration; no "domain" means its own."""
        check(_lib.pool_update_tenant_json(self._handle(), _b(json.dumps(tenant))))

    def tier_stats(self):
        """The host tier's figures (the stats' "tier", ABI 12): slots by
        state, pages copied each way, swaps; {"enabled": False} without
        one, or on an older library. Since ABI 13 they have a hybrid
        pool's state checkpoints in the tier (the config's
        "host_tier": {"checkpoints": N}): "checkpoint_slots",
        "checkpoint_slot_bytes", "checkpoints" (held), "checkpoints_stored",
        "checkpoints_dropped", "checkpoints_failed", "checkpoints_restored",
        "checkpoint_restore_bytes", "checkpoint_restores_failed",
        "checkpoints_evicted"; "slots" counts both spaces (free + cached +
        swapped + checkpoints + in_flight + quarantined + retired)."""
        return self.stats().get("tier", {"enabled": False})

    def stats(self):
        h = self._handle()
        return json.loads(_sized_text(lambda b, n, need: _lib.pool_stats_json(h, b, n, need)).rstrip(b"\0"))

    def check(self):
        """Verifies the pool's accounting (raises Internal if broken)."""
        check(_lib.pool_check(self._handle()))

    def clear_fault(self):
        check(_lib.pool_clear_fault(self._handle()))

    def events(self):
        """The next batch of prefix-cache events (needs prefix.event_buffer)."""
        h = self._handle()
        return json.loads(_sized_text(lambda b, n, need: _lib.pool_events_json(h, b, n, need)).rstrip(b"\0"))["events"]

    # ---- admission

    def admit(self, request_id, tenant, prompt_tokens, max_new_tokens=0, wait_ms=0):
        """A Lease holding every page the request can need, or raises an
        AdmissionError (nothing allocated). wait_ms > 0 waits that long for
        pages (the GIL is released meanwhile)."""
        h = ctypes.c_uint64()
        rid, ten = _cstr(request_id, "request_id", InvalidRequest), _cstr(tenant, "tenant", InvalidRequest)
        check(_lib.admit(self._handle(), rid, ten, prompt_tokens, max_new_tokens, wait_ms, ctypes.byref(h)))
        return Lease(self, h.value, -(-(prompt_tokens + max_new_tokens) // self.tokens_per_page))

    def admit_tokens(self, request_id, tenant, token_ids, max_new_tokens=0, adapter=None, wait_ms=0, block_table=None,
                     page_extra=None):
        """Admits a prompt given as its token IDs (a list, array('i'), or an
        int32/int64 tensor or numpy array: int32 ones are read in place);
        kvfence derives the page keys and the lease shares the longest
        prefix cached in the tenant's domain (Lease.hit_tokens()).

        block_table, if given, receives the lease's block table, as
        Lease.write_block_table(block_table) would, in the same call into
        the library (kvf_admit_tokens_table; two calls with a library
        older than ABI 6); its length is the lease's table_len. It must
        hold ceil((len(token_ids) + max_new_tokens) / tokens_per_page)
        entries, the most the lease can grow to, or BufferTooSmall is
        raised (need: that number) with nothing admitted and block_table
        unchanged.

        adapter (a LoRA's name, any ID of the weights) roots every key.
        page_extra, a sequence with one entry per prompt page (bytes, or
        None / b"" for none; the partial last page included), is extra key
        material of those pages (kvf_admit_tokens_keyed, ABI 8): what else
        than its tokens a page's KV depends on, such as the images behind
        a multimodal prompt's placeholder tokens. Equal tokens with other
        material never share a page from the first page with material on."""
        if page_extra:
            return self._admit_keyed(request_id, tenant, token_ids, max_new_tokens, adapter, wait_ms, block_table,
                                     page_extra)
        state = self._state
        if state.closed:
            raise PoolClosed("the pool is closed", _ERR_POOL_CLOSED)
        # The test of _int32s, inline: a dense 1-D int32 CPU tensor is read
        # in place (token_ids keeps it alive through the call).
        if (type(token_ids) is _Tensor and token_ids.dtype is _INT32 and token_ids.layout is _STRIDED
                and token_ids.is_cpu and token_ids.ndim == 1 and token_ids.is_contiguous()):
            addr, n, keep = token_ids.data_ptr(), token_ids.numel(), None
        else:
            addr, n, keep = _int32s(token_ids)
        rid = request_id.encode() if type(request_id) is str else request_id
        ten = tenant.encode() if type(tenant) is str else tenant
        if type(rid) is bytes and b"\0" in rid:  # _cstr's test, inline
            raise _nul("request_id", request_id, InvalidRequest)
        if type(ten) is bytes and b"\0" in ten:
            raise _nul("tenant", tenant, InvalidRequest)
        ad = _cstr(adapter, "adapter", InvalidRequest) if adapter else None
        mn = _I64_ZERO if max_new_tokens is _ZERO else max_new_tokens
        wt = _I64_ZERO if wait_ms is _ZERO else wait_ms
        h = ctypes.c_uint64()
        if block_table is None:
            st = _lib.admit_tokens(state.harg, rid, ten, addr, n, mn, ad, wt, h)
            pages = 0
        else:
            if (type(block_table) is _Tensor and block_table.dtype is _INT32 and block_table.layout is _STRIDED
                    and block_table.is_cpu and block_table.is_contiguous()):
                table, cap = block_table.data_ptr(), block_table.numel()
            else:
                table, cap = _int32_out(block_table)
            if _lib.admit_tokens_table is not None:
                m = ctypes.c_size_t()
                st = _lib.admit_tokens_table(state.harg, rid, ten, addr, n, mn, ad, wt, table, cap, m, h)
                pages = m.value
            else:
                st, pages = self._admit_then_table(rid, ten, addr, n, max_new_tokens, ad, wait_ms, table, cap, h)
        if st:
            raise from_last_error(st)
        del keep
        lease = _new_lease(Lease)  # Lease.__init__'s work, without the call
        lease.pool = self
        lease._h = h = h.value
        lease._released = False
        lease._cap = -(-(n + max_new_tokens) // self.tokens_per_page)
        lease.table_len = pages
        self._live.add(h)
        return lease

    def _admit_keyed(self, request_id, tenant, token_ids, max_new_tokens, adapter, wait_ms, block_table, page_extra):
        """admit_tokens with extra key material: kvf_admit_tokens_keyed."""
        if _lib.admit_tokens_keyed is None:
            raise InvalidArgument("kvfence: page_extra needs a library of ABI 8 (this one is %d)" % _lib.abi_version(),
                                  InvalidArgument.status)
        state = self._state
        if state.closed:
            raise PoolClosed("the pool is closed", _ERR_POOL_CLOSED)
        addr, n, keep = _int32s(token_ids)
        rid = _cstr(request_id, "request_id", InvalidRequest)
        ten = _cstr(tenant, "tenant", InvalidRequest)
        ad = _cstr(adapter, "adapter", InvalidRequest) if adapter else None
        parts, total = [], 0
        ends = array.array("Q")
        for e in page_extra:
            if e:
                if not isinstance(e, (bytes, bytearray, memoryview)):
                    raise TypeError("kvfence: page_extra entries are bytes or None, not %s" % type(e).__name__)
                parts.append(bytes(e))
                total += len(parts[-1])
            ends.append(total)
        material = b"".join(parts)
        if block_table is None:
            cap = max(0, -(-(n + max_new_tokens) // self.tokens_per_page)) if n else 0
            out = array.array("i", bytes(4 * max(cap, 1)))
            table, cap = out.buffer_info()[0], cap
        else:
            table, cap = _int32_out(block_table)
        h, m = ctypes.c_uint64(), ctypes.c_size_t()
        st = _lib.admit_tokens_keyed(state.harg, rid, ten, addr, n, max_new_tokens, ad, material or None,
                                     ends.buffer_info()[0] if ends else None, len(ends), wait_ms, table, cap, m, h)
        if st:
            raise from_last_error(st)
        del keep
        lease = Lease(self, h.value, -(-(n + max_new_tokens) // self.tokens_per_page))
        lease.table_len = m.value if block_table is not None else 0
        return lease

    def clear_prefix_cache(self):
        """Drops the prefix cache of every sharing domain, as after a weight
        update (kvf_pool_clear_prefix_cache, ABI 8): no later admission
        matches a page published before the call; cached pages are
        scrubbed, and pages live leases share when their last lease ends."""
        if _lib.pool_clear_prefix_cache is None:
            raise InvalidArgument("kvfence: clear_prefix_cache needs a library of ABI 8 (this one is %d)"
                                  % _lib.abi_version(), InvalidArgument.status)
        check(_lib.pool_clear_prefix_cache(self._handle()))

    def _admit_then_table(self, rid, ten, addr, n, max_new_tokens, ad, wait_ms, table, cap, h):
        """admit_tokens(block_table=) on a library older than ABI 6: the
        checks of kvf_admit_tokens_table, then kvf_admit_tokens and
        kvf_lease_block_table. Returns (status, table length)."""
        if (type(max_new_tokens) is int and type(wait_ms) is int and wait_ms >= 0 and n > 0
                and 0 <= max_new_tokens <= self._max_context - n):
            need = -(-(n + max_new_tokens) // self.tokens_per_page)
            if need > cap:
                raise BufferTooSmall("kvfence: buffer too small: block table needs %d, buffer holds %d" % (need, cap),
                                     _ERR_BUFFER_TOO_SMALL, need, cap, cap)
        st = _lib.admit_tokens(self._state.harg, rid, ten, addr, n, max_new_tokens, ad, wait_ms, h)
        if st:
            return st, 0
        m = ctypes.c_size_t()
        st = _lib.lease_block_table(h.value, table, cap, m)
        if st:  # cannot happen (the table has room): undo the admission
            err = from_last_error(st)
            _lib.lease_free(h.value)
            raise err
        return 0, m.value

    def receiver(self, key, config=None):
        """A Receiver importing handoffs into this pool, verifying with key."""
        return Receiver(self, key, config)

    # ---- memory

    def regions(self):
        """The pool's regions as dicts: base (a host or device address),
        stride, page_bytes, pages. Geometry pools: layer l's K is region
        2l, V 2l+1; cache specs: the spec's regions, group by group."""
        return _regions(_lib.pool_regions, self._handle())

    def _region_meta(self):
        """(name, dtype, default page shape) per region, from the config."""
        cfg = self.config
        if "geometry" in cfg:
            g = cfg["geometry"]
            shape = (g["tokens_per_page"], g["kv_heads"], g["head_dim"])
            dt = _views.dtype_name(g.get("dtype", "bf16"))
            return [("layer.%d.%s" % (i // 2, "kv"[i % 2]), dt, shape) for i in range(2 * g["layers"])]
        if "cache" in cfg:
            meta = []
            shapes = self.adopted.page_shapes() if self.adopted is not None else {}
            for grp in cfg["cache"]["groups"]:
                for r in grp["regions"]:
                    dt = r.get("dtype")
                    meta.append((r.get("name"), _views.dtype_name(dt) if dt else None, shapes.get(r.get("name"))))
            return meta
        return None  # a preset: the engine names the shape

    def region(self, index):
        """A RegionView of region index (raises PoolClosed once closed)."""
        regs = self.regions()
        if not 0 <= index < len(regs):
            raise IndexError("kvfence: region %d of %d" % (index, len(regs)))
        meta = self._region_meta()
        name, dt, shape = meta[index] if meta and index < len(meta) else (None, None, None)
        return _views.RegionView(self, self._mem, index, regs[index], name, dt, shape)

    def region_views(self):
        return [self.region(i) for i in range(len(self.regions()))]

    def kv_views(self, layer):
        """(K, V) torch tensors of a "geometry" pool's layer, each
        [num_blocks, block_size, kv_heads, head_dim] (vLLM's flash layout
        after kv_cache.unbind(0); SGLang's k_buffer is
        .flatten(0, 1): [tokens, heads, dim], slot = the slot mapping)."""
        g = self.config.get("geometry")
        if g is None:
            raise TypeError("kvfence: kv_views needs a \"geometry\" pool; use region(i).tensor(page_shape=...)")
        if not 0 <= layer < g["layers"]:
            raise IndexError("kvfence: layer %d of %d" % (layer, g["layers"]))
        return self.region(2 * layer).tensor(), self.region(2 * layer + 1).tensor()

    def vllm_kv_cache(self, layer):
        """vLLM's [2, num_blocks, block_size, kv_heads, head_size] tensor of a
        layer, over the pool's memory: for a pool that adopted a
        kvfence.layouts.vllm cache, whose K and V lie in one tensor (a
        "geometry" pool's K and V are separate allocations: use kv_views)."""
        cache = self.adopted
        if cache is None or cache.kind != "vllm":
            raise TypeError("kvfence: vllm_kv_cache needs a pool that adopted layouts.vllm(); a pool's own K and V "
                            "regions are separate allocations (kv_views gives them)")
        k, v = self.region(2 * layer), self.region(2 * layer + 1)
        k._check()
        es = _views.element_size(cache.dtype)
        bs, heads, dim = k.default_page_shape
        gap = v.base - k.base
        if gap <= 0 or gap % es or gap < (k.pages - 1) * k.stride + k.page_bytes:
            raise ValueError("kvfence: layer %d's V (%#x) does not follow its K (%#x)" % (layer, v.base, k.base))
        return _views.tensor_over(self._mem, self.device, k.base, cache.dtype, (2, k.pages, bs, heads, dim),
                                  (gap // es, k.stride // es, heads * dim, dim, 1))

    # ---- tables for a batch

    def _own(self, lease):
        """Refuses a lease of another pool: its page IDs index that pool's
        memory, and here they would name pages of this pool's other
        leases."""
        if lease.pool is not self:
            raise InvalidArgument("kvfence: lease %#x is of another pool, not this one" % lease._h, InvalidArgument.status)

    def block_tables(self, leases, width=None, pad=0, dtype=None):
        """The block tables of a batch of leases as one [batch, width]
        tensor (int32 by default, or torch.int64), rows padded with pad:
        the block_tables argument of a paged-attention kernel."""
        torch = _views._torch()
        for lease in leases:
            self._own(lease)
        sizes = [lease._table_len() for lease in leases]
        w = max(sizes, default=0) if width is None else width
        if sizes and max(sizes) > w:
            raise ValueError("kvfence: a block table of %d pages does not fit width %d" % (max(sizes), w))
        out = torch.full((len(leases), w), pad, dtype=torch.int32)
        base, n = out.data_ptr(), ctypes.c_size_t()
        for i, lease in enumerate(leases):
            check(_lib.lease_block_table(lease._h, base + 4 * w * i, w, ctypes.byref(n)))
        return out if dtype in (None, torch.int32) else out.to(dtype)

    def slot_mappings(self, spans, offset=0):
        """The slot mapping of a batch, int64: for each (lease, start, end)
        the slots of tokens [start, end), concatenated (vLLM's
        slot_mapping); offset is added to every slot (SGLang's padding
        page: kvfence.layouts.sglang_mha)."""
        torch = _views._torch()
        spans = list(spans)  # read three times: a generator only once
        # Every span before the first write: out holds the sum of their
        # lengths, and a reversed one would make it shorter than the
        # spans before it.
        for lease, s, e in spans:
            self._own(lease)
            if e < s:
                raise ValueError("kvfence: token range [%d, %d)" % (s, e))
        total = sum(e - s for _, s, e in spans)
        out = torch.empty(total, dtype=torch.int64)
        at, n = out.data_ptr(), ctypes.c_size_t()
        for lease, s, e in spans:
            check(_lib.lease_slot_mapping(lease._h, s, e, at, e - s, ctypes.byref(n)))
            at += 8 * (e - s)
        if offset:
            out += offset
        return out


class Lease:
    """An admitted request's pages. Use as a context manager (it frees the
    lease at the end, releasing it after default_stream() if still live),
    or call release() and free(). A lease dropped without free() is freed
    when collected, released after all work of the device (on CUDA that
    blocks until the GPU is idle).

    table_len is the length of the block table that
    Pool.admit_tokens(..., block_table=) wrote at admission (0 when none
    was asked for); grow() appends pages after them (write_block_table()
    gives the table of now)."""

    __slots__ = ("_h", "pool", "_released", "_cap", "table_len", "__weakref__")

    def __init__(self, pool, handle, max_pages=0):
        # Pool.admit_tokens sets these slots itself (without a call of
        # __init__), in this order: pool before _h, which __del__ reads.
        self.pool = pool
        self._h = handle
        self._released = False  # by this object's release(): free() need not try again
        # The most pages the block table can hold: prompt + max new tokens
        # (growth never passes them), so that a table is read with one call.
        self._cap = max_pages
        self.table_len = 0
        pool._live.add(handle)

    def __del__(self):
        h = getattr(self, "_h", 0)
        if h and _lib is not None and _lib.lease_free is not None:
            self.pool._live.discard(h)
            _lib.lease_free(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def _table_len(self):
        li = _lib.LeaseInfo()  # a successful call: cheaper than a size query's error
        check(_lib.lease_describe(self._h, ctypes.byref(li)))
        return li.pages

    def block_table(self):
        """The page IDs in token order, as a list."""
        n = self._cap or self._table_len()
        buf = (ctypes.c_int32 * max(1, n))()
        m = ctypes.c_size_t()
        st = _lib.lease_block_table(self._h, ctypes.addressof(buf), n, ctypes.byref(m))
        if st == _ERR_BUFFER_TOO_SMALL and self._cap:
            self._cap = 0
            return self.block_table()
        check(st)
        return list(buf[: m.value])

    def block_table_tensor(self, dtype=None):
        """The block table as a new 1-D torch tensor (int32; or torch.int64)."""
        torch = _views._torch()
        n = self._cap or self._table_len()
        out = torch.empty(n, dtype=torch.int32)
        m = ctypes.c_size_t()
        st = _lib.lease_block_table(self._h, out.data_ptr(), n, ctypes.byref(m))
        if st == _ERR_BUFFER_TOO_SMALL and self._cap:
            self._cap = 0
            return self.block_table_tensor(dtype)
        check(st)
        if m.value != n:
            out = out[: m.value]
        return out if dtype in (None, torch.int32) else out.to(dtype)

    def write_block_table(self, out):
        """Writes the block table into out, a contiguous int32 CPU tensor
        (the request's row of the engine's persistent block-table buffer),
        a numpy int32 array or an array('i'), and returns its length: no
        allocation. A table longer than out raises BufferTooSmall with
        out unchanged."""
        if (type(out) is _Tensor and out.dtype is _INT32 and out.layout is _STRIDED and out.is_cpu
                and out.is_contiguous()):
            addr, cap = out.data_ptr(), out.numel()  # _int32_out's test, inline
        else:
            addr, cap = _int32_out(out)
        m = ctypes.c_size_t()
        st = _lib.lease_block_table(self._h, addr, cap, m)
        if st:
            raise from_last_error(st)
        return m.value

    def slot_mapping(self, start, end):
        """Slots (page * tokens_per_page + offset) of tokens [start, end), a list."""
        if end < start:
            raise ValueError("kvfence: token range [%d, %d)" % (start, end))
        buf = (ctypes.c_int64 * max(1, end - start))()
        n = ctypes.c_size_t()
        check(_lib.lease_slot_mapping(self._h, start, end, ctypes.addressof(buf), end - start, ctypes.byref(n)))
        return list(buf[: n.value])

    def slot_mapping_tensor(self, start, end, offset=0):
        """Slots of tokens [start, end) as an int64 torch tensor (+ offset)."""
        return self.pool.slot_mappings([(self, start, end)], offset)

    def commit(self, tokens):
        """Records that the first `tokens` tokens have been written."""
        check(_lib.lease_commit(self._h, tokens))

    def grow(self, tokens, wait_ms=0):
        """Makes room for `tokens` more tokens after the written watermark
        (leases sized on demand). A refusal (PoolExhausted, ExceedsQuota,
        ExceedsMaxContext, ...) tells the engine to finish or preempt."""
        check(_lib.lease_grow(self._h, tokens, wait_ms))

    def preempt(self, token_ids=None):
        """Gives the pages back, keeping the full pages of the written
        tokens (token_ids: all of them, prompt then output) in the prefix
        cache; returns the tokens kept. With a host tier (the config's
        "host_tier", ABI 12) the rest of the written pages are swapped to
        it, all or none, and the tokens kept are then all of them: the
        request's next admit_tokens (same ID, tenant and adapter, those
        tokens as the prompt) copies them back, hit_tokens() all but the
        last; a pool with window or state groups never swaps (its pages
        are of no use without the state at their end). Admit again with admit_tokens to resume. Token IDs whose
        prompt part is not the prompt the lease was admitted with raise
        InvalidArgument, and the lease stays live."""
        if token_ids is None or len(token_ids) == 0:
            addr, n, keep = None, 0, None
        else:
            addr, n, keep = _int32s(token_ids)
        kept = ctypes.c_int64()
        check(_lib.lease_preempt(self._h, addr, n, ctypes.byref(kept)))
        del keep
        return kept.value

    def info(self):
        li = _lib.LeaseInfo()
        check(_lib.lease_describe(self._h, ctypes.byref(li)))
        return {f: getattr(li, f) for f, _ in _lib.LeaseInfo._fields_ if f != "reserved0"}

    @property
    def live(self):
        return bool(self._h) and bool(self.info()["live"])

    def hit_tokens(self):
        """Leading prompt tokens shared from the prefix cache: prefill starts there."""
        n = ctypes.c_int64()
        check(_lib.lease_hit_tokens(self._h, ctypes.byref(n)))
        return n.value

    def cache_prefix(self, tokens):
        """Publishes the full prompt pages holding the first `tokens`
        tokens (committed) to the domain's prefix cache; returns the tokens
        shared. Published pages are immutable."""
        n = ctypes.c_int64()
        check(_lib.lease_cache_prefix(self._h, tokens, ctypes.byref(n)))
        return n.value

    def checkpoint_state(self, tokens, stream=None, event=0):
        """Takes a state checkpoint of the lease at `tokens` tokens (ABI
        10; a pool with sliding-window or state groups): the engine's state
        and windows reflect exactly the first `tokens` tokens, a multiple of
        the page size within the committed tokens and the prompt. kvfence
        copies the state slot and the window's pages there into slots the
        prefix cache owns, after the engine's work on stream (default
        default_stream()) and event, as release orders its scrub, and
        publishes the full pages below `tokens` (immutable from then on); a
        later admit_tokens in the domain whose prompt starts with them, and
        has at least one more token, shares the pages and gets that state,
        its hit_tokens() and committed tokens there. The copy has completed
        when the call returns. A checkpoint there already is kept. Refusals
        change nothing: InvalidArgument (not a page boundary, past the
        committed tokens or the prompt, a window slid past, no token IDs),
        NoStateGroup (a pool without window or state groups),
        CheckpointCapacity (no room: the pool's or the tenant's
        max_checkpoints, the tenant's quota, no slot free or evictable;
        counted in stats()["checkpoints"]["capacity_skips"]; slots still
        being scrubbed after a release are waited for, not refused),
        LeaseReleased, LeasePhase, BadOrdering."""
        if _lib.lease_checkpoint_state is None:
            raise InvalidArgument("kvfence: state checkpoints need a library of ABI 10 (this one is %d)"
                                  % _lib.abi_version(), InvalidArgument.status)
        if stream is None:
            stream = default_stream()
        check(_lib.lease_checkpoint_state(self._h, tokens, stream, event))

    def prefill_checkpoint(self):
        """Where to checkpoint the lease's prefill (checkpoint_state) so
        that a later request with the same prompt reuses all it can: the
        last page boundary before the prompt's last token (ABI 10). 0 for a
        prompt within one page, in a pool without window or state groups,
        and with a library older than ABI 10."""
        if _lib.lease_prefill_checkpoint is None:
            return 0
        n = ctypes.c_int64()
        check(_lib.lease_prefill_checkpoint(self._h, ctypes.byref(n)))
        return n.value

    def group_table(self, group):
        """(first logical page, [pages]) the lease holds in cache group
        `group` of a cache-spec pool."""
        name = _cstr(group, "group", InvalidArgument)
        n, first = ctypes.c_size_t(), ctypes.c_int64()
        st = _lib.lease_group_table(self._h, name, None, 0, ctypes.byref(n), ctypes.byref(first))
        if st != _ERR_BUFFER_TOO_SMALL:
            check(st)
        buf = (ctypes.c_int32 * max(1, n.value))()
        check(_lib.lease_group_table(self._h, name, ctypes.addressof(buf), n.value, ctypes.byref(n), ctypes.byref(first)))
        return first.value, list(buf[: n.value])

    def slide_windows(self, stream=None, event=0):
        """Moves the sliding windows to the written watermark; returns the
        pages scrubbed (after stream/event, as release orders it)."""
        if stream is None:
            stream = default_stream()
        n = ctypes.c_int64()
        check(_lib.lease_slide_windows(self._h, stream, event, ctypes.byref(n)))
        return n.value

    def phase(self):
        ph = ctypes.c_int32()
        check(_lib.lease_phase(self._h, ctypes.byref(ph)))
        return PHASES[ph.value] if 0 <= ph.value < len(PHASES) else ph.value

    def begin_prefill(self):
        check(_lib.lease_begin_prefill(self._h))

    def finish_prefill(self):
        check(_lib.lease_finish_prefill(self._h))

    def abort(self):
        check(_lib.lease_abort(self._h))

    def export(self, key, max_new_tokens, ttl_ms=0):
        """Pins this prefilled lease's prompt pages for a handoff."""
        key = _b(key)
        h = ctypes.c_uint64()
        check(_lib.export_create(self._h, key, len(key), max_new_tokens, ttl_ms, ctypes.byref(h)))
        return Export(h.value)

    def release(self, stream=None, event=0):
        """Ends the lease; its pages are scrubbed after the engine's work on
        them: the CUDA stream (an integer handle; default default_stream(),
        torch.cuda.current_stream()) and event. stream=0 with event=0 orders
        it after all work of the pool's CUDA context (it blocks until the
        GPU is idle). A stream kvfence cannot use raises BadOrdering and
        leaves the lease live. Host pools ignore the ordering."""
        if stream is None:
            stream = default_stream()
        check(_lib.lease_release(self._h, stream, event))
        self._released = True

    def free(self):
        """Releases the lease if still live (after default_stream()) and
        frees the handle. (On a host pool, which ignores orderings, that is
        kvf_lease_free alone: one call.)"""
        h = self._h
        if h:
            if not self._released and self.pool.device != "cpu":
                st = _lib.lease_release(h, default_stream(), 0)
                if st not in (0, _ERR_LEASE_RELEASED, _ERR_POOL_CLOSED):
                    check(st)
            self._h = 0
            self.pool._live.discard(h)
            st = _lib.lease_free(h)
            if st:
                raise from_last_error(st)


_new_lease = object.__new__  # _new_lease(Lease): a Lease without __init__ (Pool.admit_tokens)


class _Units:
    """What an export and an import share (ABI 9): the transfer's units,
    the pages (slots) of every cache group that hold the prompt's state,
    group by group, numbered from 0 across groups (extents()). A pool of
    one per-token group moves its pages, units 0 .. pages - 1, which the
    page calls move too; one with sliding-window or state groups needs the
    unit calls for the rest."""

    _ext = None
    _extents_call = None

    def _units_call(self, call):
        if call is None:
            raise InvalidArgument("kvfence: handoff units need a library of ABI 9 (this one is %d)"
                                  % _lib.abi_version(), InvalidArgument.status)
        return call

    def _extents(self):
        """(extents, units, bytes), asked once: a transfer's extents never
        change."""
        if self._ext is None:
            call = self._units_call(self._extents_call)
            n, units, nbytes = ctypes.c_size_t(), ctypes.c_int64(), ctypes.c_int64()
            st = call(self._h, None, 0, n, units, nbytes)
            if st != _ERR_BUFFER_TOO_SMALL:
                check(st)
            buf = (_lib.HandoffExtent * max(1, n.value))()
            check(call(self._h, buf, n.value, n, units, nbytes))
            ext = tuple({"group": e.group.decode(), "kind": _lib.GROUP_KINDS.get(e.kind, e.kind),
                         "first_unit": e.first_unit, "units": e.units, "unit_bytes": e.unit_bytes,
                         "first_page": e.first_page} for e in buf[: n.value])
            self._ext = (ext, units.value, nbytes.value)
        return self._ext

    def extents(self):
        """One dict per cache group, in the cache spec's order: group (its
        name), kind ("per_token", "sliding_window", "state"), first_unit
        (the transfer's number of its first unit), units, unit_bytes (its
        page or slot in every region of the group, in region order) and
        first_page (the logical page the first unit holds: a window's
        oldest page still inside it at the prompt's end, else 0)."""
        return [dict(e) for e in self._extents()[0]]

    def units(self):
        """The number of units of every group: what the transfer moves."""
        return self._extents()[1]

    def nbytes(self):
        """The bytes of every unit: what the transfer moves."""
        return self._extents()[2]

    def _run_bytes(self, first, count):
        """The bytes of units [first, first + count), or 0 for a run the
        transfer does not have (which the library then refuses, naming the
        numbers)."""
        ext, units, _ = self._extents()
        if first < 0 or count < 1 or first + count > units:
            return 0
        n = 0
        for e in ext:
            lo, hi = max(first, e["first_unit"]), min(first + count, e["first_unit"] + e["units"])
            if hi > lo:
                n += (hi - lo) * e["unit_bytes"]
        return n

    def unit_bytes(self, unit):
        """The size of one unit; 0 for a unit the transfer does not have."""
        for e in self._extents()[0]:
            if e["first_unit"] <= unit < e["first_unit"] + e["units"]:
                return e["unit_bytes"]
        return 0

    def _info(self, call):
        ti = _lib.TransferInfo()
        check(call(self._h, ctypes.byref(ti)))
        info = {f: getattr(ti, f) for f, _ in _lib.TransferInfo._fields_}
        if self._extents_call is not None:
            _, info["units"], info["bytes"] = self._extents()
        return info


class Export(_Units):
    """The prefill side of a handoff: manifest() and read_pages() (a pool
    of one per-token group) or read_units() and read_unit_range() (every
    group) give the bytes to carry; ack() once the decode side completed
    the import."""

    _extents_call = _lib.export_extents

    def __init__(self, handle):
        self._h = handle

    def __del__(self):
        h = getattr(self, "_h", 0)
        if h and _lib is not None and _lib.export_free is not None:
            _lib.export_free(h)

    def manifest(self):
        return _sized_text(lambda b, n, need: _lib.export_manifest(self._h, b, n, need))

    def info(self):
        """pages and page_bytes (the per-token group's), prompt_tokens,
        max_new_tokens, checksum, live; with ABI 9 also units and bytes,
        every group's."""
        return self._info(_lib.export_describe)

    def read_pages(self, first, count, out=None):
        """Copies pages [first, first + count) into out (a writable buffer
        or CPU tensor of count * page_bytes bytes), or into new bytes."""
        pb = self.info()["page_bytes"]
        if out is None:
            buf = ctypes.create_string_buffer(count * pb)
            check(_lib.export_read_pages(self._h, first, ctypes.addressof(buf), len(buf)))
            return buf.raw
        addr, n, keep = _buffer(out, writable=True)
        check(_lib.export_read_pages(self._h, first, addr, n))
        return out

    def read_units(self, first=0, count=None, out=None):
        """Copies units first, first + 1, ... (whole, each its regions in
        order; a run may cross groups) into out, a writable buffer or CPU
        tensor, and returns it: as many units as out holds (it must end at
        a unit's end), or exactly count of them. Without out, into a new
        bytearray of count units (None: up to the transfer's last unit).
        A run the export does not have raises InvalidArgument and leaves
        the export as it was."""
        call = self._units_call(_lib.export_read_units)
        if out is None:
            if count is None:
                count = self.units() - first
            buf = bytearray(self._run_bytes(first, count))
            addr, n, keep = _buffer(buf, writable=True)
            check(call(self._h, first, addr, n))
            return buf
        addr, n, keep = _buffer(out, writable=True)
        if count is not None and n != self._run_bytes(first, count):
            raise InvalidArgument("kvfence: a buffer of %d bytes for %d units from unit %d (%d bytes)"
                                  % (n, count, first, self._run_bytes(first, count)), InvalidArgument.status)
        check(call(self._h, first, addr, n))
        return out

    def read_unit_range(self, unit, offset=0, length=None, out=None):
        """Copies bytes [offset, offset + length) of one unit into out (a
        writable buffer or CPU tensor of length bytes; length None: out's
        size) or a new bytearray (length None: to the unit's end), and
        returns it: a unit larger than a message, read in ranges of any
        size and order."""
        call = self._units_call(_lib.export_read_unit_range)
        if out is None:
            if length is None:
                length = max(0, self.unit_bytes(unit) - offset)
            out = bytearray(length)
        addr, n, keep = _buffer(out, writable=True)
        if length is not None and n != length:
            raise InvalidArgument("kvfence: a buffer of %d bytes for a range of %d" % (n, length), InvalidArgument.status)
        check(call(self._h, unit, offset, addr, n))
        return out

    def send_ucx(self, transport, timeout_ms=0):
        """Sends the export over UCX (a UCXTransport to a receiver's
        UCXServer) and waits for the receiver's verdict, at most
        timeout_ms (0: the transport's own timeouts). On return the decode
        pool holds the verified lease and the export has ended; on an
        error (the receiver's reason, Transport, Protocol) the pages stay
        pinned for a retry until abort(), free() or the reclaim deadline.
        ABI 11."""
        if _lib.export_send_ucx is None:
            raise _lib_too_old("UCX handoffs", 11)
        check(_lib.export_send_ucx(self._h, transport._handle(), timeout_ms))

    def ack(self):
        check(_lib.export_ack(self._h))

    def abort(self):
        check(_lib.export_abort(self._h))

    def free(self):
        if self._h:
            h, self._h = self._h, 0
            check(_lib.export_free(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


class Receiver:
    """The decode side of a handoff for one pool."""

    def __init__(self, pool, key, config=None):
        key = _b(key)
        cfg = _b(json.dumps(config)) if config else None
        h = ctypes.c_uint64()
        check(_lib.receiver_create(pool._handle(), key, len(key), cfg, ctypes.byref(h)))
        self._h = h.value
        self.pool = pool

    def __del__(self):
        h = getattr(self, "_h", 0)
        if h and _lib is not None and _lib.receiver_destroy is not None:
            _lib.receiver_destroy(h)

    def begin(self, manifest):
        """Verifies the manifest and admits its import fail-closed."""
        self.pool._handle()  # PoolClosed once the pool is closed
        h = ctypes.c_uint64()
        check(_lib.import_begin(self._h, manifest, len(manifest), ctypes.byref(h)))
        return Import(self.pool, h.value)

    def serve_ucx(self, addr="127.0.0.1:0", options=None):
        """Serves this receiver's imports over UCX on addr ("host:port";
        port 0 picks one): a UCXServer, whose address a UCXTransport on
        the prefill side dials. The imported leases are taken with take().
        options (a dict): connect_timeout_ms, message_timeout_ms,
        revoke_timeout_ms, max_message_bytes, max_conns, data_path ("auto"
        or "messages"). UCX's environment (UCX_TLS, UCX_NET_DEVICES)
        picks the fabric. Raises Unavailable when the library was built
        without UCX. ABI 11."""
        if _lib.ucx_server_create is None:
            raise _lib_too_old("UCX handoffs", 11)
        h = ctypes.c_uint64()
        opts = _b(json.dumps(options)) if options else None
        check(_lib.ucx_server_create(self._h, _cstr(addr, "addr", InvalidArgument), opts, ctypes.byref(h)))
        return UCXServer(h.value)

    def take(self, request_id):
        """The Lease this receiver imported for request_id over a
        transport (serve_ucx), once; None if no such import has completed
        (yet). ABI 11."""
        if _lib.receiver_take is None:
            raise _lib_too_old("UCX handoffs", 11)
        h = ctypes.c_uint64()
        check(_lib.receiver_take(self._h, _cstr(request_id, "request_id", InvalidRequest), ctypes.byref(h)))
        return Lease(self.pool, h.value) if h.value else None

    def close(self):
        if self._h:
            h, self._h = self._h, 0
            check(_lib.receiver_destroy(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _lib_too_old(what, abi):
    return NotImplementedError("kvfence: %s need a library of ABI %d, %s implements %d"
                               % (what, abi, _lib.library_path(), _lib.abi_version()))


def ucx_available():
    """Whether the library moves handoffs over UCX (built with cgo,
    libucx-dev and the Go build tag ucx)."""
    return _lib.ucx_available is not None and bool(_lib.ucx_available())


class UCXServer:
    """A receiver's imports served over UCX (Receiver.serve_ucx)."""

    def __init__(self, handle):
        self._h = handle

    def __del__(self):
        h = getattr(self, "_h", 0)
        if h and _lib is not None and _lib.ucx_server_destroy is not None:
            _lib.ucx_server_destroy(h)

    @property
    def address(self):
        """The address the server listens on, "host:port"."""
        return _sized_text(lambda b, n, need: _lib.ucx_server_addr(self._h, b, n, need)).rstrip(b"\0").decode()

    def close(self):
        """Stops the server: transfers in flight fail, their imports
        aborted and scrubbed before it returns."""
        if self._h:
            h, self._h = self._h, 0
            check(_lib.ucx_server_destroy(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class UCXTransport:
    """A transport to a UCXServer at addr, for Export.send_ucx. options as
    Receiver.serve_ucx's. Raises Unavailable when the library was built
    without UCX. ABI 11."""

    def __init__(self, addr, options=None):
        if _lib.ucx_transport_create is None:
            raise _lib_too_old("UCX handoffs", 11)
        h = ctypes.c_uint64()
        opts = _b(json.dumps(options)) if options else None
        check(_lib.ucx_transport_create(_cstr(addr, "addr", InvalidArgument), opts, ctypes.byref(h)))
        self._h = h.value

    def _handle(self):
        if not self._h:
            raise InvalidArgument("kvfence: the UCX transport is closed", InvalidArgument.status)
        return self._h

    def __del__(self):
        h = getattr(self, "_h", 0)
        if h and _lib is not None and _lib.ucx_transport_destroy is not None:
            _lib.ucx_transport_destroy(h)

    def close(self):
        if self._h:
            h, self._h = self._h, 0
            check(_lib.ucx_transport_destroy(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Import(_Units):
    """An import in progress; complete() returns the decode Lease once
    every unit of every group has landed (write_pages, write_units,
    write_unit_range)."""

    _extents_call = _lib.import_extents

    def __init__(self, pool, handle):
        self._h = handle
        self.pool = pool

    def __del__(self):
        h = getattr(self, "_h", 0)
        if h and _lib is not None and _lib.import_free is not None:
            _lib.import_free(h)

    def info(self):
        """As Export.info: live until completed or aborted."""
        return self._info(_lib.import_describe)

    def write_pages(self, first, data):
        """Writes whole pages of the per-token group from page first
        (bytes, a buffer or a CPU tensor). A range outside the import
        raises InvalidArgument and leaves the import live; any other error
        aborts it."""
        addr, n, keep = _buffer(data, writable=False)
        check(_lib.import_write_pages(self._h, first, addr, n))

    def write_units(self, first, data):
        """Writes units first, first + 1, ... from data (bytes, a buffer
        or a CPU tensor, read in place): whole units as read_units reads
        them, ending at a unit's end. A run outside the import raises
        InvalidArgument and leaves the import live; any other error (a
        unit twice: DuplicatePage) aborts it."""
        call = self._units_call(_lib.import_write_units)
        addr, n, keep = _buffer(data, writable=False)
        check(call(self._h, first, addr, n))

    def write_unit_range(self, unit, offset, data):
        """Writes bytes [offset, offset + len(data)) of one unit, received
        in ranges: a unit's ranges one at a time and in order, from offset
        0, each but the unit's last a multiple of 4096 bytes long, one
        unit's at a time. A range outside the unit or not so aligned raises
        InvalidArgument and leaves the import live; one out of order
        raises InvalidArgument too but aborts the import (its bytes were
        lost or reordered on the way), as every other error does."""
        call = self._units_call(_lib.import_write_unit_range)
        addr, n, keep = _buffer(data, writable=False)
        check(call(self._h, unit, offset, addr, n))

    def complete(self):
        h = ctypes.c_uint64()
        check(_lib.import_complete(self._h, ctypes.byref(h)))
        return Lease(self.pool, h.value)

    def abort(self):
        check(_lib.import_abort(self._h))

    def free(self):
        if self._h:
            h, self._h = self._h, 0
            check(_lib.import_free(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


class RankWorker:
    """One rank of a tensor-parallel group with one process per rank (vLLM's
    and SGLang's worker processes): the scheduler's process owns the Pool
    (config "device": {"kind": "remote", "listen": ..., "ranks": N}); each
    rank's process serves its shard of every region with a RankWorker,
    which scrubs the pages the scheduler frees on this rank, after the
    engine's own kernels, when step() is called.

    connect is the pool's "listen" address; regions is the rank's shard,
    one dict per region (layer l's K is 2l, V 2l+1) with "pages",
    "page_bytes" and either "base" (the engine's memory, e.g. a CUDA
    tensor's data_ptr(), with its "stride"; 0 or absent: the worker
    allocates the region) or, on a host device, "memory": a writable
    buffer the worker adopts and keeps referenced until close(). device
    is a pool's "device" dict (default host). step_lag (ABI 8) makes each
    batch wait that many more steps (kvf_rank_step). A worker dropped
    without close() is closed when it is collected, before those
    references go."""

    def __init__(self, connect, rank, regions, device=None, auto_step=False, connect_timeout_ms=0, step_lag=0):
        cfg = {"connect": connect, "rank": rank}
        if device is not None:
            cfg["device"] = device
        if auto_step:
            cfg["auto_step"] = True
        if step_lag:
            cfg["step_lag"] = step_lag
        if connect_timeout_ms:
            cfg["connect_timeout_ms"] = connect_timeout_ms
        self._keep = []
        arr = (_lib.Region * max(1, len(regions)))()
        for i, r in enumerate(regions):
            base = r.get("base", 0)
            stride = r.get("stride", r["page_bytes"] if base or r.get("memory") is not None else 0)
            if r.get("memory") is not None:
                size = memoryview(r["memory"]).nbytes
                if size < (r["pages"] - 1) * stride + r["page_bytes"]:
                    raise ValueError("region %d: memory of %d bytes for %d pages %d bytes apart"
                                     % (i, size, r["pages"], stride))
                view = (ctypes.c_char * size).from_buffer(r["memory"])
                self._keep.append(view)
                base = ctypes.addressof(view)
            arr[i] = _lib.Region(base, stride, r["page_bytes"], r["pages"])
        h = ctypes.c_uint64()
        check(_lib.rank_worker_create(_b(json.dumps(cfg)), arr, len(regions), ctypes.byref(h)))
        self._h = h.value

    def __del__(self):
        # Closes the Go worker before _keep, the adopted buffers, goes with
        # this object: a live worker would go on scrubbing into them after
        # Python has freed them.
        h = getattr(self, "_h", 0)
        if h and _lib is not None and _lib.rank_worker_close is not None:
            self._h = 0
            _lib.rank_worker_close(h)

    def step(self, stream=None, event=0):
        """Launches the scrubs handed to this rank since the last step,
        after stream (default default_stream()) and event; returns how many
        batches it launched."""
        if stream is None:
            stream = default_stream()
        n = ctypes.c_size_t()
        check(_lib.rank_step(self._h, stream, event, ctypes.byref(n)))
        return n.value

    def wait(self, wait_ms=0):
        """True once the connection to the scheduler has ended."""
        ended = ctypes.c_int32()
        check(_lib.rank_worker_wait(self._h, wait_ms, ctypes.byref(ended)))
        return bool(ended.value)

    def regions(self):
        return _regions(_lib.rank_worker_regions, self._h)

    def close(self):
        if self._h:
            h, self._h = self._h, 0
            try:
                check(_lib.rank_worker_close(h))
            finally:
                self._keep = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
