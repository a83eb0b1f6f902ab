"""vLLM's KV cache groups as a kvfence pool holds them.

vLLM gives a hybrid model several KV cache groups (KVCacheConfig.
kv_cache_groups at VLLM_COMMIT): full-attention layers, sliding-window
layers, Mamba and other linear-attention layers, each group its own row
of block IDs on the worker (KVCacheBlocks.blocks and get_block_ids are a
tuple of one list per group). A kvfence pool with a cache spec has cache
groups of three kinds (kvcache/cachespec.go), and each vLLM group is one
of them:

  vLLM group            kvfence group    the worker's row
  full attention        per_token        position i: the page of tokens
                                         [i*B, (i+1)*B), the block table
  sliding window        sliding_window   position i: the ring page of
                                         logical page i (ring[i mod R])
  Mamba, linear attn.   state            one entry: the lease's state slot
                                         (vLLM's "none" cache mode: one
                                         block of max_model_len tokens)

Several vLLM groups may be one kvfence group (vLLM splits a model's
layers into groups of equal size: qwen3-next's 36 Gated DeltaNet layers
are three Mamba groups of 12); they report the same IDs, which name each
group's own layers in kvfence's regions. Block IDs are the kvfence group's
own (page IDs of one group are not another's): kvfence allocates each
group its memory, where vLLM's one block pool numbers blocks across
groups whose layers share tensors.

The window's ring. kvfence holds a sliding-window group as a ring of
ceil(window_tokens / B) + 1 pages per lease, logical page i in ring slot
i mod R, that slides with the lease's written watermark (Lease.
slide_windows scrubs the pages whose tokens all lie window_tokens or more
before it). vLLM's worker writes a whole step's KV before it attends, and
each query of the step reads itself and the sliding_window - 1 tokens
before it, so the ring must hold every position from the oldest token a
step in flight still reads to the last slot the newest step writes:
window_tokens >= sliding_window - 1 + reach, where reach is the most
tokens a request has scheduled past its processed ones (the steps in
flight, this step, its lookahead). KVCacheManager checks that bound when
it starts and before every step.
"""

PER_TOKEN = "per_token"
SLIDING_WINDOW = "sliding_window"
STATE = "state"
KINDS = (PER_TOKEN, SLIDING_WINDOW, STATE)


class KVCacheGroup:
    """One of vLLM's KV cache groups as kvfence holds it.

    group: the kvfence cache group whose pages (slots) its block IDs are;
    kind: that group's kind; block_size: tokens per block of a per-token or
    sliding-window group (0 for a state group); sliding_window: vLLM's
    window of a sliding-window group, in tokens (a query attends to itself
    and the sliding_window - 1 tokens before it), else 0; ring_tokens: the
    kvfence group's window_tokens, which sizes its ring (0 unless a window)."""

    __slots__ = ("group", "kind", "block_size", "sliding_window", "ring_tokens")

    def __init__(self, group, kind, block_size=0, sliding_window=0, ring_tokens=0):
        self.group, self.kind, self.block_size = group, kind, block_size
        self.sliding_window, self.ring_tokens = sliding_window, ring_tokens

    def __repr__(self):
        extra = ", sliding_window=%d, ring_tokens=%d" % (self.sliding_window, self.ring_tokens) \
            if self.kind == SLIDING_WINDOW else ""
        return "KVCacheGroup(%r, %s, block_size=%d%s)" % (self.group, self.kind, self.block_size, extra)

    def max_reach(self):
        """The most tokens a request may have scheduled past its processed
        ones for this group's ring to hold every position a step reads
        and writes (unbounded for other groups)."""
        if self.kind != SLIDING_WINDOW:
            return 1 << 62
        return self.ring_tokens - self.sliding_window + 1


def _bad(msg, *args):
    return ValueError("kvfence.vllm: " + (msg % args if args else msg))


def resolve(pool, kv_cache_groups):
    """The KVCacheGroups of kv_cache_groups for pool: one entry per vLLM
    KV cache group, in KVCacheConfig.kv_cache_groups' order, each the name
    of a kvfence group or a dict {"group": name, "sliding_window": tokens}
    (sliding_window: vLLM's window, for a sliding-window group only).
    None: the pool's groups in order, for a pool without a sliding-window
    group. Kinds come from the pool's stats; the page size and
    window_tokens of a sliding-window group from the pool's cache spec
    (its config's "cache"). Every kvfence group must be some vLLM group's:
    the worker would have no row for memory the lease holds."""
    stats_groups = pool.stats().get("groups") or [{"name": "kv", "kind": PER_TOKEN}]
    kinds = {g["name"]: g["kind"] for g in stats_groups}
    names = [g["name"] for g in stats_groups]
    tpp = pool.tokens_per_page
    spec = {g.get("name"): g for g in ((pool.config.get("cache") or {}).get("groups") or ())}
    if kv_cache_groups is None:
        if any(k == SLIDING_WINDOW for k in kinds.values()):
            raise _bad("the pool has a sliding-window group: give kv_cache_groups, one entry per vLLM KV cache group, "
                       "with vLLM's sliding_window for each window group")
        kv_cache_groups = names
    if isinstance(kv_cache_groups, (str, bytes)) or not kv_cache_groups:
        raise _bad("kv_cache_groups %r: want a list with one entry per vLLM KV cache group", kv_cache_groups)
    out = []
    for i, entry in enumerate(kv_cache_groups):
        if isinstance(entry, str):
            entry = {"group": entry}
        if not isinstance(entry, dict):
            raise _bad("kv_cache_groups[%d] is %r: want a kvfence group's name or {\"group\": name, ...}", i, entry)
        unknown = sorted(set(entry) - {"group", "sliding_window"})
        if unknown:
            raise _bad("kv_cache_groups[%d] has unknown keys %s", i, ", ".join(unknown))
        name = entry.get("group")
        if name not in kinds:
            raise _bad("kv_cache_groups[%d] names group %r; the pool's groups are %s", i, name, ", ".join(names))
        kind = kinds[name]
        window = entry.get("sliding_window", 0)
        if kind == SLIDING_WINDOW:
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise _bad("kv_cache_groups[%d] (%r) is a sliding-window group: give vLLM's sliding_window, a positive "
                           "number of tokens, not %r", i, name, window)
            g = spec.get(name)
            if g is None:
                raise _bad("group %r's page size and window_tokens are not in the pool's config: make the pool with "
                           "its cache spec (\"cache\")", name)
            if g.get("tokens_per_page") != tpp:
                raise _bad("sliding-window group %r has pages of %s tokens, the per-token group's have %d: vLLM's hits "
                           "must end on a block of every group, and kvfence's checkpoints end on a page", name,
                           g.get("tokens_per_page"), tpp)
            for other in out:
                if other.group == name and other.sliding_window != window:
                    raise _bad("vLLM groups of window %d and %d are one kvfence group %r, which has one window",
                               other.sliding_window, window, name)
            out.append(KVCacheGroup(name, kind, tpp, window, int(g["window_tokens"])))
        else:
            if window:
                raise _bad("kv_cache_groups[%d] (%r) is a %s group: sliding_window is for sliding-window groups", i,
                           name, kind)
            out.append(KVCacheGroup(name, kind, tpp if kind == PER_TOKEN else 0))
    missing = [n for n in names if n not in {g.group for g in out}]
    if missing:
        raise _bad("kvfence group(s) %s are no vLLM KV cache group's: the worker would have no row for what the "
                   "lease holds there", ", ".join(missing))
    return out
