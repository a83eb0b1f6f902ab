"""kvfence.vllm over hybrid pools (per-token, sliding-window and state
groups), driven by vLLM's own call sequence for a hybrid model:
vllm_replay's Scheduler and AsyncScheduler at 003df29 with the
block-aligned split of prefill chunks of vLLM's "align" Mamba cache mode,
which the scheduler plugin turns on for a hybrid pool, and the plugin
around them as --scheduler-cls runs it.

A worker runs the model's memory traffic on the pool's host memory, step
by step, as vLLM's model runner would with the rows the scheduler gave it
(each KV cache group its own row of block IDs):

- it writes each scheduled token's KV, a stamp of the tenant, the token
  and its position, into the page the full-attention row and the
  sliding-window row name for its position; then, as vLLM's attention
  does after the writes, it reads every position a full-attention query
  of the step reads (all before it) and every position a sliding-window
  query reads (its window of W), checking each stamp;
- a state group's slot must hold the digest of the tenant's tokens before
  the step (scrubbed, all zero, for a step from 0), and gets the digest
  through the step.

So a hit proves its pages, the restored window and the restored state
are exactly the checkpoint's, of the request's own tenant; a ring too
small for a step, a slide too early or a checkpoint of the wrong state
fails a read. After every step, before the worker runs, each group's rows
are checked against the leases: the full-attention row a prefix of the
block table, the window row the lease's ring page of each position, the
state row the lease's slot, every ID the lease's own and no page in two
tenants' rows; after it, the pool's Check."""

import hashlib
import struct

import kvfence
import pytest
from kvfence.vllm import KVCacheManager, resolver

from vllm_replay import Engine, ReplayAsyncScheduler, ReplayScheduler, Request, RequestStatus, plugin, sampled_token

BS = 4          # tokens per page in every group
W = 8           # vLLM's sliding window
STAMP = 8       # bytes of one token's KV stamp
SLOT = 64       # bytes of a state slot
MAX_LEN = 256


def cache_spec(ring=24, window=True, state=True):
    groups = [{"name": "kv", "kind": "per_token", "tokens_per_page": BS,
               "regions": [{"name": "attn.kv", "dtype": "fp32", "page_bytes": BS * STAMP}]}]
    if window:
        groups.append({"name": "swa", "kind": "sliding_window", "tokens_per_page": BS, "window_tokens": ring,
                       "regions": [{"name": "swa.kv", "dtype": "fp32", "page_bytes": BS * STAMP}]})
    if state:
        groups.append({"name": "gdn", "kind": "state", "regions": [{"name": "gdn.state", "dtype": "fp32",
                                                                    "page_bytes": SLOT}]})
    return {"model": "vllm-hybrid-miniature", "groups": groups}


# vLLM's KV cache groups of each model, as kv_cache_groups entries.
MODELS = {
    # qwen3-next-like: full attention and Gated DeltaNet, whose layers
    # vLLM splits into two Mamba groups of one state slot.
    "gdn": (dict(window=False), ["kv", "gdn", "gdn"]),
    # gpt-oss-like: full attention and sliding-window attention.
    "swa": (dict(state=False), ["kv", {"group": "swa", "sliding_window": W}]),
    # all three, the window listed before the state.
    "mixed": (dict(), [{"group": "swa", "sliding_window": W}, "kv", "gdn"]),
}


def make(model="mixed", pages=96, tenants=("a", "b"), base=ReplayScheduler, budget=16, ring=None, max_leases=8,
         sizing=None, threshold=0, declared_budget=None, checkpoint_slots=16, **kw):
    batches = 2 if base is ReplayAsyncScheduler else 1
    spec_kw, groups = MODELS[model]
    if ring is None:
        ring = W - 1 + batches * budget + 1  # the bound, rounded up to a page
    cfg = {"cache": cache_spec(ring=ring, **spec_kw), "max_leases": max_leases, "pages": pages,
           "max_context_tokens": MAX_LEN, "allow_undersized_pool": True,
           "prefix": {"checkpoint_slots": checkpoint_slots},
           "tenants": [t if isinstance(t, dict) else {"name": t} for t in tenants]}
    if sizing:
        cfg["sizing"] = sizing
    pool = kvfence.Pool(cfg)
    mgr = KVCacheManager(pool, MAX_LEN, resolver("trace_header:x-tenant"), log_stats=True, kv_cache_groups=groups,
                         max_num_scheduled_tokens=declared_budget or budget, max_concurrent_batches=batches)
    sched = plugin(base)(mgr, max_model_len=MAX_LEN, max_num_batched_tokens=budget,
                         long_prefill_token_threshold=threshold, **kw)
    assert sched.need_mamba_block_aligned_split, "the plugin ends chunks where states are kept"
    return pool, mgr, sched


