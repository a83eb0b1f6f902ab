"""A scheduler-side adapter in the vocabulary of vLLM's KV cache manager
(vllm/v1/core/kv_cache_manager.py): get_computed_blocks, allocate_slots,
free, get_block_ids, usage, make_prefix_cache_stats. It is thin: every
call is one or two kvfence calls, and kvfence decides.

What differs from vLLM's manager, on purpose:

- Admission happens in get_computed_blocks. kvfence finds the cached
  prefix and reserves every page the request can need (prompt +
  max_tokens; with "sizing": "on_demand", the prompt + a headroom) in one
  fail-closed step, so the blocks it reports cannot be evicted before
  they are used and a request never runs on a partial allocation. A
  retryable refusal (pool exhausted, tenant over quota now) reports
  no computed blocks and allocate_slots then returns None: the
  scheduler's "cannot schedule it now". A permanent one (longer than
  the context or the pool, over the tenant's whole quota, unknown
  tenant) raises its AdmissionError: the request can never run.
- Publishing to the prefix cache happens after the KV is written:
  cache_blocks(request, num_computed_tokens) commits the written
  watermark and publishes the full prompt pages below it. vLLM caches
  blocks when it allocates them; kvfence never shares a page before its
  KV exists.
- The tenant comes from tenant_of(request), which must name the tenant
  the server authenticated (an API key's, an org's), never a field the
  client chose: sharing is scoped by the tenant's domain, server-side.
- preempt(request) keeps the request's full pages in the prefix cache
  (kvfence's Lease.preempt); free() ends it, scrubbing what was not
  published, ordered after torch.cuda.current_stream().

Not covered: KV connectors (offloading, P/D through vLLM's connector API:
kvfence's own handoff is Lease.export / Receiver), encoder caches,
speculative-decoding lookahead beyond making room for it, hybrid models'
per-group hits (one per-token group), get_num_common_prefix_blocks
(cascade attention), reset_prefix_cache (returns False: kvfence drops
its cache only when the pool closes), and KV events in vLLM's objects
(take_events returns kvfence's event dicts; kvevents publishes vLLM's
wire format).
"""

from dataclasses import dataclass, field

from .errors import AdmissionError


@dataclass
class KVCacheBlocks:
    """Block IDs per KV cache group (kvfence: one per-token group)."""

    blocks: tuple

    def get_block_ids(self):
        return tuple(list(g) for g in self.blocks)


@dataclass
class Request:
    """The fields of vLLM's Request the adapter reads, for engines (and
    tests) that have no vLLM Request: any object with request_id,
    all_token_ids, num_computed_tokens, num_prompt_tokens, max_tokens and
    num_output_tokens works."""

    request_id: str
    prompt_token_ids: list
    max_tokens: int
    tenant: str = ""
    output_token_ids: list = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self):
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self):
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self):
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self):
        return len(self.output_token_ids)


