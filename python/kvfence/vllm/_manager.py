"""KVCacheManager: vLLM's KV cache manager, for vLLM's Scheduler and
AsyncScheduler at VLLM_COMMIT, over a kvfence Pool. See the package doc
for the model; this module is the mechanism.

Per request the manager holds a _Held: the kvfence lease, its block table
(page IDs), how many positions of it the worker holds (reported), and the
tokens the lease was committed and published to. The worker holds one
row per vLLM KV cache group (_groups), each the lease's entries for the
first `reported` positions (a state group's: its slot, once): get_blocks
gives the rows whole (new and resumed requests, which the worker takes
whole), allocate_slots the entries from the old reported to the new
(running requests, which the worker appends): so each row always holds
exactly one entry per position (a per-token row never an ID twice; a
window's row repeats its ring every R positions), never more than the
cdiv(max_model_len, block_size) columns of the worker's block table.

Hybrid pools (window or state groups) share prefixes through state
checkpoints only (kvcache/checkpoint.go): the manager takes one
(Lease.checkpoint_state) when a step starts on a page boundary of the
prompt, before that step runs, as vLLM's "align" cache mode keeps a
state per block boundary where a prefill chunk ends (the plugin has the
scheduler end chunks there, and at Lease.prefill_checkpoint()); it never
publishes pages by Lease.cache_prefix there, whose checkpoint would copy
the state as it is, which may be that of other tokens. A window's ring
slides with the watermark, which the manager commits to the end of a
step before the worker writes it when a page leaves the window
(_advance).
"""

import array
import logging
import time

from .._core import Lease
from ..errors import (AdmissionError, CheckpointCapacity, DuplicateRequest, ExceedsCapacity, ExceedsMaxContext,
                      ExceedsQuota, InvalidRequest, KvfenceError, PoolClosed, PoolExhausted, PoolFaulted, UnknownTenant)
from . import _groups, _keys
from ._groups import PER_TOKEN, SLIDING_WINDOW
from ._types import (AllBlocksCleared, BlockPoolView, BlockRemoved, BlockStored, KVCacheBlocks, PrefixCacheStats)

logger = logging.getLogger("kvfence.vllm")

# What a refusal means to the scheduler (Refusal.kind).
BACKPRESSURE = "backpressure"  # the pool is short for everyone: vLLM's None (stop admitting, preempt)
DEFERRED = "deferred"          # this tenant's quota or reservation now: skip its request, not the others
ERROR = "error"                # never admissible as it is: finish the request with FINISHED_ERROR


class Refusal:
    """A refused admission or growth: kind (BACKPRESSURE, DEFERRED,
    ERROR), the exception and a message for the log."""

    __slots__ = ("kind", "error", "message")

    def __init__(self, kind, error, message):
        self.kind, self.error, self.message = kind, error, message

    def __repr__(self):
        return "Refusal(%s, %s)" % (self.kind, self.message)


def classify(e):
    """The Refusal of a kvfence error from an admission or a growth."""
    if isinstance(e, _keys.TenantError):
        return Refusal(ERROR, e, str(e))
    if isinstance(e, PoolExhausted):
        # The pool short for everyone is back-pressure; pages held for
        # other tenants' reservations, or for running leases' growth, are
        # this tenant's refusal: a tenant with a reservation still gets its
        # own.
        return Refusal(BACKPRESSURE if e.cause is None else DEFERRED, e, str(e))
    if isinstance(e, ExceedsQuota):
        return Refusal(DEFERRED if e.retryable else ERROR, e, str(e))
    if isinstance(e, (ExceedsCapacity, ExceedsMaxContext, InvalidRequest, UnknownTenant, DuplicateRequest)):
        return Refusal(ERROR, e, str(e))
    if isinstance(e, PoolFaulted):
        return Refusal(BACKPRESSURE, e, "kvfence pool faulted (a scrub failed); admissions wait for "
                                        "Pool.clear_fault(): %s" % e)
    if isinstance(e, PoolClosed):
        raise e
    if isinstance(e, (KvfenceError, ValueError, TypeError, OverflowError)):
        return Refusal(ERROR, e, str(e))
    raise e


