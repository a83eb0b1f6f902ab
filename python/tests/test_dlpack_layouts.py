"""DLPack exports (the path CUDA pools take, tested here on the host, and
constructed only for a CUDA device: no GPU on this machine), the
__cuda_array_interface__ object (constructed only), and the MLA layout."""

import ctypes
import gc

import kvfence
import pytest
import torch
from kvfence import _dlpack

from caches import BLOCK


def host_pool(dtype="bf16"):
    return kvfence.Pool({"geometry": {"tokens_per_page": BLOCK, "layers": 1, "kv_heads": 2, "head_dim": 8,
                                      "dtype": dtype},
                         "pages": 8, "max_context_tokens": 64, "tenants": [{"name": "a"}]})


def test_each_tensor_holds_one_export_until_it_dies():
    with host_pool() as p:
        rv = p.region(0)
        assert _dlpack.live_exports(rv._mem) == 0
        t = rv.tensor()
        assert t.dtype == torch.bfloat16 and t.shape == (8, BLOCK, 2, 8)
        u = t[3]  # a view of the tensor shares its export
        assert _dlpack.live_exports(rv._mem) == 1
        del t
        gc.collect()
        assert _dlpack.live_exports(rv._mem) == 1  # u still shows the memory
        del u
        gc.collect()
        assert _dlpack.live_exports(rv._mem) == 0
        del rv


def test_unconsumed_capsule_releases_its_export():
    with host_pool() as p:
        rv = p.region(0)
        cap = rv.exporter().__dlpack__()
        assert _dlpack.live_exports(rv._mem) == 1
        del cap
        assert _dlpack.live_exports(rv._mem) == 0
        del rv


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def test_cuda_region_exports_a_kdlcuda_tensor_at_its_device_pointer():
    """Construction only: what torch.from_dlpack would receive for a CUDA
    pool's region (device type kDLCUDA, the pool's ordinal, the region's
    base, its page stride). Consuming it needs a GPU."""
    with host_pool("fp16") as p:
        rv = p.region(1)
        rv.device = ("cuda", 3)  # as a CUDA pool on device 3 reports it
        ex = rv.exporter(page_shape=(BLOCK * 2, 8))
        assert ex.__dlpack_device__() == (_dlpack.KDL_CUDA, 3)
        cap = ex.__dlpack__(stream=7)
        dl = _dlpack.describe(_get_pointer(cap, b"dltensor"))
        assert (dl.device.device_type, dl.device.device_id) == (_dlpack.KDL_CUDA, 3)
        assert dl.data == rv.base and dl.ndim == 3 and dl.byte_offset == 0
        assert (dl.dtype.code, dl.dtype.bits, dl.dtype.lanes) == (_dlpack.KDL_FLOAT, 16, 1)
        assert [dl.shape[i] for i in range(3)] == [8, BLOCK * 2, 8]
        assert [dl.strides[i] for i in range(3)] == [rv.stride // 2, 8, 1]
        del cap, dl
        assert _dlpack.live_exports(rv._mem) == 0
        cai = rv.cuda_array().__cuda_array_interface__
        assert cai == {"shape": (8, BLOCK, 2, 8), "typestr": "<f2", "data": (rv.base, False),
                       "strides": (rv.stride, 32, 16, 2), "version": 3}
        with pytest.raises(TypeError, match="host pools"):
            rv.numpy()
        del rv


def test_cuda_array_interface_refuses_host_pools_and_bf16():
    with host_pool() as p:
        rv = p.region(0)
        with pytest.raises(TypeError, match="CUDA pools"):
            rv.cuda_array()
        rv.device = ("cuda", 0)
        with pytest.raises(TypeError, match="bf16"):
            rv.cuda_array()
        del rv


def test_mla_latents_round_trip_through_slots_and_block_tables():
    cache = kvfence.layouts.mla(layers=2, num_blocks=8, block_size=BLOCK, kv_lora_rank=24, qk_rope_head_dim=8,
                                dtype="bf16")
    cfg = {"pages": 8, "max_context_tokens": 64, "tenants": [{"name": "a"}, {"name": "b"}],
           "scrub": {"kind": "poison"}}
    with kvfence.Pool(cfg, adopt=cache) as p:
        assert [r["base"] for r in p.regions()] == [t.data_ptr() for t in cache.tensors]
        lease = p.admit_tokens("r", "a", list(range(20)))
        slots = lease.slot_mapping_tensor(0, 20)
        view = p.region(1).tensor()  # [blocks, block_size, 32] over the engine's tensor
        assert view.shape == (8, BLOCK, 32) and view.data_ptr() == cache.tensors[1].data_ptr()
        lat = torch.randn(20, 32).to(torch.bfloat16)
        view.flatten(0, 1)[slots] = lat
        got = cache.tensors[1][lease.block_table_tensor().long()].flatten(0, 1)[:20]
        assert torch.equal(got, lat)
        table = lease.block_table()
        lease.free()
        b = p.admit("b", "b", 64)
        assert set(table) <= set(b.block_table())
        assert cache.tensors[1][table].view(torch.int16).unique().tolist() == [-(1 << 15)]
        b.free()
        del view


def test_vllm_kv_cache_view_is_the_engines_tensor():
    cache = kvfence.layouts.vllm(1, 8, BLOCK, 2, 8, dtype="fp16")
    with kvfence.Pool({"max_context_tokens": 64, "tenants": [{"name": "a"}]}, adopt=cache) as p:
        kv = p.vllm_kv_cache(0)
        t = cache.tensors[0]
        assert kv.shape == t.shape and kv.stride() == t.stride() and kv.data_ptr() == t.data_ptr()
        del kv
    with host_pool() as p, pytest.raises(TypeError, match="separate allocations"):
        p.vllm_kv_cache(0)


def test_adopt_refuses_a_config_that_describes_the_cache_too():
    cache = kvfence.layouts.vllm(1, 8, BLOCK, 2, 8, dtype="fp16")
    with pytest.raises(ValueError, match="geometry"):
        kvfence.Pool({"geometry": {}, "max_context_tokens": 64, "tenants": [{"name": "a"}]}, adopt=cache)


def test_exports_survive_another_module_retyping_ctypes_pythonapi():
    api = ctypes.pythonapi.PyCapsule_IsValid
    saved = (api.argtypes, api.restype)
    api.argtypes, api.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_int
    try:
        with host_pool() as p:
            rv = p.region(0)
            cap = rv.exporter().__dlpack__()
            del cap
            assert _dlpack.live_exports(rv._mem) == 0
            del rv
    finally:
        api.argtypes, api.restype = saved
