"""The scheduler plugin's and the KV connector's logic, apart from vLLM's
classes (scheduler.py and connector.py bind them to vLLM's Scheduler,
AsyncScheduler and KVConnectorBase_V1), so that they run, and are tested,
without vLLM.

SchedulerMixin goes before vLLM's Scheduler in the plugin's bases. Around
vLLM's own schedule() it does two things vLLM's loop cannot do with a
manager's None:

- before: running requests whose leases grow on demand get the room their
  next step can need. A refusal that is the tenant's own (its quota, or
  pages reserved for other tenants) preempts that tenant's newest running
  request, as vLLM's policy would but among that tenant's requests only,
  until the room is there or the request itself is preempted; a refusal
  that is the pool's (short for everyone) is left to vLLM's running loop,
  whose None preempts by vLLM's policy. A refusal for good finishes the
  request with FINISHED_ERROR.
- after: requests the manager refused for good (unknown or
  unauthenticated tenant, a client-set tenant field, longer than the
  context, the pool or the tenant's whole quota) are finished with
  FINISHED_ERROR; their outputs go out with the next update_from_output.
  The connector had the waiting loop skip them (get_num_new_matched_tokens
  is None), as it skips a request whose tenant is refused for now, so that
  neither blocks the other tenants' queue.

Over a hybrid pool (window or state groups, which share prefixes through
state checkpoints) it has vLLM's scheduler end prefill chunks where vLLM's
"align" Mamba cache mode ends them (_mamba_block_aligned_split: on block
boundaries, at the last one of the prompt) and also at the lease's
PrefillCheckpoint, the deepest page boundary a later identical prompt can
hit: the manager checkpoints when the next chunk starts there.
"""

import json
import logging
import os
import threading
import time

from ..errors import BadOrdering, KvfenceError, PoolClosed
from . import _keys
from ._manager import BACKPRESSURE, DEFERRED, ERROR, KVCacheManager

logger = logging.getLogger("kvfence.vllm")

# The pool-config keys an operator may set in kv_connector_extra_config's
# "kvfence" object; the plugin sets geometry, pages, max_context_tokens and
# device itself from vLLM's KV cache config.
POOL_KEYS = ("tenants", "scrub", "prefix", "sizing", "growth_watermark", "allow_undersized_pool")
PLUGIN_KEYS = ("listen", "tenant_resolver", "salt", "report_timeout_ms", "accept_timeout_ms", "connect_timeout_ms",
               "step_lag")
DEFAULT_SIZING = {"mode": "on_demand", "headroom_tokens": 256}
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8_e4m3",
          "float8_e5m2": "fp8_e5m2"}


def plugin_config(kv_transfer_config):
    """The "kvfence" object of kv_transfer_config.kv_connector_extra_config,
    checked: unknown keys are refused (a typo must not run with defaults)."""
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    cfg = extra.get("kvfence")
    if isinstance(cfg, str):
        cfg = json.loads(cfg)
    if not isinstance(cfg, dict):
        raise ValueError("kvfence.vllm: kv_transfer_config.kv_connector_extra_config needs a \"kvfence\" object "
                         "(python/README.md, \"Running kvfence in vLLM\")")
    unknown = sorted(set(cfg) - set(POOL_KEYS) - set(PLUGIN_KEYS))
    if unknown:
        raise ValueError("kvfence.vllm: unknown keys in the \"kvfence\" config: %s" % ", ".join(unknown))
    for k in ("listen", "tenant_resolver"):
        if not cfg.get(k):
            raise ValueError("kvfence.vllm: the \"kvfence\" config needs %r" % k)
    return cfg


def listen_address(cfg, data_parallel_rank=0):
    """The pool's listen address for one data-parallel engine: "{dp}" in
    it becomes the rank, so that every engine has its own."""
    return cfg["listen"].replace("{dp}", str(data_parallel_rank))


def dtype_name(dtype):
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError("kvfence.vllm: KV cache dtype %s is not supported (want one of %s)"
                         % (dtype, ", ".join(sorted(DTYPES))))
    return DTYPES[name]