def prompt(n, seed=0):
    return [(7 * i + 13 * seed + 1) % 997 for i in range(n)]


def token_at(req, t):
    return req.prompt_token_ids[t] if t < req.num_prompt_tokens else sampled_token(req.request_id, t)


def stamp(tenant, token, pos):
    return struct.pack("<II", (token * 131 + ord(tenant[0]) * 7919 + 1) & 0xFFFFFFFF, pos + 1)


def digest(tenant, tokens):
    d = hashlib.sha256(tenant.encode() + b"|" + struct.pack("<%di" % len(tokens), *tokens)).digest()
    return (d + struct.pack("<Q", len(tokens))).ljust(SLOT, b"\x01")


class Model:
    """The worker's memory traffic (the module doc) and the check of the
    rows against the leases, after each step's worker update."""

    def __init__(self, sched, worker):
        self.sched, self.worker = sched, worker
        self.mgr = mgr = sched.kv_cache_manager
        pool = mgr.pool
        names = [g["name"] for g in pool.config["cache"]["groups"]]
        self.views = {name: pool.region(i).memoryview() for i, name in enumerate(names)}
        self.strides = {name: pool.regions()[i]["stride"] for i, name in enumerate(names)}
        self.hits = {}  # request ID -> the hit of its first admission
        self.steps = 0

    def close(self):
        for v in self.views.values():
            v.release()

    def __call__(self, out):
        self.check_rows(out)
        for rid, _ in out.scheduled_new_reqs:
            self.hits[rid] = self.mgr.estimate_cached_tokens(self.sched.requests[rid])
        for rid, n in out.num_scheduled_tokens.items():
            self.run(self.sched.requests[rid], n)
        self.mgr.pool.check()
        self.steps += 1

    def _kv(self, group, page, pos):
        off = page * self.strides[group] + (pos % BS) * STAMP
        return self.views[group], off

    def check_rows(self, out):
        mgr, sched = self.mgr, self.sched
        held_by = {}  # (kvfence group, tenant) -> IDs
        for rid, rows in self.worker.rows.items():
            lease = mgr.lease_of(rid)
            assert lease is not None, "the worker holds blocks of %s, which holds no lease" % rid
            assert len(rows) == len(mgr.groups)
            table = lease.block_table()
            req = sched.requests[rid]
            positions = None
            for g, row in zip(mgr.groups, rows):
                if g.kind == "per_token":
                    assert row == table[:len(row)], "%s: worker %s, lease %s" % (rid, row, table)
                    assert len(set(row)) == len(row), "%s: an ID twice: %s" % (rid, row)
                    positions = len(row) if positions is None else positions
                    assert len(row) == positions
                elif g.kind == "sliding_window":
                    first, ring = lease.group_table(g.group)
                    want = [ring[(i - first) % len(ring)] for i in range(len(row))]
                    assert row == want, "%s: window row %s, the lease's ring gives %s" % (rid, row, want)
                    positions = len(row) if positions is None else positions
                    assert len(row) == positions
                else:
                    assert row == [lease.group_table(g.group)[1][0]], "%s: state row %s" % (rid, row)
                assert len(row) <= -(-MAX_LEN // BS)
                held_by.setdefault((g.group, mgr.tenant_of(rid)), set()).update(row)
            if rid in out.num_scheduled_tokens:
                assert positions * BS >= req.num_computed_tokens, "%s: %d blocks for %d tokens" % (
                    rid, positions, req.num_computed_tokens)
        for (group, t1), ids1 in held_by.items():
            for (group2, t2), ids2 in held_by.items():
                if group == group2 and t1 < t2:
                    assert not ids1 & ids2, "tenants %s and %s hold page(s) %s of group %s" % (
                        t1, t2, ids1 & ids2, group)

    def run(self, req, n):
        """One request's part of a step: positions [start, end)."""
        mgr = self.mgr
        rid, tenant = req.request_id, mgr.tenant_of(req.request_id)
        end = req.num_computed_tokens
        start = end - n
        rows = self.worker.rows[rid]
        done = set()
        for g, row in zip(mgr.groups, rows):
            if g.group in done:
                continue
            done.add(g.group)
            if g.kind == "state":
                view, off = self.views[g.group], row[0] * self.strides[g.group]
                got = bytes(view[off:off + SLOT])
                want = digest(tenant, [token_at(req, t) for t in range(start)]) if start else bytes(SLOT)
                assert got == want, "%s: the state slot at %d tokens is not the state of its tokens%s" % (
                    rid, start, " (not scrubbed)" if not start else "")
                view[off:off + SLOT] = digest(tenant, [token_at(req, t) for t in range(end)])
                continue
            for t in range(start, end):  # the step's KV, before attention
                view, off = self._kv(g.group, row[t // BS], t)
                view[off:off + STAMP] = stamp(tenant, token_at(req, t), t)
        done = set()
        for g, row in zip(mgr.groups, rows):
            if g.kind == "state" or g.group in done:
                continue
            done.add(g.group)
            lo = 0 if g.kind == "per_token" else max(0, start - g.sliding_window + 1)
            for t in range(lo, end):  # what the step's queries read
                view, off = self._kv(g.group, row[t // BS], t)
                assert bytes(view[off:off + STAMP]) == stamp(tenant, token_at(req, t), t), (
                    "%s: group %s position %d (page %d) does not hold its KV, read by the step [%d, %d)"
                    % (rid, g.group, t, row[t // BS], start, end))


def engine(sched, **kw):
    e = Engine(sched, **kw)
    e.check = Model(sched, e.worker)
    return e


def run(e, *reqs, max_steps=500):
    for r in reqs:
        e.sched.add_request(r)
    e.run(max_steps)
    return {r.request_id: e.check.hits.get(r.request_id) for r in reqs}


def checkpoints(pool):
    return pool.stats()["checkpoints"]


def hits(sched):
    """Prefix-cache hit tokens the scheduler recorded, per update."""
    return sum(s.hits for s in sched.prefix_stats if s is not None)


def end_clean(pool, mgr, e):
    e.check.close()
    assert not mgr.held_requests(), "leases left: %s" % mgr.held_requests()
    pool.check()
    s = pool.stats()
    assert s["in_use_pages"] == 0 and s["live_leases"] == 0


# ---- hits: pages, window and state restored, as the worker reads them


@pytest.mark.parametrize("model", sorted(MODELS))
def test_identical_prompts_reuse_the_checkpoint_at_the_prefill_checkpoint(model):
    pool, mgr, sched = make(model)
    e = engine(sched)
    toks = prompt(30, 1)
    first = Request("a-0", toks, max_tokens=3, tenant="a")
    sched.add_request(first)
    chunks = []
    while sched.has_requests():
        chunks.append(e.step().num_scheduled_tokens.get("a-0"))
    # 16 tokens a step; the chunk ends at 28, the prompt's last page
    # boundary before its last token, where the state is kept.
    assert chunks[:3] == [16, 12, 2], chunks
    assert checkpoints(pool)["taken"] == 2  # where the second and third chunks started
    again = Request("a-1", toks, max_tokens=3, tenant="a")
    sched.add_request(again)
    out = e.step()
    assert out.num_scheduled_tokens["a-1"] == 2 and mgr.estimate_cached_tokens(again) == 28
    lease = mgr.lease_of("a-1")
    assert lease.hit_tokens() == 28
    c = checkpoints(pool)
    assert (c["hits"], c["hit_tokens"], c["taken"]) == (1, 28, 2)
    e.run()
    other = Request("b-0", toks, max_tokens=3, tenant="b")
    assert run(e, other) == {"b-0": 0}, "another tenant's identical prompt hit"
    longer = Request("a-2", toks + prompt(10, 2), max_tokens=2, tenant="a")
    assert run(e, longer) == {"a-2": 28}
    assert e.check.steps > 10
    end_clean(pool, mgr, e)


def test_the_hit_is_written_when_admission_returns():
    pool, mgr, sched = make()
    e = engine(sched)
    toks = prompt(22, 3)
    run(e, Request("a-0", toks, max_tokens=2, tenant="a"))
    r = Request("a-1", toks, max_tokens=2, tenant="a")
    blocks, hit, _ = mgr.get_computed_blocks(r)
    assert hit == 20
    lease = mgr.lease_of("a-1")
    assert lease.info()["written_tokens"] == 20, "a hybrid hit's watermark is its checkpoint's"
    swa, kv, gdn = blocks.get_block_ids()
    assert kv == lease.block_table()[:5] and len(swa) == 5 and gdn == [lease.group_table("gdn")[1][0]]
    first, ring = lease.group_table("swa")
    assert swa == [ring[(i - first) % len(ring)] for i in range(5)]
    assert mgr.truncate_computed_blocks(blocks, 8).get_block_ids() == (swa[:2], kv[:2], gdn)
    mgr.free(Request("a-1", [1], 1))  # not finished: a preemption of nothing computed
    e.check.close()
    pool.check()


def test_an_aligned_prompt_stops_a_page_early():
    # vLLM's split alone runs a prompt of 32 to its end (its last cache
    # position is 32); the plugin ends a chunk at 28 as well, so that an
    # identical prompt, which computes at least its last token, hits 28.
    pool, mgr, sched = make("gdn")
    e = engine(sched)
    toks = prompt(32, 4)
    first = Request("a-0", toks, max_tokens=2, tenant="a")
    sched.add_request(first)
    chunks = [e.step().num_scheduled_tokens["a-0"] for _ in range(3)]
    assert chunks == [16, 12, 4]
    e.run()
    assert run(e, Request("a-1", toks, max_tokens=2, tenant="a")) == {"a-1": 28}
    # ...and its state at 32, the whole prompt, serves a longer one.
    assert run(e, Request("a-2", toks + prompt(9, 5), max_tokens=2, tenant="a")) == {"a-2": 32}
    end_clean(pool, mgr, e)


def test_a_shared_system_prompt_hits_where_chunks_ended():
    pool, mgr, sched = make(budget=12)
    e = engine(sched)
    system = prompt(26, 6)
    got = run(e, *[Request("a-%d" % i, system + prompt(5 + i, 10 + i), max_tokens=3, tenant="a") for i in range(4)])
    # The first request's chunks end at 12 and 24 (blocks of 4, 12
    # tokens a step); the others, admitted after it ran, share 24 of the
    # 26 system tokens (a page ends at 24, not 26).
    assert got == {"a-0": 0, "a-1": 24, "a-2": 24, "a-3": 24}
    assert hits(sched) == 72
    end_clean(pool, mgr, e)


def test_concurrent_requests_of_two_tenants():
    pool, mgr, sched = make(pages=128, budget=24)
    e = engine(sched)
    reqs = []
    for i in range(10):
        tenant = "ab"[i % 2]
        reqs.append(Request("%s-%d" % (tenant, i), prompt(18 + 7 * (i % 3), i % 3), max_tokens=4 + i % 5,
                            tenant=tenant))
    run(e, *reqs)
    assert set(e.finished().values()) == {"length"} and len(e.finished()) == 10
    assert hits(sched) > 0
    end_clean(pool, mgr, e)


def test_checkpoints_past_the_tenants_bound_are_skipped_and_counted():
    # Tenant a keeps one checkpoint: its first, at 16; the one at 28 is
    # refused (counted by kvfence), and the request runs on. An identical
    # prompt hits 16.
    pool, mgr, sched = make(tenants=({"name": "a", "max_checkpoints": 1}, "b"))
    e = engine(sched)
    toks = prompt(30, 12)
    assert run(e, Request("a-0", toks, max_tokens=2, tenant="a")) == {"a-0": 0}
    c = checkpoints(pool)
    assert (c["taken"], c["capacity_skips"], c["live"]) == (1, 1, 1)
    assert run(e, Request("a-1", toks, max_tokens=2, tenant="a")) == {"a-1": 16}
    assert e.finished() == {"a-0": "length", "a-1": "length"}
    end_clean(pool, mgr, e)


# ---- preemption, asynchronous scheduling, a cache reset


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_preemption_checkpoints_what_it_computed(model):
    # Preempted (vLLM's running loop: _preempt_request, which frees the
    # request) with 16 tokens computed, two of them generated: the
    # preemption checkpoints there, and the resumption restores the state
    # of those 16 tokens.
    pool, mgr, sched = make(model)
    e = engine(sched)
    r = Request("a-0", prompt(14, 11), max_tokens=8, tenant="a")
    sched.add_request(r)
    while r.num_computed_tokens < 16:
        e.step()
    assert r.num_computed_tokens == 16 and r.num_output_tokens == 3  # the third is sampled for position 16
    sched.running.remove(r)
    sched._preempt_request(r, 0.0)
    e.run()
    assert e.finished() == {"a-0": "length"}
    assert [s.preempted_hits for s in sched.prefix_stats if s is not None and s.preempted_requests] == [16]
    end_clean(pool, mgr, e)


def test_preemption_for_pages():
    # 14 pages, leases grown on demand: decoding runs the pool dry and
    # vLLM's running loop preempts; checkpoints are evicted for pages
    # along the way, and every step's reads hold.
    pool, mgr, sched = make("mixed", pages=14, sizing={"mode": "on_demand", "headroom_tokens": 1}, budget=16)
    e = engine(sched)
    reqs = [Request("a-%d" % i, prompt(15, 20 + i), max_tokens=26, tenant="a") for i in range(3)]
    run(e, *reqs)
    assert e.finished() == {r.request_id: "length" for r in reqs}
    assert sum(r.num_preemptions for r in reqs) > 0
    end_clean(pool, mgr, e)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_async_scheduling(model):
    pool, mgr, sched = make(model, base=ReplayAsyncScheduler, pages=128, budget=16)
    e = engine(sched, async_depth=2)
    system = prompt(21, 7)
    reqs = [Request("a-%d" % i, system + prompt(3 + i, 30 + i), max_tokens=5, tenant="ab"[i % 2]) for i in range(6)]
    run(e, *reqs[:2])
    got = run(e, *reqs[2:])
    assert len(e.finished()) == 6
    # a-0's chunks ended at 16 and 20 (its PrefillCheckpoint), a-1's at
    # 12 (the rest of the first steps' budget): each tenant's later
    # requests hit its own.
    assert got == {"a-2": 20, "a-3": 12, "a-4": 20, "a-5": 12}
    end_clean(pool, mgr, e)


def test_reset_prefix_cache_drops_the_checkpoints():
    pool, mgr, sched = make()
    e = engine(sched)
    toks = prompt(30, 8)
    run(e, Request("a-0", toks, max_tokens=2, tenant="a"))
    running = Request("a-1", prompt(30, 9), max_tokens=6, tenant="a")
    sched.add_request(running)
    e.step()
    assert sched.reset_prefix_cache() is True
    e.run()
    assert run(e, Request("a-2", toks, max_tokens=2, tenant="a")) == {"a-2": 0}
    assert run(e, Request("a-3", prompt(30, 9), max_tokens=2, tenant="a")) == {"a-3": 0}, \
        "a lease admitted before the reset checkpointed after it"
    end_clean(pool, mgr, e)


# ---- what the rows hold


def test_each_position_is_reported_once_per_group():
    pool, mgr, sched = make()
    e = engine(sched)
    r = Request("a-0", prompt(37), max_tokens=20, tenant="a")
    sched.add_request(r)
    reported = [[] for _ in mgr.groups]
    while sched.has_requests():
        out = e.step()
        for rid, ids in out.scheduled_new_reqs:
            for acc, got in zip(reported, ids):
                acc.extend(got)
        for rid, ids, resumed in out.scheduled_cached_reqs:
            assert not resumed
            if ids is not None:
                for acc, got in zip(reported, ids):
                    acc.extend(got)
    swa, kv, gdn = reported
    assert len(kv) == len(set(kv)) == 14  # ceil((37 + 20 - 1) / 4): every token's KV, the last sampled one's not
    assert len(swa) == 14 and len(gdn) == 1
    ring = len(set(swa))
    assert ring == (W - 1 + 16 + 1) // BS + 1
    assert all(swa[i] == swa[i + ring] for i in range(len(swa) - ring)), "the window's ring is not periodic"
    end_clean(pool, mgr, e)


def test_block_ids_for_computed_tokens_and_common_prefix():
    pool, mgr, sched = make()
    e = engine(sched)
    r = Request("a-0", prompt(20), max_tokens=4, tenant="a")
    sched.add_request(r)
    e.step()
    swa, kv, gdn = mgr.get_block_ids_for_computed_tokens("a-0", 9)
    lease = mgr.lease_of("a-0")
    assert kv == lease.block_table()[:3] and len(swa) == 3 and gdn == [lease.group_table("gdn")[1][0]]
    assert mgr.get_block_ids_for_computed_tokens("nobody", 9) == ([], [], [])
    assert mgr.get_num_common_prefix_blocks("a-0") == [0, 0, 0]
    assert mgr.empty_kv_cache_blocks.get_block_ids(allow_none=True) is None
    e.run()
    end_clean(pool, mgr, e)


# ---- the window's ring: what it must hold, checked at start and at each step


def test_a_ring_too_small_for_a_step_is_refused():
    spec_kw, groups = MODELS["swa"]
    pool = kvfence.Pool({"cache": cache_spec(ring=16, **spec_kw), "max_leases": 4, "pages": 32,
                         "max_context_tokens": MAX_LEN, "allow_undersized_pool": True, "tenants": [{"name": "a"}]})
    with pytest.raises(ValueError, match="window_tokens >= 23"):
        KVCacheManager(pool, MAX_LEN, resolver("static:a"), kv_cache_groups=groups, max_num_scheduled_tokens=16)
    with pytest.raises(ValueError, match="window_tokens >= 39"):
        KVCacheManager(pool, MAX_LEN, resolver("static:a"), kv_cache_groups=groups, max_num_scheduled_tokens=16,
                       max_concurrent_batches=2)
    with pytest.raises(ValueError, match="window_tokens"):  # the budget defaults to max_model_len
        KVCacheManager(pool, MAX_LEN, resolver("static:a"), kv_cache_groups=groups)
    KVCacheManager(pool, MAX_LEN, resolver("static:a"), kv_cache_groups=groups, max_num_scheduled_tokens=9)
    pool.close()


def test_a_step_past_the_ring_finishes_its_request_with_an_error():
    # The manager was told 8 tokens a step; the scheduler schedules 16.
    # The first step of 16 fits a ring of 16 (nothing before it); the
    # second would overwrite the window its queries read: refused, the
    # request finished with an error, the other served.
    pool, mgr, sched = make("swa", ring=16, budget=16, declared_budget=8)
    e = engine(sched)
    bad = Request("a-0", prompt(40), max_tokens=2, tenant="a")
    ok = Request("b-0", prompt(6, 1), max_tokens=2, tenant="b")
    run(e, bad, ok)
    assert e.finished() == {"a-0": "error", "b-0": "length"}
    assert bad.status == RequestStatus.FINISHED_ERROR
    end_clean(pool, mgr, e)


# ---- configurations kvfence.vllm refuses


def test_bad_group_maps_are_refused():
    pool = kvfence.Pool({"cache": cache_spec(), "max_leases": 4, "pages": 32, "max_context_tokens": MAX_LEN,
                         "allow_undersized_pool": True, "tenants": [{"name": "a"}]})
    res = resolver("static:a")
    cases = {
        "give kv_cache_groups": None,
        "names group 'nope'": ["kv", "nope", "gdn"],
        "give vLLM's sliding_window": ["kv", "swa", "gdn"],
        "sliding_window is for sliding-window": ["kv", {"group": "swa", "sliding_window": W},
                                                 {"group": "gdn", "sliding_window": 4}],
        "no vLLM KV cache group's": ["kv", {"group": "swa", "sliding_window": W}],
        "unknown keys": ["kv", {"group": "swa", "sliding_window": W, "window": 3}, "gdn"],
        "has one window": ["kv", {"group": "swa", "sliding_window": W}, {"group": "swa", "sliding_window": 4},
                           "gdn"],
    }
    for want, groups in cases.items():
        with pytest.raises(ValueError, match=want):
            KVCacheManager(pool, MAX_LEN, res, kv_cache_groups=groups, max_num_scheduled_tokens=8)
    groups = ["kv", {"group": "swa", "sliding_window": W}, "gdn"]
    with pytest.raises(ValueError, match="state slot cannot hold"):
        KVCacheManager(pool, MAX_LEN, res, kv_cache_groups=groups, max_num_scheduled_tokens=8, num_spec_tokens=2,
                       num_lookahead_tokens=2)
    pool.close()
    odd = cache_spec()
    odd["groups"][1]["tokens_per_page"] = 8
    pool = kvfence.Pool({"cache": odd, "max_leases": 4, "pages": 32, "max_context_tokens": MAX_LEN,
                         "allow_undersized_pool": True, "tenants": [{"name": "a"}]})
    with pytest.raises(ValueError, match="pages of 8 tokens"):
        KVCacheManager(pool, MAX_LEN, res, kv_cache_groups=groups, max_num_scheduled_tokens=8)
    pool.close()
