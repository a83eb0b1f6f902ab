"""vLLM's Scheduler and AsyncScheduler at commit 003df29, reduced to what
they do with their kv_cache_manager and KV connector, in the order they do
it, for tests of kvfence.vllm without vLLM (which these machines cannot
install).

Every method names the vLLM function it replays (vllm/v1/core/sched/
scheduler.py, async_scheduler.py, vllm/v1/request.py at 003df29;
async_scheduler.py at 014b2350, the nearest stored) and quotes the lines
whose calls and arithmetic it keeps. Kept: the running loop with its
preemption, the waiting loop through the connector path, chunked prefill
(the token budget and long_prefill_token_threshold), the block-aligned
split of prefill chunks of a hybrid model's "align" Mamba cache mode
(_mamba_block_aligned_split), speculative decoding (spec tokens in
num_tokens_with_spec, num_lookahead_tokens, rejection rollback), the
asynchronous scheduler's placeholders and in-flight tokens,
update_from_output, finish_requests, reset_prefix_cache.
Left out, because they make no other manager call: encoder inputs,
structured output, LoRA slot limits, streaming sessions, KV loads by other
connectors, pooling, stats beyond the prefix cache's.

Worker mirrors a worker's block tables, one row per KV cache group
(gpu_model_runner's _update_states, as at 003df29's neighbours: new
requests take their block IDs whole, cached ones append each group's
new_block_ids to that group's row or, resumed, replace them).
"""

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

from kvfence.vllm._plugin import ConnectorScheduler, SchedulerMixin


class RequestStatus(enum.IntEnum):
    """vllm/v1/request.py: RequestStatus (anything after PREEMPTED is finished)."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    @staticmethod
    def is_finished(status):
        return status > RequestStatus.PREEMPTED


FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                  RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_IGNORED: "length",
                  RequestStatus.FINISHED_ERROR: "error", RequestStatus.FINISHED_REPETITION: "repetition"}


@dataclass
class SamplingParams:
    max_tokens: int
    extra_args: dict = None
    skip_reading_prefix_cache: bool = None


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int = 1


@dataclass
class PlaceholderRange:
    offset: int
    length: int


@dataclass
class MultiModalFeatureSpec:
    identifier: str
    mm_position: PlaceholderRange


class Request:
    """vllm/v1/request.py: Request, the fields the scheduler and the
    manager read."""

    def __init__(self, request_id, prompt_token_ids, max_tokens, tenant=None, lora_name=None, cache_salt=None,
                 mm_features=None, priority=0, extra_args=None, client_index=0, eos_token_id=None):
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.sampling_params = SamplingParams(max_tokens, extra_args)
        self.pooling_params = None
        self.lora_request = LoRARequest(lora_name) if lora_name else None
        self.arrival_time = time.time()
        self.status = RequestStatus.WAITING
        self.events = []
        self.kv_transfer_params = None
        self.max_tokens = max_tokens
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_embeds = None
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids = []
        self._all_token_ids = list(self.prompt_token_ids)
        self.num_output_placeholders = 0
        self.num_stale_output_tokens = 0
        self.drop_stale_output = False
        self.num_in_flight_tokens = 0
        self.spec_token_ids = []
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.mm_features = mm_features or []
        # The server-authenticated tenant, as an operator's front end puts
        # it (the resolver "trace_header:x-tenant").
        self.trace_headers = {"x-tenant": tenant} if tenant else None
        self.is_prefill_chunk = False
        self.shared_prefix_boundary = 0
        self.num_preemptions = 0
        self.skip_reading_prefix_cache = False
        self.eos_token_id = eos_token_id

    @property
    def all_token_ids(self):
        return self._all_token_ids

    @property
    def output_token_ids(self):
        return self._output_token_ids

    @property
    def num_tokens(self):
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self):
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self):
        return len(self._output_token_ids)

    @property
    def has_encoder_inputs(self):
        return False

    def append_output_token_ids(self, token_ids):
        self._output_token_ids.append(token_ids)
        self._all_token_ids.append(token_ids)

    def is_finished(self):
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self):
        return FINISH_REASONS.get(self.status)

    def take_events(self):
        events, self.events = self.events or None, []
        return events

    def invalidate_eagle_hash_publication(self, num_hashes=0):
        pass


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list
    finish_reason: object = None
    events: object = None
    trace_headers: object = None


@dataclass
class EngineCoreOutputs:
    outputs: list = field(default_factory=list)
    finished_requests: object = None


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list          # (req_id, block_ids)
    scheduled_cached_reqs: list       # (req_id, new_block_ids or None, resumed)
    num_scheduled_tokens: dict
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict
    num_common_prefix_blocks: list
    preempted_req_ids: set
    finished_req_ids: set


class ReplayConnector(ConnectorScheduler):
    """The scheduler side of kvfence's connector (connector.py's
    KvfenceConnector, which delegates to ConnectorScheduler), without
    vLLM's base class."""

    requires_kv_delivery = False

    def bind_gpu_block_pool(self, block_pool):
        self.block_pool = block_pool

    def build_connector_meta(self, scheduler_output):
        return None