def pool_config(cfg, *, block_size, layers, kv_heads, head_dim, dtype, num_blocks, max_model_len, ranks,
                data_parallel_rank=0):
    """The scheduler's pool config: kvfence's geometry of vLLM's one KV
    cache group (kv_heads counts every tensor-parallel rank's), over remote
    ranks, one per tensor-parallel worker."""
    pc = {k: cfg[k] for k in POOL_KEYS if k in cfg}
    pc.setdefault("sizing", dict(DEFAULT_SIZING))
    pc.setdefault("allow_undersized_pool", True)
    pc["geometry"] = {"tokens_per_page": block_size, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                      "dtype": dtype_name(dtype)}
    pc["pages"] = num_blocks
    pc["max_context_tokens"] = max_model_len
    dev = {"kind": "remote", "listen": listen_address(cfg, data_parallel_rank), "ranks": ranks}
    for k in ("report_timeout_ms", "accept_timeout_ms"):
        if k in cfg:
            dev[k] = cfg[k]
    pc["device"] = dev
    return pc


class SchedulerMixin:
    """The plugin's part of the Scheduler (the module doc). The concrete
    class names vLLM's RequestStatus, EngineCoreOutput and
    EngineCoreOutputs."""

    _RequestStatus = None
    _EngineCoreOutput = None
    _EngineCoreOutputs = None

    def kvf_install(self, manager):
        """Puts the kvfence manager in place of vLLM's and binds the
        connector to it."""
        self.kv_cache_manager = manager
        self._kvf_errored = []
        conn = getattr(self, "connector", None)
        if conn is None or not hasattr(conn, "kvf_bind"):
            raise ValueError("kvfence.vllm: the scheduler plugin needs kvfence's KV connector (kv_transfer_config "
                             "{\"kv_connector\": \"KvfenceConnector\", \"kv_connector_module_path\": "
                             "\"kvfence.vllm.connector\", ...}), which has the waiting loop skip a request a "
                             "tenant's refusal holds back")
        conn.kvf_bind(manager)
        conn.bind_gpu_block_pool(manager.block_pool)
        if manager.hybrid and manager.enable_caching:
            # vLLM's own flag for the "align" cache mode's chunk ends.
            self.need_mamba_block_aligned_split = True

    def _mamba_block_aligned_split(self, request, num_new_tokens, num_new_local_computed_tokens=0,
                                   num_external_computed_tokens=0):
        """vLLM's split of a prefill chunk at the block boundaries where the
        state is kept, and at the lease's PrefillCheckpoint."""
        n = super()._mamba_block_aligned_split(request, num_new_tokens, num_new_local_computed_tokens,
                                               num_external_computed_tokens)
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        return self.kv_cache_manager.checkpoint_stop(request, start, start + n) - start

    def schedule(self, *args, **kwargs):
        self._kvf_finish_errors()
        self._kvf_make_room()
        out = super().schedule(*args, **kwargs)
        self._kvf_finish_errors()
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._kvf_errored:
            errored, self._kvf_errored = self._kvf_errored, []
            for req in errored:
                out = self._EngineCoreOutput(request_id=req.request_id, new_token_ids=[],
                                             finish_reason=req.get_finished_reason(), events=req.take_events(),
                                             trace_headers=req.trace_headers)
                eco = outputs.get(req.client_index)
                if eco is None:
                    outputs[req.client_index] = self._EngineCoreOutputs(outputs=[out])
                else:
                    eco.outputs.append(out)
        return outputs

    def _kvf_finish_errors(self):
        for req, refusal in self.kv_cache_manager.take_errors():
            if self.requests.get(req.request_id) is not req or req.is_finished():
                continue
            logger.warning("kvfence: request %s finished with an error: %s", req.request_id, refusal.message)
            self.finish_requests(req.request_id, self._RequestStatus.FINISHED_ERROR)
            self._kvf_errored.append(req)

    def _kvf_step_need(self, req):
        """The most tokens req's lease must hold for this step: what vLLM's
        running loop may schedule (scheduler.py: schedule, "First, schedule
        the RUNNING requests": num_tokens_with_spec + placeholders -
        computed, capped by max_model_len) plus the lookahead slots."""
        n = req.num_tokens_with_spec + req.num_output_placeholders - req.num_computed_tokens
        n = min(n, self.max_model_len - req.num_computed_tokens - getattr(self, "num_sampled_tokens_per_step", 1))
        if n <= 0:
            return 0
        return min(req.num_computed_tokens + n + self.num_lookahead_tokens, self.max_model_len)

    def _kvf_victim(self, req, tenant):
        """The running request of tenant vLLM's policy would preempt first:
        the newest (FCFS), or the lowest priority (PRIORITY)."""
        mgr = self.kv_cache_manager
        mine = [r for r in self.running if mgr.tenant_of(r.request_id) == tenant]
        if not mine:
            return req
        if str(getattr(self.policy, "value", self.policy)).lower() == "priority":
            return max(mine, key=lambda r: (r.priority, r.arrival_time))
        return mine[-1]

    def _kvf_make_room(self):
        mgr = self.kv_cache_manager
        if not mgr.grows:
            return
        i = 0
        while i < len(self.running):
            req = self.running[i]
            refusal = mgr.ensure_room(req, self._kvf_step_need(req))
            if refusal is None or refusal.kind == BACKPRESSURE:
                i += 1
                continue
            if refusal.kind == ERROR:
                logger.warning("kvfence: running request %s finished with an error: %s", req.request_id,
                               refusal.message)
                self.finish_requests(req.request_id, self._RequestStatus.FINISHED_ERROR)
                self._kvf_errored.append(req)
                continue
            victim = self._kvf_victim(req, mgr.tenant_of(req.request_id))
            logger.info("kvfence: tenant %s's request %s cannot grow (%s): preempting its request %s",
                        mgr.tenant_of(req.request_id), req.request_id, refusal.message, victim.request_id)
            at = self.running.index(victim)
            self.running.pop(at)
            self._preempt_request(victim, time.monotonic(), drop_stale_output=getattr(self, "requires_kv_delivery",
                                                                                        False))
            if victim is not req and at < i:
                i -= 1


