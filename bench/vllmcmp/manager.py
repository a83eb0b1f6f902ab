#!/usr/bin/env python3
"""Load vLLM's own KVCacheManager (manager, coordinator, full-attention
single-type manager, block pool, kv_cache_utils) from its source, for
python/bench/bench_vllm_manager.py --vllm-src to drive beside kvfence's.

vLLM is not a dependency of kvfence and none of its code is in this
repository: point --vllm-src at a directory that holds vllm/v1/core/
{kv_cache_manager,kv_cache_coordinator,single_type_kv_cache_manager,
block_pool,kv_cache_utils}.py. Config, logging, events, metrics and the
KV cache specs are small stand-ins (as in blockpool.py): a
full-attention-only manager does not use the rest.

The files need not come from one commit (the store this was written
against had kv_cache_manager.py and kv_cache_utils.py at 003df29, the
coordinator and single-type manager at 00b08dc, block_pool.py at
c59cb79); the seams between such neighbours are bridged here, each named:
a block_hash setter on KVCacheBlock (older block pools assign it), a
block_mask argument to cache_full_blocks (None for full attention),
take_pending_partial_tail_offloads (the later name of
take_pending_boundary_state_offloads) and the coordinator's
use_eagle_prefix_cache_hashing flag (False).
"""

import dataclasses
import enum
import hashlib
import importlib.util
import logging
import pickle
import sys
import types

from blockpool import _Anything, _stub

CORE = ("kv_cache_utils", "block_pool", "single_type_kv_cache_manager", "kv_cache_coordinator", "kv_cache_manager")


class AttentionSpec:
    pass


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    block_size: int
    prefix_cacheable: bool = True


@dataclasses.dataclass
class KVCacheGroupSpec:
    layer_names: list
    kv_cache_spec: object
    is_eagle_group: bool = False


@dataclasses.dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list
    kv_cache_groups: list
    has_mamba_layers: bool = False
    needs_kv_cache_zeroing: bool = False
    prefix_cache_retention_interval: object = None


class _Kind(enum.Enum):
    FULL = "full_attention"


class PrefixCacheStats:
    """vllm/v1/metrics/stats.py's counters, as record() updates them."""

    def __init__(self):
        self.reset = False
        self.requests = self.queries = self.hits = 0
        self.preempted_requests = self.preempted_queries = self.preempted_hits = 0

    def record(self, num_tokens, num_hits, preempted):
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