class _Held:
    """One request's lease and what the scheduler and the worker were told
    of it. table: the block table; reported: the positions the worker's
    rows hold; cap: tokens the table holds; limit: the most tokens the lease
    may ever hold (prompt + max new); prompt: the tokens admitted as its
    prompt; written: the watermark committed to kvfence; published: prompt
    pages published; epoch: the manager's prefix epoch at admission.
    Hybrid pools: rings, each window group's ring pages by slot (logical
    page i in rings[g][i % R]); slots, each state group's slot;
    checkpointed: the tokens of the lease's last checkpoint (or its hit);
    stop: its PrefillCheckpoint; next_slide: the watermark at which a
    window's oldest page leaves it."""

    __slots__ = ("lease", "table", "reported", "cap", "limit", "prompt", "written", "published", "next_publish", "hit",
                 "sharing", "epoch", "tenant", "rings", "slots", "checkpointed", "stop", "next_slide")


def _cdiv(a, b):
    return -(-a // b)


class KVCacheManager:
    """vLLM's KVCacheManager over a kvfence Pool (see the package doc).

    pool: a kvfence.Pool whose tokens_per_page is vLLM's block size and
    whose max_context_tokens covers max_model_len. tenant_of: the resolver
    of the server-authenticated tenant (kvfence.vllm._keys.resolver).
    num_lookahead_tokens and num_spec_tokens: the scheduler's, for the
    room a request's steps may need beyond its tokens. salt: the
    operator's salt, in every key.

    kv_cache_groups: vLLM's KV cache groups, in KVCacheConfig's order, as
    the pool's groups (_groups.resolve: each a kvfence group's name, or
    {"group": name, "sliding_window": vLLM's window}); None for a pool of
    one per-token group, or of per-token and state groups in vLLM's order.
    max_num_scheduled_tokens (a step's token budget, or less: the
    long-prefill threshold that caps a request's share of it) and
    max_concurrent_batches (2 with asynchronous scheduling) bound what a
    request can have scheduled past its processed tokens: a sliding-window
    group's ring must hold that and the window (_groups), checked here.
    A pool with a state group takes no speculative tokens: the one state
    slot of a request cannot hold the states of draft tokens."""

    def __init__(self, pool, max_model_len, tenant_of, enable_caching=True, log_stats=False,
                 enable_kv_cache_events=False, num_lookahead_tokens=0, num_spec_tokens=0, salt=None,
                 hash_block_size=None, kv_cache_groups=None, max_num_scheduled_tokens=None,
                 max_concurrent_batches=1):
        self.pool = pool
        self.block_size = bs = pool.tokens_per_page
        self.max_model_len = max_model_len
        self.max_blocks_per_request = _cdiv(max_model_len, bs)
        self.resolve_tenant = tenant_of
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.enable_kv_cache_events = enable_kv_cache_events
        self.num_lookahead_tokens = num_lookahead_tokens
        # Positions a request's steps can write beyond its prompt and
        # max_tokens: spec tokens and the drafter's lookahead. vLLM
        # allocates min(computed + new + lookahead, max_model_len) slots:
        # at most prompt + max_tokens - 1 + spec + lookahead for the last
        # step of a synchronous scheduler; the asynchronous one schedules
        # while a step's 1 + spec placeholders are in flight (its guard:
        # computed + 2 - placeholders < prompt + max_tokens), which adds
        # spec more.
        self.slack = 2 * num_spec_tokens + num_lookahead_tokens
        self.salt = salt
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.groups = _groups.resolve(pool, kv_cache_groups)
        self.num_kv_cache_groups = len(self.groups)
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in self.groups))
        self._one = len(self.groups) == 1  # one per-token group: rows are block-table slices
        # A pool with window or state groups shares through checkpoints.
        self.hybrid = len({g.group for g in self.groups}) > 1
        self.windows = list({g.group: g for g in self.groups if g.kind == SLIDING_WINDOW}.values())
        self.states = sorted({g.group for g in self.groups if g.kind == _groups.STATE})
        if self.states and (num_spec_tokens or num_lookahead_tokens):
            raise ValueError("kvfence.vllm: speculative decoding (%d spec tokens, %d lookahead) with a state group: a "
                             "request's one state slot cannot hold its draft tokens' states"
                             % (num_spec_tokens, num_lookahead_tokens))
        # The most tokens a request may have scheduled past its processed
        # ones that every window's ring holds beside the window.
        self.max_reach = min((g.max_reach() for g in self.windows), default=1 << 62)
        step = min(max_num_scheduled_tokens or max_model_len, max_model_len)
        reach = max(1, max_concurrent_batches) * step + num_lookahead_tokens
        if reach > self.max_reach:
            w = min(self.windows, key=lambda g: g.max_reach())
            raise ValueError("kvfence.vllm: sliding-window group %r's ring of %d tokens holds vLLM's window of %d and "
                             "%d tokens a request has scheduled past its processed ones; %d batches of up to %d tokens "
                             "and %d lookahead slots need %d: give the group window_tokens >= %d, or lower "
                             "max_num_scheduled_tokens (the long-prefill threshold)"
                             % (w.group, w.ring_tokens, w.sliding_window, w.max_reach(), max(1, max_concurrent_batches),
                                step, num_lookahead_tokens, reach, w.sliding_window - 1 + reach))
        self.block_pool = BlockPoolView(hash_block_size or bs, pool.num_pages, self._usage)
        cfg = pool.config
        sizing = (cfg.get("sizing") or {}).get("mode", "full")
        self.grows = sizing == "on_demand" or any((t.get("sizing") or {}).get("mode") == "on_demand"
                                                  for t in cfg.get("tenants", ()))
        self._held = {}      # request ID -> _Held
        self._refused = {}   # request ID -> Refusal, this step
        self._errors = {}    # request ID -> (request, Refusal): to finish with FINISHED_ERROR
        self._epoch = 0      # bumped by reset_prefix_cache: older leases publish nothing
        self._usage_cache, self._usage_at = None, 0.0

    # ---- what the scheduler reads

    @property
    def usage(self):
        """The share of pages held by requests or being scrubbed, 0..1
        (vLLM: blocks not free; cached pages no request holds count as
        free, as vLLM's evictable blocks do), from the pool's stats at most
        USAGE_TTL old: vLLM reads it every step for its metrics, and the
        stats cost tens of microseconds."""
        return self._usage()

    USAGE_TTL = 0.1  # seconds

    def _usage(self):
        now = time.monotonic()
        if self._usage_cache is None or now - self._usage_at > self.USAGE_TTL:
            s = self.pool.stats()
            self._usage_cache = (s["total_pages"] - s["free_pages"] - s["cached_pages"]) / s["total_pages"]
            self._usage_at = now
        return self._usage_cache

    def new_step_starts(self):
        """Called by schedule() first (scheduler.py: schedule); the
        refusals of the last step are forgotten: they are tried again."""
        self._refused.clear()

    def prefix_cache_lookup_enabled(self, request):
        return self.enable_caching and not request.skip_reading_prefix_cache

    # ---- admission

    def get_computed_blocks(self, request):
        """Admits the request (its lease holds every page of its prompt and
        the room of its first step, fail-closed) and returns (the blocks of
        its cached prefix, their tokens, 0). A refused request gets
        (empty, 0, 0) and a Refusal for this step (refusal_of). Called again
        for a request it has admitted, it returns the same."""
        held = self._held.get(request.request_id)
        if held is None:
            if request.request_id in self._refused:
                return self.empty_kv_cache_blocks, 0, 0
            held = self._admit(request)
            if held is None:
                return self.empty_kv_cache_blocks, 0, 0
        if not held.hit:
            return self.empty_kv_cache_blocks, 0, 0
        return self._blocks(held, 0, held.hit // self.block_size), held.hit, 0

    def get_computed_blocks_for_connector(self, request):
        """get_computed_blocks for the scheduler with a KV connector:
        kvfence's hits never diverge between groups (a hybrid hit ends at
        a checkpoint, where every group's state is)."""
        blocks, hit, boundary = self.get_computed_blocks(request)
        return blocks, hit, boundary, False

    def truncate_computed_blocks(self, blocks, num_computed_tokens):
        n = num_computed_tokens // self.block_size
        if not n:
            return self.empty_kv_cache_blocks
        if self._one:
            return KVCacheBlocks((list(blocks.blocks[0][:n]),))
        return KVCacheBlocks(tuple(list(b) if g.kind == _groups.STATE else list(b[:n])
                                   for g, b in zip(self.groups, blocks.blocks)))

    def refusal_of(self, request_id):
        """This step's Refusal of the request's admission, or None."""
        return self._refused.get(request_id)

    def take_errors(self):
        """The requests refused for good since the last call, as
        (request, Refusal): the scheduler finishes them with an error."""
        errors, self._errors = self._errors, {}
        return list(errors.values())

    def _refuse(self, request, refusal):
        self._refused[request.request_id] = refusal
        if refusal.kind == ERROR:
            self._errors[request.request_id] = (request, refusal)
            logger.warning("kvfence: request %s refused for good: %s", request.request_id, refusal.message)
        elif refusal.kind == BACKPRESSURE and isinstance(refusal.error, PoolFaulted):
            logger.error("%s", refusal.message)
        return None

    def _admit(self, request):
        """Admits request; its _Held, or None after recording a Refusal."""
        try:
            tenant = _keys.tenant_of(self.resolve_tenant, request)
        except _keys.TenantError as e:
            return self._refuse(request, classify(e))
        bs = self.block_size
        tokens = request._all_token_ids if hasattr(request, "_all_token_ids") else list(request.all_token_ids)
        n = len(tokens)
        limit = min(self.max_model_len, request.num_prompt_tokens + request.max_tokens + self.slack)
        max_new = max(0, limit - n)
        sharing = (self.enable_caching and not request.skip_reading_prefix_cache
                   and getattr(request, "prompt_embeds", None) is None)
        table = array.array("i", bytes(4 * max(1, _cdiv(n + max_new, bs))))
        try:
            if sharing:
                lease = self.pool.admit_tokens(request.request_id, tenant, tokens, max_new_tokens=max_new,
                                               adapter=_keys.adapter_of(request, self.salt), block_table=table,
                                               page_extra=_keys.page_extra_of(request, bs, n))
                pages = lease.table_len
            else:
                lease = self.pool.admit(request.request_id, tenant, n, max_new)
                pages = lease.write_block_table(table)
        except (KvfenceError, ValueError, TypeError, OverflowError) as e:
            return self._refuse(request, classify(e))
        held = _Held()
        held.lease, held.tenant, held.sharing, held.epoch = lease, tenant, sharing, self._epoch
        held.table = table[:pages].tolist()
        held.reported, held.cap, held.limit, held.prompt = 0, pages * bs, n + max_new, n
        held.hit = held.published = lease.hit_tokens() if sharing else 0
        # kvfence's watermark: a hit is shared, not written by this lease;
        # a hybrid hit's restored state puts the watermark there.
        held.written = held.hit if self.hybrid else 0
        if self.hybrid:
            self._hold_groups(held)
        self._next_publish(held)
        self._held[request.request_id] = held
        # The room of the first step: the prompt, and the lookahead slots
        # the scheduler allocates with it (an on-demand lease's headroom
        # may be smaller).
        refusal = self._ensure_room(held, min(n + self.num_lookahead_tokens, self.max_model_len))
        if refusal is not None:
            self._drop(request.request_id)
            return self._refuse(request, refusal)
        return held

    def _hold_groups(self, held):
        """Reads a hybrid lease's rings and slots, which never change while
        it lives, and where it checkpoints."""
        lease = held.lease
        held.rings = {}
        for g in self.windows:
            first, ring = lease.group_table(g.group)
            r = len(ring)
            # group_table lists the ring from its oldest page in the window
            # (logical page first) on; by slot, logical page i is slot i % r.
            held.rings[g.group] = [ring[(k - first) % r] for k in range(r)]
        held.slots = {name: lease.group_table(name)[1][0] for name in self.states}
        held.checkpointed = held.hit
        held.stop = lease.prefill_checkpoint() if held.sharing else 0
        held.next_slide = self._next_slide(held.written)

    def _next_slide(self, written):
        """The watermark past written at which a window's oldest page
        leaves it (Lease.slide_windows has pages to scrub)."""
        bs = self.block_size
        return min(((max(0, written - g.ring_tokens) // bs + 1) * bs + g.ring_tokens for g in self.windows),
                   default=1 << 62)

    def _blocks(self, held, a, b, state=None):
        """The worker's entries for the positions [a, b) of held, per vLLM
        group: a per-token group's block table, a sliding-window group's
        ring page of each logical page, a state group's slot if state (by
        default: when the range starts at 0 and is not empty). Fresh
        lists: the worker may extend what it receives."""
        if self._one:
            return KVCacheBlocks((held.table[a:b],))
        if state is None:
            state = a == 0 < b
        out = []
        for g in self.groups:
            if g.kind == PER_TOKEN:
                out.append(held.table[a:b])
            elif g.kind == SLIDING_WINDOW:
                ring = held.rings[g.group]
                r = len(ring)
                out.append([ring[i % r] for i in range(a, b)])
            else:
                out.append([held.slots[g.group]] if state else [])
        return KVCacheBlocks(tuple(out))

    def _ensure_room(self, held, tokens):
        """Grows held's lease to hold tokens (at most its limit); None, or
        the growth's Refusal."""
        tokens = min(tokens, held.limit)
        if tokens <= held.cap:
            return None
        try:
            held.lease.grow(tokens - held.written)
        except (KvfenceError, ValueError) as e:
            return classify(e)
        held.table = held.lease.block_table()
        held.cap = len(held.table) * self.block_size
        return None

    def ensure_room(self, request, tokens):
        """Grows the running request's lease to hold tokens (capped by its
        max tokens): None, or the Refusal (the scheduler plugin calls it
        before vLLM's running loop, so that a tenant's refusal preempts
        only that tenant's requests). A request without a lease: None."""
        held = self._held.get(request.request_id)
        return None if held is None else self._ensure_room(held, tokens)

    def tenant_of(self, request_id):
        held = self._held.get(request_id)
        return None if held is None else held.tenant

    # ---- allocation (scheduler.py: schedule, running and waiting loops)

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                       num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False,
                       num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0,
                       has_scheduled_reqs=True):
        """Makes room for num_new_tokens (+ lookahead) after the request's
        computed tokens and returns the blocks the worker has not been
        given yet (vLLM's new blocks), or None when the pool cannot give
        them now (vLLM then preempts, or stops admitting). The whole
        prompt is in the lease from admission, so full_sequence_must_fit
        holds; external KV (num_external_computed_tokens), cross-attention
        (num_encoder_tokens) and reserved_blocks belong to features this
        manager does not support (the package doc)."""
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no external computed tokens")
        if num_external_computed_tokens or num_encoder_tokens:
            raise ValueError("kvfence.vllm: external KV (%d tokens) and encoder caches (%d tokens) are not supported"
                             % (num_external_computed_tokens, num_encoder_tokens))
        held = self._held.get(request.request_id)
        if held is None:
            if request.request_id in self._refused:
                return None
            if request.num_computed_tokens:
                raise RuntimeError("kvfence.vllm: request %s has %d computed tokens and no lease: its KV is in pages "
                                   "kvfence no longer holds for it" % (request.request_id, request.num_computed_tokens))
            held = self._admit(request)
            if held is None:
                return None
        computed = request.num_computed_tokens + num_new_computed_tokens
        need = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        if need > held.limit:
            # More than the lease may ever hold: the worker would write
            # past its pages. Never by vLLM's arithmetic; an error, not a
            # table that does not cover the step.
            refusal = Refusal(ERROR, None, "request %s asks for %d token slots, its lease holds at most %d"
                              % (request.request_id, need, held.limit))
            self._errors[request.request_id] = (request, refusal)
            logger.error("kvfence: %s", refusal.message)
            return None
        if need > held.cap:
            refusal = self._ensure_room(held, need)
            if refusal is not None:
                if refusal.kind == ERROR:
                    self._errors[request.request_id] = (request, refusal)
                if refusal.kind != BACKPRESSURE:
                    logger.warning("kvfence: growth of running request %s refused inside the scheduler's loop (%s); "
                                   "vLLM will preempt", request.request_id, refusal.message)
                return None
        processed = request.num_computed_tokens - request.num_in_flight_tokens
        if self.hybrid:
            # The first token of the steps in flight (a new request's: its
            # hit): from its window on, the rings must keep every page.
            refusal = self._advance(held, request.request_id, computed, need,
                                    computed - request.num_in_flight_tokens)
            if refusal is not None:
                self._errors[request.request_id] = (request, refusal)
                logger.error("kvfence: %s", refusal.message)
                return None
        elif processed >= held.next_publish:
            # The KV below the processed tokens exists: publish its full
            # prompt pages (the synchronous scheduler never calls
            # cache_blocks).
            self._publish(held, processed)
        blocks = min(-(-need // self.block_size), len(held.table))
        old = held.reported
        if blocks <= old:
            return self.empty_kv_cache_blocks
        held.reported = blocks
        return self._blocks(held, old, blocks)

    def _advance(self, held, rid, start, need, settled):
        """A hybrid lease before a step that runs from start and writes up
        to need: a checkpoint at start if the step starts on a page
        boundary of the prompt (every step scheduled before it writes the
        tokens below start, and this one has not run: the state then
        reflects exactly start tokens once the work before it is done, on
        which the copy waits), then the watermark committed to need and
        the windows slid there, so that each ring holds the pages this
        step writes (when a page leaves a window). None, or the Refusal of
        a step no ring can hold."""
        if need - settled > self.max_reach:
            return Refusal(ERROR, None, "request %s would have %d tokens scheduled past its %d processed ones; the "
                                        "sliding windows' rings hold %d beside the window (kv_cache_groups)"
                           % (rid, need - settled, settled, self.max_reach))
        lease = held.lease
        bs = self.block_size
        if start > held.checkpointed and start % bs == 0 and start <= held.prompt and held.sharing \
                and held.epoch == self._epoch:
            held.checkpointed = start  # tried once: a refusal is counted by kvfence
            try:
                if start > held.written:
                    lease.commit(start)
                    held.written = start
                self._checkpoint(held, start)
            except CheckpointCapacity:
                pass  # counted, and logged once per tenant, by kvfence
            except KvfenceError as e:
                logger.warning("kvfence: request %s: no state checkpoint at %d tokens: %s", rid,
                               start, e)
        if need >= held.next_slide:
            # A window's oldest page leaves it: the watermark goes to the
            # step's end, and the ring slides there before the step writes
            # it. Until the next page leaves, the watermark may lag what
            # the worker writes: the pages those writes land in are the
            # ring's past the window, which no slide scrubs before then.
            lease.commit(need)
            held.written = need
            lease.slide_windows()
            held.next_slide = self._next_slide(need)
        return None

    def _checkpoint(self, held, tokens):
        """The lease's checkpoint at tokens, the copy ordered after all
        work of the pool's CUDA context (stream 0, event 0): every step
        scheduled before, which may be in flight."""
        held.lease.checkpoint_state(tokens, stream=0, event=0)

    def checkpoint_stop(self, request, start, end):
        """Where a prefill chunk of request from start to end should end
        instead: at its lease's PrefillCheckpoint when that lies inside
        (the deepest a later identical prompt can hit), else end. The
        scheduler plugin asks it beside vLLM's block-aligned split."""
        held = self._held.get(request.request_id)
        if held is None or not self.hybrid or not held.sharing or not start < held.stop < end:
            return end
        return held.stop

    def get_blocks(self, request_id):
        """The blocks the worker holds for the request (after this step's
        allocate_slots): each group's entries for the lease's first
        reported positions."""
        held = self._held.get(request_id)
        if held is None or not held.reported:
            return self.empty_kv_cache_blocks
        return self._blocks(held, 0, held.reported)

    def get_block_ids(self, request_id):
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(self, request_id, num_computed_tokens):
        """vLLM's: each attention group's entries of the computed tokens,
        a state group's whole."""
        held = self._held.get(request_id)
        if held is None:
            return tuple([] for _ in self.groups)
        n = min(held.reported, _cdiv(num_computed_tokens, self.block_size))
        return self._blocks(held, 0, n, state=held.reported > 0).get_block_ids()

    def get_num_common_prefix_blocks(self, running_request_id):
        """0 in every group: cascade attention gets no common prefix from
        kvfence (a correct answer, which disables it)."""
        return [0] * len(self.groups)

    def estimate_cached_tokens(self, request):
        held = self._held.get(request.request_id)
        return held.hit if held is not None else 0

    # ---- publishing (kvfence shares a page only once its KV exists)

    def cache_blocks(self, request, num_computed_tokens):
        """vLLM's AsyncScheduler calls this after a step's output with its
        computed tokens less placeholders; kvfence publishes only what the
        processed steps wrote, num_computed_tokens - num_in_flight_tokens
        at most."""
        held = self._held.get(request.request_id)
        if held is not None:
            self._publish(held, min(num_computed_tokens, request.num_computed_tokens - request.num_in_flight_tokens))

    def _publish(self, held, processed):
        if not held.sharing or held.epoch != self._epoch or self.hybrid:
            return  # a hybrid pool publishes through checkpoints (_advance)
        pages = min(processed, held.prompt) // self.block_size
        if pages <= held.published // self.block_size:
            return
        lease = held.lease
        if processed > held.written:
            lease.commit(processed)
            held.written = processed
        held.published = lease.cache_prefix(pages * self.block_size)
        self._next_publish(held)

    def _next_publish(self, held):
        """The processed tokens at which held has a page more to publish:
        the end of its next full prompt page (never, past the prompt's)."""
        bs = self.block_size
        nxt = (held.published // bs + 1) * bs
        held.next_publish = nxt if held.sharing and not self.hybrid and nxt <= held.prompt else 1 << 62

    # ---- the end of a lease

    def free(self, request):
        """Ends the request's lease. A finished request's pages are
        scrubbed, its published ones staying cached; a preempted one's
        (the scheduler frees a request it preempts while it still runs)
        are given back keeping the full pages of its processed tokens in
        the prefix cache, so that its resumption shares them. In a hybrid
        pool the preemption also checkpoints there (Lease.preempt), which
        needs the state to reflect exactly the processed tokens: no step
        in flight, none scheduled past them (else it keeps only the
        checkpoints taken so far)."""
        held = self._held.pop(request.request_id, None)
        if held is None:
            return
        processed = request.num_computed_tokens - request.num_in_flight_tokens
        lease = held.lease
        try:
            if request.is_finished() or not held.sharing or held.epoch != self._epoch or processed <= 0:
                self._publish(held, processed)
            elif self.hybrid and (request.num_in_flight_tokens or held.written > processed):
                pass
            else:
                written = max(processed, held.written)
                if written > held.written:
                    lease.commit(written)
                lease.preempt(request.all_token_ids[:written])
        except KvfenceError as e:
            # Publishing is an optimisation; the lease still ends (below),
            # its pages scrubbed. Nothing may raise out of the scheduler.
            logger.warning("kvfence: request %s: keeping its pages failed, they are scrubbed: %s",
                           request.request_id, e)
        finally:
            lease.free()

    def pop_blocks_for_free(self, request):
        """vLLM defers the free of a KV consumer's blocks while a step may
        still write them; kvfence's rank workers order the scrub after those
        steps themselves (the worker connector's step lag), so the lease
        ends now and no blocks are left to free later."""
        self.free(request)
        return []

    def _drop(self, request_id):
        held = self._held.pop(request_id, None)
        if held is not None:
            held.lease.free()

    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
        """Nothing to remove: one full-attention group keeps every block."""

    def evict_blocks(self, block_ids):
        """vLLM evicts blocks whose external KV failed to load; kvfence
        loads no external KV."""

    def reset_prefix_cache(self):
        """Drops the prefix cache through kvfence (cached pages scrubbed;
        pages live leases share scrubbed when their last lease ends) and
        stops the leases admitted before from publishing: KV computed with
        the old weights is never shared again. Always True: kvfence needs
        no request preempted first."""
        self.pool.clear_prefix_cache()
        self._epoch += 1
        for held in self._held.values():
            held.next_publish = 1 << 62  # admitted before: never publishes
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    # ---- stats and events

    def make_prefix_cache_stats(self):
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def record_prefix_cache_stats(self, request, num_hits):
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def take_events(self):
        """The pool's prefix-cache events as vLLM's BlockStored,
        BlockRemoved and AllBlocksCleared (needs the pool's
        "prefix": {"event_buffer": N}): keys are kvfence's, whose chain is
        rooted in the tenant's sharing domain, and token_ids is empty, as
        kvfence's kvevents publisher sends them."""
        if not self.enable_kv_cache_events:
            return []
        out = []
        for ev in self.pool.events():
            kind = ev["kind"]
            hashes = [bytes.fromhex(k) for k in ev["keys"]]
            if kind == "stored":
                parent = ev.get("parent")
                out.append(BlockStored(block_hashes=hashes, parent_block_hash=bytes.fromhex(parent) if parent else None,
                                       token_ids=[], block_size=self.block_size, lora_id=None, medium="GPU",
                                       lora_name=None))
            elif kind == "removed":
                out.append(BlockRemoved(block_hashes=hashes, medium="GPU"))
            elif kind == "cleared":
                out.append(AllBlocksCleared())
        return out

    # ---- what vLLM's manager has for features this one does not serve

    def take_new_block_ids(self):
        """vLLM zeroes new blocks for hybrid models only; kvfence hands
        out only scrubbed pages."""
        return []

    def get_zeroing_block_ids_in_range(self, request_id, start_token, end_token):
        return []

    def record_blocks_for_zeroing(self, request_id, start_token):
        pass

    def take_kv_cache_block_copies(self):
        return [], []

    def take_partial_tail_offloads(self):
        return {}

    # ---- for tests and operators

    def lease_of(self, request_id):
        """The request's kvfence Lease (None if it holds none)."""
        held = self._held.get(request_id)
        return None if held is None else held.lease

    def reported_blocks(self, request_id):
        held = self._held.get(request_id)
        return [] if held is None else held.table[:held.reported]

    def held_requests(self):
        return list(self._held)


__all__ = ["KVCacheManager", "Refusal", "classify", "BACKPRESSURE", "DEFERRED", "ERROR", "Lease", "AdmissionError"]