class ConnectorScheduler:
    """The scheduler side of kvfence's KV connector: it loads and saves no
    KV; it tells the waiting loop to skip a request the manager refused for
    its tenant's sake or for good, and keeps the engine stepping while the
    ranks have scrubs to launch."""

    def __init__(self):
        self._kvf_manager = None

    def kvf_bind(self, manager):
        self._kvf_manager = manager

    def _manager(self):
        if self._kvf_manager is None:
            raise RuntimeError("kvfence.vllm: kvfence's KV connector runs with kvfence's scheduler plugin only "
                               "(--scheduler-cls kvfence.vllm.scheduler.Scheduler, or .AsyncScheduler)")
        return self._kvf_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        """(0, False), or (None, False) for a request refused this step for
        its tenant's quota or reservation, or for good: vLLM moves it to the
        skipped queue and goes on with the next request (scheduler.py:
        schedule, "if ext_tokens is None")."""
        refusal = self._manager().refusal_of(request.request_id)
        if refusal is not None and refusal.kind in (DEFERRED, ERROR):
            return None, False
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def request_finished(self, request, block_ids):
        """The lease ends in the manager's free(), for finishes and
        preemptions alike; nothing is saved or sent."""
        return False, None

    def has_pending_push_work(self):
        """True while released pages wait for their scrub: the engine keeps
        stepping (empty steps run the worker's hooks, which launch the
        scrubs) until every page is clean, also once no request is left."""
        mgr = self._kvf_manager
        if mgr is None or mgr.pool.closed:
            return False
        return mgr.pool.stats()["quarantined_pages"] > 0


def kv_regions(kv_caches, layer_names, num_blocks):
    """The rank worker's regions over vLLM's KV cache tensors, layer l's K
    in region 2l and its V in 2l+1, in layer_names' order (kv_cache_config's
    group): per layer a tensor with a dimension of num_blocks and one of 2
    (K and V), in any order and memory layout in which one block's K (and
    V) is contiguous (vLLM's flash-attention [2, num_blocks, block_size,
    heads, head_size], FlashInfer's [num_blocks, 2, ...], their HND
    permutations). Layers sharing one tensor, and tensors without K and V
    (MLA), are refused."""
    regions, seen = [], {}
    for name in layer_names:
        t = kv_caches[name]
        shape = list(t.shape)
        bdims = [d for d, n in enumerate(shape) if n == num_blocks]
        kvdims = [d for d, n in enumerate(shape) if n == 2 and d not in bdims[:1]]
        if not bdims or not kvdims:
            raise ValueError("kvfence.vllm: layer %s's KV cache of shape %s has no dimension of %d blocks and one of "
                             "2 (K, V); MLA and other caches need a pool with a cache spec, not supported over ranks"
                             % (name, tuple(shape), num_blocks))
        b, k = bdims[0], kvdims[0]
        if t.data_ptr() in seen:
            raise ValueError("kvfence.vllm: layers %s and %s share one KV cache tensor, which kvfence does not "
                             "support" % (seen[t.data_ptr()], name))
        seen[t.data_ptr()] = name
        es = t.element_size()
        for half in (0, 1):
            sub = t.select(k, half)
            page = sub.select(b if b < k else b - 1, 0)
            span = 1 + sum((n - 1) * s for n, s in zip(page.shape, page.stride()))
            if span != page.numel() or min(page.stride(), default=1) <= 0:
                raise ValueError("kvfence.vllm: layer %s: one block's %s is not contiguous (shape %s, strides %s)"
                                 % (name, "KV"[half], tuple(shape), t.stride()))
            regions.append({"base": page.data_ptr(), "stride": t.stride(b) * es, "page_bytes": page.numel() * es,
                            "pages": num_blocks})
    return regions


