"""Views of a pool's page memory: torch tensors (DLPack, host and CUDA),
numpy arrays and memoryviews (host), __cuda_array_interface__ (CUDA).

# Model

A pool's regions are described by kvf_pool_regions: page p of region r
starts at base + p * stride and is page_bytes long. A view is a tensor of
shape [pages, *page_shape] over one region (or, for vLLM's layout, over
K and V regions that lie in one engine allocation: see layouts.py), made
without a copy. kvfence never reads or writes a page while a lease holds
it, except to copy it for a handoff; it fills a page only after its lease
ended and the engine's work on it (the release's stream) is done. So:

- Write only the pages of your live leases (their block tables and slot
  mappings). The tensor spans the whole region; nothing stops a kernel
  from writing elsewhere, and a write to another lease's page is a
  write into another request's KV (perhaps another tenant's).
- Never write a page that was published to the prefix cache
  (Lease.cache_prefix): other requests read it.
- A view is valid while the pool's memory lives. Every view, and every
  tensor made from one, keeps that memory alive (the tensor holds a
  reference to it through its DLPack deleter or its buffer), so no view
  can ever point into freed memory: Pool.close() with views alive
  releases the live leases (their pages are scrubbed) and refuses every
  further call, but destroys the Go pool, which frees the memory it
  allocated, only once the last view is gone. Asking a closed pool for a
  view raises PoolClosed.
- On a CUDA pool the tensors are device tensors over the pool's device
  memory (kDLCUDA, the pool's ordinal). kvfence's own writes to pages (its
  fills) have completed before the pages reach a lease, so a consumer
  needs no stream synchronisation to start using a view: __dlpack__
  ignores its stream argument.
"""

import ctypes
import math
import sys

from . import _dlpack
from .errors import PoolClosed

# kvfence dtype names -> (bytes, DLPack code, bits) of the element a view
# shows by default. fp8 regions are shown as uint8 (DLPack consumers lack a
# common fp8 code); torch views are then reinterpreted as float8 where
# torch has it.
_KVF_DTYPES = {
    "fp32": (4, _dlpack.KDL_FLOAT, 32),
    "fp16": (2, _dlpack.KDL_FLOAT, 16),
    "bf16": (2, _dlpack.KDL_BFLOAT, 16),
    "fp8": (1, _dlpack.KDL_UINT, 8),
    "fp8_e4m3": (1, _dlpack.KDL_UINT, 8),
    "fp8_e5m2": (1, _dlpack.KDL_UINT, 8),
    "uint8": (1, _dlpack.KDL_UINT, 8),
    "int8": (1, _dlpack.KDL_INT, 8),
    "uint16": (2, _dlpack.KDL_UINT, 16),
    "int16": (2, _dlpack.KDL_INT, 16),
    "int32": (4, _dlpack.KDL_INT, 32),
    "uint32": (4, _dlpack.KDL_UINT, 32),
    "int64": (8, _dlpack.KDL_INT, 64),
    "fp64": (8, _dlpack.KDL_FLOAT, 64),
}
_TORCH_NAMES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
                "uint8": "uint8", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
                "float64": "fp64", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
_FP8_TORCH = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_NUMPY = {"fp32": "<f4", "fp16": "<f2", "bf16": "<u2", "fp8": "u1", "fp8_e4m3": "u1", "fp8_e5m2": "u1",
          "uint8": "u1", "int8": "i1", "uint16": "<u2", "int16": "<i2", "int32": "<i4", "uint32": "<u4",
          "int64": "<i8", "fp64": "<f8"}
_CAI = {"fp32": "<f4", "fp16": "<f2", "uint8": "|u1", "int8": "|i1", "uint16": "<u2", "int16": "<i2",
        "int32": "<i4", "uint32": "<u4", "int64": "<i8", "fp64": "<f8",
        "fp8": "|u1", "fp8_e4m3": "|u1", "fp8_e5m2": "|u1"}