class ReplayScheduler:
    """vllm/v1/core/sched/scheduler.py: Scheduler at 003df29, its calls
    into kv_cache_manager and connector."""

    def __init__(self, kv_cache_manager, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
                 long_prefill_token_threshold=0, num_lookahead_tokens=0, num_spec_tokens=0, policy="fcfs",
                 connector=True, log_stats=True, enable_chunked_prefill=True):
        self.kv_cache_manager = kv_cache_manager
        self.max_num_running_reqs = max_num_seqs
        self.max_num_scheduled_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.enable_chunked_prefill = enable_chunked_prefill
        self.scheduler_config = SimpleNamespace(long_prefill_token_threshold=long_prefill_token_threshold)
        # What _mamba_block_aligned_split reads. vLLM sets the flag for a
        # model with Mamba layers in "align" cache mode; kvfence's plugin
        # sets it for a hybrid pool.
        self.cache_config = SimpleNamespace(block_size=kv_cache_manager.block_size)
        self.hash_block_size = kv_cache_manager.block_size
        self.use_eagle = False
        self.mamba_partial_cache_hit = False
        self.need_mamba_block_aligned_split = False
        self.num_lookahead_tokens = num_lookahead_tokens
        self.num_spec_tokens = num_spec_tokens
        self.num_sampled_tokens_per_step = 1
        self.policy = policy
        self.connector = ReplayConnector() if connector else None
        self.requires_kv_delivery = False
        self.log_stats = log_stats
        self.requests = {}
        self.waiting = deque()
        self.skipped_waiting = deque()
        self.running = []
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()
        self.prev_step_scheduled_req_ids = set()
        self.calls = []  # (method, request ID) of every manager call, in order, for tests
        self.prefix_stats = []  # make_prefix_cache_stats() of every update_from_output
        self.events = []        # take_events() of every update_from_output

    # ---- add_request / finish_requests

    def add_request(self, request):
        """Scheduler.add_request: `self._enqueue_waiting_request(request);
        self.requests[request.request_id] = request`."""
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids, finished_status):
        """Scheduler.finish_requests: remove from the queues, then
        `request.status = finished_status; self._free_request(request)`."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        valid = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            valid.append(req)
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                for q in (self.waiting, self.skipped_waiting):
                    if req in q:
                        q.remove(req)
        for req in valid:
            req.status = finished_status
            self._free_request(req)
        return valid

    def _free_request(self, request):
        """Scheduler._free_request → _connector_finished
        (`self.kv_cache_manager.remove_skipped_blocks(request_id=...,
        processed_computed_tokens=max(0, request.num_computed_tokens -
        request.num_in_flight_tokens), num_prompt_tokens=...)`;
        `block_ids = self.kv_cache_manager.get_block_ids_for_computed_tokens(
        request_id=..., num_computed_tokens=request.num_computed_tokens)`;
        `self.connector.request_finished(request, block_ids[0])`), then
        `self.finished_req_ids.add(request_id)` and _free_blocks →
        _free_request_blocks → `self.kv_cache_manager.free(request)`."""
        assert request.is_finished()
        delay = False
        if self.connector is not None:
            mgr = self.kv_cache_manager
            mgr.remove_skipped_blocks(request_id=request.request_id,
                                      processed_computed_tokens=max(0, request.num_computed_tokens
                                                                    - request.num_in_flight_tokens),
                                      num_prompt_tokens=request.num_prompt_tokens)
            block_ids = mgr.get_block_ids_for_computed_tokens(request_id=request.request_id,
                                                              num_computed_tokens=request.num_computed_tokens)
            delay, _ = self.connector.request_finished(request, block_ids[0])
        self.finished_req_ids.add(request.request_id)
        if not delay:
            self._call("free", request.request_id)
            self.kv_cache_manager.free(request)
            del self.requests[request.request_id]

    def _call(self, name, rid=None):
        self.calls.append((name, rid))

    # ---- schedule

    def _preempt_request(self, request, timestamp, drop_stale_output=False):
        """Scheduler._preempt_request: `self._free_request_blocks(request)`
        (→ `self.kv_cache_manager.free(request)`), then `request.status =
        RequestStatus.PREEMPTED; request.num_computed_tokens = 0`, stale
        output accounting, `self.waiting.prepend_request(request)`."""
        assert request.status == RequestStatus.RUNNING
        self._call("free", request.request_id)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.invalidate_eagle_hash_publication()
        request.spec_token_ids = []
        request.drop_stale_output = drop_stale_output or (request.drop_stale_output
                                                          and request.num_stale_output_tokens > 0)
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.reset_preempted_req_ids.add(request.request_id)

    def _mamba_block_aligned_split(self, request, num_new_tokens, num_new_local_computed_tokens=0,
                                   num_external_computed_tokens=0):
        """Scheduler._mamba_block_aligned_split at 003df29, whole: `start =
        request.num_computed_tokens + num_new_local_computed_tokens +
        num_external_computed_tokens`; past the prompt (`start >=
        max(request.num_prompt_tokens, request.num_tokens - 1)`) nothing;
        `last_cache_position = request.num_tokens - request.num_tokens %
        block_size` (less a block with EAGLE); `if end < last_cache_position`
        the chunk ends on a block boundary (`aligned_end = end // block_size
        * block_size; if aligned_end > start or block_size <=
        max_prefill_tokens: end = aligned_end`); then it stops at the
        earliest of the next block boundary (resumed mid-block),
        last_cache_position, the partial-tail hash boundary and the
        shared-prefix junction strictly inside it."""
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        if start >= max(request.num_prompt_tokens, request.num_tokens - 1):
            return num_new_tokens
        block_size = self.cache_config.block_size
        last_cache_position = request.num_tokens - request.num_tokens % block_size
        if self.use_eagle:
            last_cache_position = max(last_cache_position - block_size, 0)
        end = start + num_new_tokens
        if end < last_cache_position:
            max_prefill_tokens = self.max_num_scheduled_tokens
            threshold = self.scheduler_config.long_prefill_token_threshold
            if threshold > 0:
                max_prefill_tokens = min(max_prefill_tokens, threshold)
            aligned_end = end // block_size * block_size
            if aligned_end > start or block_size <= max_prefill_tokens:
                end = aligned_end
        next_block_boundary = (start // block_size + 1) * block_size
        tail_boundary = (request.num_prompt_tokens // self.hash_block_size * self.hash_block_size
                         if self.mamba_partial_cache_hit else 0)
        stops = (
            next_block_boundary if start % block_size != 0 and next_block_boundary <= last_cache_position else 0,
            last_cache_position,
            tail_boundary if last_cache_position < tail_boundary < request.num_prompt_tokens else 0,
            start + (request.shared_prefix_boundary - start) // block_size * block_size
            if start < request.shared_prefix_boundary < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def schedule(self, throttle_prefills=False):
        """Scheduler.schedule at 003df29, its manager and connector calls:
        `self.kv_cache_manager.new_step_starts()`; the running loop
        (`new_blocks = self.kv_cache_manager.allocate_slots(request,
        num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens)`,
        preempting `self.running.pop()` — or, PRIORITY, `max(self.running,
        key=lambda r: (r.priority, r.arrival_time))` — while it is None);
        the waiting loop, only `if not preempted_reqs` (connector path:
        `get_computed_blocks_for_connector(request)`,
        `self.connector.get_num_new_matched_tokens(request,
        block_aligned_local)`, `allocate_slots(request, num_new_tokens,
        num_new_computed_tokens=..., new_computed_blocks=...,
        num_lookahead_tokens=effective_lookahead_tokens,
        num_external_computed_tokens=..., delay_cache_blocks=load_kv_async,
        num_encoder_tokens=..., full_sequence_must_fit=...,
        reserved_blocks=..., has_scheduled_reqs=bool(self.running))`,
        `self.connector.update_state_after_alloc(request,
        self.kv_cache_manager.get_blocks(request_id), ...)`,
        `self.kv_cache_manager.record_prefix_cache_stats(request,
        num_new_local_computed_tokens)`, `req_to_new_blocks[request_id] =
        self.kv_cache_manager.get_blocks(request_id)`); then
        `get_num_common_prefix_blocks(any_request_id)`, the new requests'
        `get_block_ids()`, the cached ones'
        `get_block_ids(allow_none=True)`, `take_partial_tail_offloads()`
        (a producer's connector), `take_kv_cache_block_copies()`,
        `take_new_block_ids()` and _update_after_schedule."""
        mgr = self.kv_cache_manager
        scheduled_new, scheduled_resumed, scheduled_running, preempted = [], [], [], []
        req_to_new_blocks, num_scheduled, spec_tokens = {}, {}, {}
        token_budget = self.max_num_scheduled_tokens
        now = time.monotonic()
        self._call("new_step_starts")
        mgr.new_step_starts()

        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if (request.num_output_placeholders > 0
                    and request.num_computed_tokens + 2 - request.num_output_placeholders
                    >= request.num_prompt_tokens + request.max_tokens):
                req_index += 1
                continue
            num_new = request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens
            if 0 < self.long_prefill_token_threshold < num_new:
                num_new = self.long_prefill_token_threshold
            num_new = min(num_new, token_budget)
            num_new = min(num_new, self.max_model_len - request.num_computed_tokens - self.num_sampled_tokens_per_step)
            if self.need_mamba_block_aligned_split:
                num_new = self._mamba_block_aligned_split(request, num_new)
            if num_new <= 0:
                req_index += 1
                continue
            while True:
                self._call("allocate_slots", request.request_id)
                new_blocks = mgr.allocate_slots(request, num_new, num_lookahead_tokens=self.num_lookahead_tokens)
                if new_blocks is not None:
                    break
                if self.policy == "priority":
                    victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                    self.running.remove(victim)
                    if victim in scheduled_running:
                        scheduled_running.remove(victim)
                        token_budget += num_scheduled.pop(victim.request_id)
                        req_to_new_blocks.pop(victim.request_id)
                        spec_tokens.pop(victim.request_id, None)
                        req_index -= 1
                else:
                    victim = self.running.pop()
                self._preempt_request(victim, now, drop_stale_output=self.requires_kv_delivery)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            scheduled_running.append(request)
            rid = request.request_id
            req_to_new_blocks[rid] = new_blocks
            num_scheduled[rid] = num_new
            token_budget -= num_new
            req_index += 1
            if request.spec_token_ids:
                n_spec = num_new + request.num_computed_tokens - request.num_tokens - request.num_output_placeholders
                if n_spec > 0:
                    spec_tokens[rid] = request.spec_token_ids[:n_spec]
                request.spec_token_ids = []

        if not preempted:
            step_skipped = deque()
            while (self.waiting or self.skipped_waiting) and token_budget > 0:
                if len(self.running) >= self.max_num_running_reqs:
                    break
                queue = self.skipped_waiting if self.skipped_waiting else self.waiting
                request = queue[0]
                rid = request.request_id
                if request.num_stale_output_tokens > 0 and not request.drop_stale_output:
                    queue.popleft()
                    step_skipped.appendleft(request)
                    continue
                if request.num_computed_tokens == 0:
                    if self.connector is not None:
                        self._call("get_computed_blocks_for_connector", rid)
                        blocks, local, request.shared_prefix_boundary, _diverged = \
                            mgr.get_computed_blocks_for_connector(request)
                        ext, load_async = self.connector.get_num_new_matched_tokens(request, local)
                        if ext is None:
                            queue.popleft()
                            step_skipped.appendleft(request)
                            continue
                        assert ext == 0 and not load_async
                    else:
                        self._call("get_computed_blocks", rid)
                        blocks, local, request.shared_prefix_boundary = mgr.get_computed_blocks(request)
                    computed = local
                    assert computed <= request.num_tokens
                else:
                    blocks, local, computed = mgr.empty_kv_cache_blocks, 0, request.num_computed_tokens
                num_new = request.num_tokens - computed
                if 0 < self.long_prefill_token_threshold < num_new:
                    num_new = self.long_prefill_token_threshold
                if not self.enable_chunked_prefill and num_new > token_budget:
                    break
                num_new = min(num_new, token_budget)
                assert num_new > 0
                if self.need_mamba_block_aligned_split:
                    num_new = self._mamba_block_aligned_split(request, num_new, local, 0)
                    if num_new == 0:
                        break
                self._call("allocate_slots", rid)
                new_blocks = mgr.allocate_slots(request, num_new, num_new_computed_tokens=local,
                                                new_computed_blocks=blocks,
                                                num_lookahead_tokens=self.num_lookahead_tokens,
                                                num_external_computed_tokens=0, delay_cache_blocks=False,
                                                num_encoder_tokens=0, full_sequence_must_fit=False,
                                                reserved_blocks=0, has_scheduled_reqs=bool(self.running))
                if new_blocks is None:
                    break
                if self.connector is not None:
                    self.connector.update_state_after_alloc(request, mgr.get_blocks(rid), 0)
                mgr.record_prefix_cache_stats(request, local)
                queue.popleft()
                self.running.append(request)
                if request.status == RequestStatus.WAITING:
                    scheduled_new.append(request)
                elif request.status == RequestStatus.PREEMPTED:
                    scheduled_resumed.append(request)
                else:
                    raise RuntimeError("invalid request status %s" % request.status)
                self._call("get_blocks", rid)
                req_to_new_blocks[rid] = mgr.get_blocks(rid)
                num_scheduled[rid] = num_new
                token_budget -= num_new
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = computed
            if step_skipped:
                self.skipped_waiting.extendleft(reversed(step_skipped))

        total = sum(num_scheduled.values())
        assert total <= self.max_num_scheduled_tokens and token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs
        common = [0]
        if self.running:
            common = mgr.get_num_common_prefix_blocks(self.running[0].request_id)
        new_data = [(r.request_id, req_to_new_blocks[r.request_id].get_block_ids()) for r in scheduled_new]
        cached = [(r.request_id, req_to_new_blocks[r.request_id].get_block_ids(allow_none=True), r in scheduled_resumed)
                  for r in itertools.chain(scheduled_running, scheduled_resumed)]
        if self.connector is not None:
            assert mgr.take_partial_tail_offloads() == {}
        copies, retained = mgr.take_kv_cache_block_copies()
        assert copies == [] and retained == []
        mgr.take_new_block_ids()
        out = SchedulerOutput(new_data, cached, num_scheduled, total, spec_tokens, common,
                              self.reset_preempted_req_ids, self.finished_req_ids)
        if self.connector is not None:
            self.connector.build_connector_meta(out)
        self._update_after_schedule(out)
        return out

    def _update_after_schedule(self, out):
        """Scheduler._update_after_schedule: `request.num_computed_tokens +=
        num_scheduled_token; request.num_in_flight_tokens +=
        num_scheduled_token`, is_prefill_chunk, then new finished and
        preempted sets."""
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            req.num_in_flight_tokens += n
            req.is_prefill_chunk = req.num_computed_tokens < req.num_tokens + req.num_output_placeholders
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()

    # ---- update_from_output

    def update_from_output(self, out, sampled):
        """Scheduler.update_from_output at 003df29: per scheduled request
        `request.num_in_flight_tokens -= num_tokens_scheduled` (draining a
        stale share), spec rejection (`request.num_computed_tokens -=
        num_rejected`, and placeholders), _update_request_with_output,
        on a stop `self._free_request(request)`; then
        `self.kv_cache_manager.take_events()` and, with log_stats,
        make_stats (`self.kv_cache_manager.make_prefix_cache_stats()`,
        `self.kv_cache_manager.usage`). sampled: request ID -> the tokens the
        model sampled (accepted drafts, then the bonus token)."""
        outputs = {}
        stopped_running = set()
        stopped_preempted = set()
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            stale = False
            if req is not None:
                req.num_in_flight_tokens -= n
                if req.num_stale_output_tokens > 0:
                    stale = True
                    req.num_stale_output_tokens -= n
            if req is None or req.is_finished():
                continue
            if stale and req.drop_stale_output:
                continue
            new_ids = list(sampled.get(rid, []))
            spec = out.scheduled_spec_decode_tokens.get(rid)
            if spec and new_ids:
                accepted = max(len(new_ids) - 1, 0)
                rejected = len(spec) - accepted
                if not stale:
                    if req.num_computed_tokens > 0:
                        req.num_computed_tokens -= rejected
                    if req.num_output_placeholders > 0:
                        req.num_output_placeholders -= rejected
            before = req.status
            stopped = False
            if new_ids:
                new_ids, stopped = self._update_request_with_output(req, new_ids)
            if stopped:
                self._free_request(req)
                (stopped_running if before == RequestStatus.RUNNING else stopped_preempted).add(req)
            if new_ids or stopped:
                outputs.setdefault(req.client_index, EngineCoreOutputs()).outputs.append(
                    EngineCoreOutput(rid, new_ids, req.get_finished_reason() if stopped else None))
        self.running = [r for r in self.running if r not in stopped_running]
        for r in stopped_preempted:
            for q in (self.waiting, self.skipped_waiting):
                if r in q:
                    q.remove(r)
        self.events.extend(self.kv_cache_manager.take_events() or ())
        if self.log_stats:
            self.prefix_stats.append(self.kv_cache_manager.make_prefix_cache_stats())
            _ = self.kv_cache_manager.usage
        return outputs

    def _update_request_with_output(self, request, new_token_ids):
        """Scheduler._update_request_with_output with check_stop
        (vllm/v1/core/sched/utils.py): length cap and EOS."""
        for i, tok in enumerate(new_token_ids, 1):
            request.append_output_token_ids(tok)
            if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                return new_token_ids[:i], True
            if request.eos_token_id is not None and tok == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return new_token_ids[:i], True
        return new_token_ids, False

    def update_draft_token_ids(self, drafts):
        """Scheduler.update_draft_token_ids: `request.spec_token_ids =
        spec_token_ids` for requests not in a prefill chunk."""
        for rid, ids in drafts.items():
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            req.spec_token_ids = [] if req.is_prefill_chunk else list(ids)

    def reset_prefix_cache(self, reset_running_requests=False):
        """Scheduler.reset_prefix_cache: with reset_running_requests,
        `while self.running: request = self.running.pop();
        self._preempt_request(request, timestamp, drop_stale_output=True)`;
        then `self.kv_cache_manager.reset_prefix_cache()`."""
        if reset_running_requests:
            now = time.monotonic()
            while self.running:
                self._preempt_request(self.running.pop(), now, drop_stale_output=True)
            self.prev_step_scheduled_req_ids.clear()
        ok = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not ok:
            raise RuntimeError("reset failed")
        return ok

    def has_requests(self):
        """Scheduler.has_requests: unfinished, finished not yet flushed, or
        `self.connector.has_pending_push_work()`."""
        return bool(self.waiting or self.skipped_waiting or self.running or self.finished_req_ids
                    or (self.connector is not None and self.connector.has_pending_push_work()))


class ReplayAsyncScheduler(ReplayScheduler):
    """vllm/v1/core/sched/async_scheduler.py: AsyncScheduler (014b2350):
    placeholders for the tokens a step will sample, and
    `self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens
    - request.num_output_placeholders)` after each output of a running
    request."""

    def _update_after_schedule(self, out):
        super()._update_after_schedule(out)
        for rid in out.num_scheduled_tokens:
            req = self.requests[rid]
            if req.is_prefill_chunk:
                continue
            req.num_output_placeholders += 1 + len(out.scheduled_spec_decode_tokens.get(rid, ()))
            req.spec_token_ids = [-1] * self.num_spec_tokens

    def _update_request_with_output(self, request, new_token_ids):
        before = request.status
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids)
        request.num_output_placeholders -= len(new_token_ids)
        assert request.num_output_placeholders >= 0
        if before == RequestStatus.RUNNING:
            self._call("cache_blocks", request.request_id)
            self.kv_cache_manager.cache_blocks(request,
                                               request.num_computed_tokens - request.num_output_placeholders)
        return new_token_ids, stopped


def plugin(base):
    """kvfence's scheduler plugin (scheduler.py's Scheduler and
    AsyncScheduler: SchedulerMixin before vLLM's class) over a replay."""

    class Plugin(SchedulerMixin, base):
        _RequestStatus = RequestStatus
        _EngineCoreOutput = EngineCoreOutput
        _EngineCoreOutputs = EngineCoreOutputs

        def __init__(self, manager, **kw):
            super().__init__(manager, **kw)
            self.kvf_install(manager)

    return Plugin


class Worker:
    """A worker's block tables (gpu_model_runner._update_states): new
    requests' block IDs whole, cached requests' appended group by group
    (or replaced when resumed), finished and preempted requests dropped.
    tables: request ID -> its first group's row; rows: request ID -> every
    group's rows."""

    def __init__(self):
        self.rows = {}

    @property
    def tables(self):
        return {rid: rows[0] for rid, rows in self.rows.items()}

    def apply(self, out):
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.rows.pop(rid, None)
        for rid, ids in out.scheduled_new_reqs:
            self.rows[rid] = [list(g) for g in ids]
        for rid, new_ids, resumed in out.scheduled_cached_reqs:
            if resumed:
                assert new_ids is not None
                self.rows[rid] = [list(g) for g in new_ids]
            elif new_ids is not None:
                for row, ids in zip(self.rows[rid], new_ids, strict=True):
                    row.extend(ids)


def sampled_token(request_id, position):
    """The token Engine's model samples for a request's position: a
    function of the two only, so that a step knows the tokens of the
    positions it computes before the outputs that carry them come back."""
    return 500 + (hash(request_id) % 100) + position % 97


class Engine:
    """EngineCore's loop (vllm/v1/engine/core.py: step, and
    step_with_batch_queue for asynchronous scheduling, two batches in
    flight: schedule N+1 before update_from_output(N)), with a model that
    samples deterministic tokens (sampled_token): check(out) runs after
    each step's worker update, which is when the step runs on the device.
    accept: drafts accepted per step (speculative decoding)."""

    def __init__(self, sched, check=None, accept=0, async_depth=1):
        self.sched, self.worker, self.check = sched, Worker(), check
        self.accept, self.depth = accept, async_depth
        self.inflight = deque()
        self.outputs = []
        self.steps = 0

    def _sample(self, out):
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.is_prefill_chunk:
                continue
            spec = out.scheduled_spec_decode_tokens.get(rid, [])
            k = min(self.accept, len(spec))
            first = req.num_computed_tokens - len(spec)  # the position the step samples for
            sampled[rid] = [sampled_token(rid, first + i) for i in range(k + 1)]
        return sampled

    def step(self):
        s = self.sched
        if self.depth == 1:
            out = s.schedule()
            self.worker.apply(out)
            if self.check:
                self.check(out)
            self.outputs.append(s.update_from_output(out, self._sample(out)))
            if s.num_spec_tokens:
                s.update_draft_token_ids({rid: [1] * s.num_spec_tokens for rid in out.num_scheduled_tokens})
        else:
            out = s.schedule()
            self.worker.apply(out)
            if self.check:
                self.check(out)
            # The model's sampled tokens are fixed when the step runs.
            self.inflight.append((out, self._sample(out)))
            if len(self.inflight) >= self.depth:
                done, sampled = self.inflight.popleft()
                self.outputs.append(s.update_from_output(done, sampled))
        self.steps += 1
        return out

    def drain(self):
        while self.inflight:
            done, sampled = self.inflight.popleft()
            self.outputs.append(self.sched.update_from_output(done, sampled))

    def run(self, max_steps=500):
        while self.sched.has_requests() and self.steps < max_steps:
            self.step()
        self.drain()
        return self.steps

    def finished(self):
        """request ID -> finish reason, from every output so far."""
        out = {}
        for outputs in self.outputs:
            for eco in outputs.values():
                for o in eco.outputs:
                    if o.finish_reason:
                        out[o.request_id] = o.finish_reason
        return out
