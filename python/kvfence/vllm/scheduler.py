"""kvfence's scheduler plugin for vLLM: name it with --scheduler-cls.

    vllm serve MODEL --scheduler-cls kvfence.vllm.scheduler.Scheduler \
        --kv-transfer-config '{"kv_connector": "KvfenceConnector", ...}'

(kvfence.vllm.scheduler.AsyncScheduler with --async-scheduling.) vLLM's
own Scheduler and AsyncScheduler (VLLM_COMMIT) with kvfence's
KVCacheManager in place of vLLM's and the plugin's part of scheduling
(_plugin.SchedulerMixin). Importing this module imports vLLM.
"""

import logging

from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from .._core import Pool
from ._plugin import SchedulerMixin, make_manager, plugin_config, pool_config, socket_dir_ok

logger = logging.getLogger("kvfence.vllm")


def _unsupported(vc, kvc):
    """Why this vLLM configuration cannot run on kvfence, or None."""
    groups = kvc.kv_cache_groups
    if len(groups) != 1:
        return ("%d KV cache groups (a hybrid model): a pool over remote ranks holds one per-token group, and its "
                "ranks copy no state; kvfence.vllm.KVCacheManager serves hybrid groups over a local pool only"
                % len(groups))
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if not hasattr(spec, "num_kv_heads") or "MLA" in kind or getattr(spec, "sliding_window", None) \
            or getattr(spec, "attention_chunk_size", None):
        return "KV cache spec %s: kvfence.vllm serves full attention with K and V" % kind
    pc = vc.parallel_config
    if pc.pipeline_parallel_size > 1:
        return "pipeline parallelism: each stage holds other layers, which a pool over ranks does not describe"
    if getattr(pc, "decode_context_parallel_size", 1) > 1 or getattr(pc, "prefill_context_parallel_size", 1) > 1:
        return "context parallelism"
    if getattr(vc, "max_concurrent_batches", 1) > 2:
        return "more than 2 batches in flight (the worker's scrubs wait one step, which covers one step ahead)"
    if vc.model_config.is_encoder_decoder:
        return "encoder-decoder models (cross-attention caches)"
    return None


def _install(sched):
    vc, kvc = sched.vllm_config, sched.kv_cache_config
    why = _unsupported(vc, kvc)
    if why:
        raise ValueError("kvfence.vllm: not supported: " + why)
    cfg = plugin_config(vc.kv_transfer_config)
    group = kvc.kv_cache_groups[0]
    spec = group.kv_cache_spec
    tp = vc.parallel_config.tensor_parallel_size
    pc = pool_config(cfg, block_size=spec.block_size, layers=len(group.layer_names), kv_heads=spec.num_kv_heads * tp,
                     head_dim=spec.head_size, dtype=spec.dtype, num_blocks=kvc.num_blocks,
                     max_model_len=sched.max_model_len, ranks=tp,
                     data_parallel_rank=vc.parallel_config.data_parallel_rank)
    socket_dir_ok(pc["device"]["listen"])
    logger.info("kvfence: pool of %d pages over %d ranks at %s", kvc.num_blocks, tp, pc["device"]["listen"])
    pool = Pool(pc)
    mgr = make_manager(pool, cfg, max_model_len=sched.max_model_len,
                       enable_caching=sched.cache_config.enable_prefix_caching, log_stats=sched.log_stats,
                       enable_kv_cache_events=sched.enable_kv_cache_events,
                       num_lookahead_tokens=sched.num_lookahead_tokens, num_spec_tokens=sched.num_spec_tokens,
                       hash_block_size=getattr(sched, "hash_block_size", None))
    sched.kvf_install(mgr)


def _close(pool):
    """Destroys the pool at shutdown: its cached pages are scrubbed if the
    ranks still serve; a rank already gone fails the scrub, which is
    logged (nothing reuses the pool after this)."""
    try:
        pool.close()
    except Exception as e:  # noqa: BLE001
        logger.warning("kvfence: closing the pool at shutdown: %s", e)


class Scheduler(SchedulerMixin, _VllmScheduler):
    """vLLM's Scheduler on kvfence (the package doc)."""

    _RequestStatus = RequestStatus
    _EngineCoreOutput = EngineCoreOutput
    _EngineCoreOutputs = EngineCoreOutputs

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _install(self)

    def shutdown(self):
        try:
            super().shutdown()
        finally:
            _close(self.kv_cache_manager.pool)


class AsyncScheduler(SchedulerMixin, _VllmAsyncScheduler):
    """vLLM's AsyncScheduler on kvfence, for --async-scheduling."""

    _RequestStatus = RequestStatus
    _EngineCoreOutput = EngineCoreOutput
    _EngineCoreOutputs = EngineCoreOutputs

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _install(self)

    def shutdown(self):
        try:
            super().shutdown()
        finally:
            _close(self.kv_cache_manager.pool)