def dtype_name(dtype):
    """kvfence's name of a dtype given as a kvfence name ("bf16") or a
    torch dtype (torch.bfloat16)."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = _TORCH_NAMES.get(str(dtype).replace("torch.", ""))
        if name is None:
            raise TypeError("kvfence: no view of dtype %r" % (dtype,))
    if name not in _KVF_DTYPES:
        raise ValueError("kvfence: unknown dtype %r (one of %s)" % (dtype, ", ".join(sorted(_KVF_DTYPES))))
    return name


def element_size(dtype):
    return _KVF_DTYPES[dtype_name(dtype)][0]


class Memory:
    """The owner of a pool's page memory, as views see it: every view and
    every tensor made from one holds it; the pool is destroyed only once
    it is gone (see Pool.close). `state` is the pool's."""

    def __init__(self, state):
        self.state = state


class _Exporter:
    """What torch.from_dlpack consumes: one DLPack export per call."""

    def __init__(self, mem, data, device, code, bits, shape, strides):
        self._mem, self._data, self._device = mem, data, device
        self._code, self._bits, self._shape, self._strides = code, bits, shape, strides

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, stream=None, **kwargs):
        # kvfence's fills have completed before a page reaches a lease:
        # there is no producer work for the consumer's stream to wait on.
        cap, _ = _dlpack.capsule(self._data, self._device[0], self._device[1], self._code, self._bits,
                                 self._shape, self._strides, self._mem)
        return cap


class CudaArray:
    """__cuda_array_interface__ (version 3) over a CUDA pool's region, for
    consumers that take it (CuPy, Numba, torch.as_tensor for the dtypes
    numpy knows: not bf16, use RegionView.tensor for that). Keeps the
    pool's memory alive while it lives."""

    def __init__(self, mem, data, typestr, shape, strides_bytes):
        self._mem = mem
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (data, False),
            "strides": tuple(strides_bytes), "version": 3,
        }