class ConnectorWorker:
    """The worker side of kvfence's KV connector, in each tensor-parallel
    worker process: a kvfence RankWorker over the KV cache tensors vLLM
    allocated (adopted: kvfence scrubs them in place), which launches the
    scrubs the scheduler's pool hands to this rank at wait_for_save, the
    end of each step's forward, on that step's stream, one step late
    ("step_lag": 1): a request the scheduler frees may still be in a step
    this worker has yet to queue (asynchronous scheduling runs one step
    ahead of the outputs it has processed), and a scrub launched a step
    late follows every kernel of that step, the drafter's included.

    The RankWorker connects in a thread of its own: vLLM creates the
    scheduler, whose pool waits for every rank, only after the workers
    have registered their KV caches."""

    def __init__(self, connect, rank, layer_names, num_blocks, device=None, step_lag=1, connect_timeout_ms=600000):
        self.connect, self.rank = connect, rank
        self.layer_names, self.num_blocks = layer_names, num_blocks
        self.device, self.step_lag, self.connect_timeout_ms = device, step_lag, connect_timeout_ms
        self._worker = None
        self._error = None
        self._thread = None
        self._ended = False

    def register_kv_caches(self, kv_caches):
        regions = kv_regions(kv_caches, self.layer_names, self.num_blocks)
        first = kv_caches[self.layer_names[0]]
        device = self.device
        if device is None and first.device.type == "cuda":
            device = {"kind": "cuda", "ordinal": first.device.index or 0}
        self._keep = kv_caches  # the adopted memory outlives the worker
        self._thread = threading.Thread(target=self._connect, args=(regions, device), daemon=True,
                                        name="kvfence-rank-%d" % self.rank)
        self._thread.start()

    def _connect(self, regions, device):
        from .._core import RankWorker
        cfg_device = device
        try:
            w = RankWorker(self.connect, self.rank, regions, device=cfg_device,
                           connect_timeout_ms=self.connect_timeout_ms, step_lag=self.step_lag)
        except Exception as e:  # noqa: BLE001 - reported by ready() and the step hook
            self._error = e
            logger.error("kvfence: rank %d could not join the scheduler's pool at %s: %s", self.rank, self.connect, e)
            return
        self._worker = w

    def ready(self, timeout=None):
        """Waits up to timeout for the RankWorker; True once it serves."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self._error is not None:
            raise self._error
        return self._worker is not None

    def wait_for_save(self, stream=None):
        """The step hook: launches this rank's scrubs due now, ordered after
        the step's kernels on the current stream. Never raises into the
        model runner: a stream being captured into a CUDA graph is refused
        (the scrubs wait for the next step); a lost scheduler ends the
        worker."""
        w = self._worker
        if w is None or self._ended:
            return 0
        try:
            return w.step(stream)
        except BadOrdering:
            return 0
        except PoolClosed:
            self._ended = True
            return 0
        except KvfenceError as e:
            logger.error("kvfence: rank %d step failed: %s", self.rank, e)
            return 0

    def close(self):
        """Launches what is due (no step of the engine follows) and closes
        the RankWorker."""
        for _ in range(self.step_lag + 1):
            self.wait_for_save()
        w, self._worker = self._worker, None
        if w is not None:
            w.close()


def default_resolver(cfg):
    return _keys.resolver(cfg["tenant_resolver"])


def make_manager(pool, cfg, *, max_model_len, enable_caching, log_stats, enable_kv_cache_events,
                 num_lookahead_tokens, num_spec_tokens, hash_block_size=None):
    return KVCacheManager(pool, max_model_len, default_resolver(cfg), enable_caching=enable_caching,
                          log_stats=log_stats, enable_kv_cache_events=enable_kv_cache_events,
                          num_lookahead_tokens=num_lookahead_tokens, num_spec_tokens=num_spec_tokens,
                          salt=cfg.get("salt"), hash_block_size=hash_block_size)


def socket_dir_ok(address):
    """Warns when a unix socket's directory is reachable by others: the
    rank protocol authenticates nothing."""
    if address.startswith("unix:"):
        d = os.path.dirname(address[5:]) or "."
        try:
            mode = os.stat(d).st_mode
        except OSError:
            return
        if mode & 0o022:
            logger.warning("kvfence: the rank socket's directory %s is writable by others; the rank protocol "
                           "authenticates nothing", d)