class KVCacheManager:
    """vLLM's KV cache manager's calls over a kvfence Pool.

    tenant_of(request) -> tenant name (default: request.tenant);
    wait_ms: how long an admission or growth may wait for pages (0: the
    scheduler's loop retries)."""

    def __init__(self, pool, tenant_of=None, wait_ms=0):
        self.pool = pool
        self.block_size = pool.tokens_per_page
        self.tenant_of = tenant_of or (lambda r: r.tenant)
        self.wait_ms = wait_ms
        self.leases = {}  # request_id -> Lease
        self._reported = {}  # request_id -> blocks already handed to the scheduler
        self._last_hits = (0, 0)

    @property
    def usage(self):
        """Pages in use (by leases, or cached) over the pool's pages, 0..1."""
        s = self.pool.stats()
        return (s["total_pages"] - s["free_pages"]) / s["total_pages"]

    def get_computed_blocks(self, request):
        """Admits the request (see the module doc) and returns
        (KVCacheBlocks of its cached prefix, number of computed tokens).
        (empty, 0) when refused for now; raises a permanent refusal."""
        lease = self.leases.get(request.request_id)
        if lease is None:
            lease = self._admit(request)
            if lease is None:
                return KVCacheBlocks(((),)), 0
        hit = lease.hit_tokens()
        table = lease.block_table()[: hit // self.block_size]
        self._reported[request.request_id] = len(table)
        return KVCacheBlocks((table,)), hit

    def _admit(self, request):
        max_new = max(0, request.max_tokens - request.num_output_tokens)
        try:
            lease = self.pool.admit_tokens(request.request_id, self.tenant_of(request), request.all_token_ids,
                                           max_new_tokens=max_new, wait_ms=self.wait_ms)
        except AdmissionError as e:
            if e.retryable:
                return None
            raise
        self.leases[request.request_id] = lease
        return lease

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                       num_lookahead_tokens=0):
        """Makes room for num_new_tokens (+ lookahead) after the request's
        computed tokens and returns the blocks the scheduler has not seen
        yet, or None when the pool cannot give them now (admission or
        growth refused, retryable: preempt or wait)."""
        lease = self.leases.get(request.request_id)
        if lease is None:
            lease = self._admit(request)
            if lease is None:
                return None
            self._reported[request.request_id] = 0
        computed = max(request.num_computed_tokens, num_new_computed_tokens, lease.hit_tokens())
        if computed > lease.info()["written_tokens"]:
            lease.commit(computed)
        try:
            lease.grow(num_new_tokens + num_lookahead_tokens, self.wait_ms)
        except AdmissionError as e:
            if e.retryable:
                return None
            raise
        needed = -(-(computed + num_new_tokens + num_lookahead_tokens) // self.block_size)
        table = lease.block_table()
        seen = self._reported.get(request.request_id, 0)
        new = table[seen:max(seen, needed)]
        self._reported[request.request_id] = max(seen, needed)
        return KVCacheBlocks((new,))

    def cache_blocks(self, request, num_computed_tokens):
        """After the model step wrote the KV: commits it and publishes the
        full prompt pages below num_computed_tokens; returns the prompt
        tokens now shared."""
        lease = self.leases[request.request_id]
        if num_computed_tokens > lease.info()["written_tokens"]:
            lease.commit(num_computed_tokens)
        return lease.cache_prefix(min(num_computed_tokens, request.num_prompt_tokens))

    def get_block_ids(self, request_id):
        """The request's block IDs, one list per KV cache group."""
        return (self.leases[request_id].block_table(),)

    def get_blocks(self, request_id):
        return KVCacheBlocks(self.get_block_ids(request_id))

    def free(self, request, stream=None):
        """Ends the request's lease: its pages are scrubbed after the
        stream (default torch.cuda.current_stream()), published pages
        stay cached for the domain."""
        lease = self.leases.pop(request.request_id, None)
        self._reported.pop(request.request_id, None)
        if lease is not None:
            lease.release(stream)
            lease.free()

    def preempt(self, request):
        """Preempts the request, keeping the full pages of its computed
        tokens cached: its next get_computed_blocks hits them. Returns the
        tokens kept."""
        lease = self.leases.pop(request.request_id)
        self._reported.pop(request.request_id, None)
        computed = max(request.num_computed_tokens, lease.info()["written_tokens"])
        if computed > lease.info()["written_tokens"]:
            lease.commit(computed)
        kept = lease.preempt(request.all_token_ids[:computed])
        lease.free()
        return kept

    def make_prefix_cache_stats(self):
        """Prefix-cache queries and hits (tokens) since the last call, over
        every sharing domain: {"queries", "hits"}."""
        doms = self.pool.stats()["prefix"]["domains"]
        hits = sum(d["hit_tokens"] for d in doms)
        queries = sum((d["hit_pages"] + d["miss_pages"]) * self.block_size for d in doms)
        (q0, h0), self._last_hits = self._last_hits, (queries, hits)
        return {"queries": queries - q0, "hits": hits - h0}

    def reset_prefix_cache(self):
        """Not supported: kvfence drops its prefix cache when the pool closes."""
        return False

    def take_events(self):
        """kvfence's prefix-cache events (needs "prefix": {"event_buffer": N})."""
        return self.pool.events()