def sha256(obj):
    """vllm/utils/hashing.py's sha256: SHA-256 of the pickled input."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def load(src, request_module):
    """Imports vLLM's KV cache manager from src. request_module provides
    Request and RequestStatus (python/tests/vllm_replay.py). Returns the
    kv_cache_manager module; its neighbours are in sys.modules."""
    for name in ["vllm", "vllm.v1", "vllm.v1.core", "vllm.utils", "vllm.distributed", "vllm.v1.metrics"]:
        _stub(name)
    _stub("vllm.envs", VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=False)
    sys.modules["vllm"].envs = sys.modules["vllm.envs"]
    _stub("vllm.config")
    _stub("vllm.logger", init_logger=logging.getLogger)
    _stub("vllm.utils.hashing", sha256_cbor=lambda x: b"", xxhash_cbor=lambda x: b"")
    _stub("vllm.utils.math_utils", cdiv=lambda a, b: -(-a // b), round_up=lambda x, m: -(-x // m) * m,
          round_down=lambda x, m: x // m * m)
    _stub("vllm.utils.mem_utils")
    _stub("vllm.utils.torch_utils")
    _stub("vllm.v1.kv_cache_interface", AttentionSpec=AttentionSpec, FullAttentionSpec=FullAttentionSpec,
          KVCacheGroupSpec=KVCacheGroupSpec, KVCacheConfig=KVCacheConfig,
          get_kv_cache_spec_kind=lambda spec: _Kind.FULL, get_kv_cache_spec_sliding_window=lambda spec: None)
    _stub("vllm.v1.kv_cache_spec_registry")
    _stub("vllm.v1.request", Request=request_module.Request, RequestStatus=request_module.RequestStatus)
    _stub("vllm.v1.utils")
    _stub("vllm.v1.metrics.stats", PrefixCacheStats=PrefixCacheStats)
    _stub("vllm.distributed.kv_events", MEDIUM_GPU="GPU", BlockStored=type("BlockStored", (), {}))
    _stub("vllm.v1.core.kv_cache_metrics")

    mods = {}
    for name in CORE:
        modname = "vllm.v1.core." + name
        spec = importlib.util.spec_from_file_location(modname, "%s/vllm/v1/core/%s.py" % (src, name))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
        if name == "kv_cache_utils":
            block = mod.KVCacheBlock
            if block.block_hash.fset is None:
                block.block_hash = property(block.block_hash.fget, lambda b, h: b.set_block_hash(h))
            if not hasattr(mod, "dcp_world_size_for_kv_cache_spec"):
                mod.dcp_world_size_for_kv_cache_spec = lambda spec, dcp: dcp
        elif name == "block_pool":
            cache_full = mod.BlockPool.cache_full_blocks
            if "block_mask" not in cache_full.__code__.co_varnames:
                def cache_full_blocks(self, *a, block_mask=None, **k):
                    assert block_mask is None, "a sparse block mask needs a newer block_pool.py"
                    return cache_full(self, *a, **k)
                mod.BlockPool.cache_full_blocks = cache_full_blocks
        elif name == "single_type_kv_cache_manager":
            base = mod.SingleTypeKVCacheManager
            if not hasattr(base, "take_pending_partial_tail_offloads"):
                base.take_pending_partial_tail_offloads = base.take_pending_boundary_state_offloads
            for absent in ("CrossAttentionManager", "MambaManager"):
                if not isinstance(getattr(mod, absent, None), type) or getattr(mod, absent) is _Anything:
                    setattr(mod, absent, type(absent, (), {}))
            if not isinstance(getattr(mod, "get_manager_for_kv_cache_spec", None), types.FunctionType):
                def get_manager_for_kv_cache_spec(kv_cache_spec, max_in_flight_tokens=None, max_model_len=None,
                                                  _full=mod.FullAttentionManager, **kw):
                    assert isinstance(kv_cache_spec, FullAttentionSpec), "only full attention is loaded"
                    return _full(kv_cache_spec, **kw)
                mod.get_manager_for_kv_cache_spec = get_manager_for_kv_cache_spec
        elif name == "kv_cache_coordinator":
            make = mod.get_kv_cache_coordinator
            if "use_eagle_prefix_cache_hashing" not in make.__code__.co_varnames:
                def get_kv_cache_coordinator(*a, use_eagle_prefix_cache_hashing=False, **k):
                    coord = make(*a, **k)
                    coord.use_eagle_prefix_cache_hashing = use_eagle_prefix_cache_hashing
                    return coord
                mod.get_kv_cache_coordinator = get_kv_cache_coordinator
    mods["kv_cache_utils"].init_none_hash(sha256)
    return mods["kv_cache_manager"]


def make_manager(kvm, block_size, num_blocks, max_model_len, log_stats=True):
    """vLLM's KVCacheManager over one full-attention group, prefix caching
    on, as Scheduler.__init__ builds it at 003df29."""
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size))])
    return kvm.KVCacheManager(kv_cache_config=cfg, max_model_len=max_model_len, scheduler_block_size=block_size,
                              hash_block_size=block_size, enable_caching=True, log_stats=log_stats)


def block_hasher(block_size):
    """vLLM's request block hasher with its default hash (sha256)."""
    return sys.modules["vllm.v1.core.kv_cache_utils"].get_request_block_hasher(block_size, sha256)