class RegionView:
    """One region of a pool's pages: index, name (cache specs), dtype
    (kvfence's name, when the config says), base, stride, page_bytes,
    pages, device ("cpu" or ("cuda", ordinal)), and default_page_shape
    (from the config: (tokens_per_page, kv_heads, head_dim) for a
    "geometry" pool, else (page_bytes / element size,)).

    tensor(), numpy(), memoryview() and cuda_array() make views without a
    copy; each keeps the pool's memory alive (module doc)."""

    def __init__(self, pool, mem, index, region, name=None, dtype=None, page_shape=None):
        self._pool, self._mem = pool, mem
        self.index, self.name, self.dtype = index, name, dtype
        self.base, self.stride = region["base"], region["stride"]
        self.page_bytes, self.pages = region["page_bytes"], region["pages"]
        self.device = pool.device
        self.default_page_shape = page_shape

    def __repr__(self):
        return "RegionView(%d %s: %d pages of %d bytes at %#x, stride %d, %s)" % (
            self.index, self.name or "", self.pages, self.page_bytes, self.base, self.stride, self.dtype)

    def _check(self):
        if self._pool._state.closed:
            raise PoolClosed("view of region %d of a closed pool" % self.index, 30)
        if not self.base:
            raise TypeError("kvfence: region %d has no memory in this process (base 0: a pool over remote "
                            "ranks holds none; each rank's worker holds its shard)" % self.index)

    def layout(self, dtype=None, page_shape=None):
        """(dtype name, element size, shape, strides in elements) of a view
        [pages, *page_shape] of this region; checks that page_shape fills
        exactly one page and that the stride is a whole number of
        elements."""
        name = dtype_name(dtype if dtype is not None else (self.dtype or "uint8"))
        size = _KVF_DTYPES[name][0]
        if page_shape is None:
            page_shape = self.default_page_shape if dtype is None or self.dtype is None or \
                dtype_name(dtype) == self.dtype else None
            if page_shape is None:
                if self.page_bytes % size:
                    raise ValueError("kvfence: region %d's pages of %d bytes are no whole number of %s"
                                     % (self.index, self.page_bytes, name))
                page_shape = (self.page_bytes // size,)
        page_shape = tuple(int(d) for d in page_shape)
        if any(d <= 0 for d in page_shape) or math.prod(page_shape) * size != self.page_bytes:
            raise ValueError("kvfence: page shape %s of %s is %d bytes, region %d's pages are %d"
                             % (page_shape, name, math.prod(page_shape) * size, self.index, self.page_bytes))
        if self.stride % size or self.base % size:
            raise ValueError("kvfence: region %d (base %#x, stride %d) is not aligned to %s"
                             % (self.index, self.base, self.stride, name))
        strides, acc = [], 1
        for d in reversed(page_shape):
            strides.append(acc)
            acc *= d
        strides.reverse()
        return name, size, (self.pages,) + page_shape, [self.stride // size] + strides

    def _dl_device(self):
        return (_dlpack.KDL_CPU, 0) if self.device == "cpu" else (_dlpack.KDL_CUDA, self.device[1])

    def exporter(self, dtype=None, page_shape=None):
        """An object with __dlpack__ / __dlpack_device__ for this region."""
        self._check()
        name, _, shape, strides = self.layout(dtype, page_shape)
        _, code, bits = _KVF_DTYPES[name]
        return _Exporter(self._mem, self.base, self._dl_device(), code, bits, shape, strides)

    def tensor(self, dtype=None, page_shape=None):
        """A torch tensor [pages, *page_shape] over the region (host or
        CUDA), dtype a kvfence name or a torch dtype (default: the
        region's). fp8 regions come as torch's float8 dtypes where torch
        has them, uint8 otherwise."""
        torch = _torch()
        ex = self.exporter(dtype, page_shape)
        t = torch.utils.dlpack.from_dlpack(ex)
        name = dtype_name(dtype if dtype is not None else (self.dtype or "uint8"))
        fp8 = _FP8_TORCH.get(name)
        if fp8 is not None and hasattr(torch, fp8):
            t = t.view(getattr(torch, fp8))
        return t

    def numpy(self, dtype=None, page_shape=None):
        """A numpy array [pages, *page_shape] over a host region (bf16 as
        uint16 bits, fp8 as uint8: numpy has neither)."""
        import numpy as np
        self._check()
        if self.device != "cpu":
            raise TypeError("kvfence: numpy views are of host pools; use tensor() on a CUDA pool")
        name, size, shape, strides = self.layout(dtype, page_shape)
        buf = self._host_buffer(size)
        arr = np.frombuffer(buf, dtype=np.dtype(_NUMPY[name]))
        return np.lib.stride_tricks.as_strided(arr, shape=shape, strides=[s * size for s in strides])

    def memoryview(self):
        """The region's bytes, from page 0 to the end of the last page
        (standard library only; host pools)."""
        self._check()
        if self.device != "cpu":
            raise TypeError("kvfence: memoryviews are of host pools")
        return memoryview(self._host_buffer(1)).cast("B")

    def cuda_array(self, dtype=None, page_shape=None):
        """A CudaArray (__cuda_array_interface__) over a CUDA pool's region."""
        self._check()
        if self.device == "cpu":
            raise TypeError("kvfence: __cuda_array_interface__ is for CUDA pools; this one is on the host")
        name, size, shape, strides = self.layout(dtype, page_shape)
        if name not in _CAI:
            raise TypeError("kvfence: __cuda_array_interface__ has no %s; use tensor() (DLPack)" % name)
        return CudaArray(self._mem, self.base, _CAI[name], shape, [s * size for s in strides])

    def _host_buffer(self, size):
        span = (self.pages - 1) * self.stride + self.page_bytes
        # A subclass of the array type: its instances take attributes.
        cls = type("RegionBuffer", (ctypes.c_uint8 * span,), {})
        buf = cls.from_address(self.base)
        buf._kvfence_memory = self._mem  # the buffer, and what views it, keep the memory alive
        return buf


def tensor_over(mem, device, base, dtype, shape, strides):
    """A torch tensor of dtype at base with shape/strides in elements,
    keeping mem alive (layouts that span several regions)."""
    torch = _torch()
    name = dtype_name(dtype)
    _, code, bits = _KVF_DTYPES[name]
    dev = (_dlpack.KDL_CPU, 0) if device == "cpu" else (_dlpack.KDL_CUDA, device[1])
    t = torch.utils.dlpack.from_dlpack(_Exporter(mem, base, dev, code, bits, list(shape), list(strides)))
    fp8 = _FP8_TORCH.get(name)
    if fp8 is not None and hasattr(torch, fp8):
        t = t.view(getattr(torch, fp8))
    return t


def _torch():
    try:
        import torch
        import torch.utils.dlpack  # noqa: F401
    except ImportError as e:
        raise ImportError("kvfence: tensor views need PyTorch (numpy() and memoryview() do not)") from e
    return torch


def torch_loaded():
    return "torch" in sys.modules
