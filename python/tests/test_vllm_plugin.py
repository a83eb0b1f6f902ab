"""kvfence.vllm driven by vLLM's own call sequence (vllm_replay: vLLM's
Scheduler and AsyncScheduler at 003df29, their calls into the manager and
the connector in vLLM's order), with the scheduler plugin's part
(SchedulerMixin) around them, as --scheduler-cls runs it.

After every step the worker's block tables (what vLLM's worker holds,
built from the scheduler's outputs as its model runner builds them) are
checked against the kvfence leases: each row is a prefix of its lease's
block table, holds no ID twice, covers the request's computed tokens and
lookahead, and never passes the worker's row width."""

import kvfence
import pytest
from kvfence.vllm import KVCacheBlocks, KVCacheManager, PrefixCacheStats, resolver
from kvfence.vllm._manager import BACKPRESSURE, DEFERRED
from kvfence.vllm._types import AllBlocksCleared, BlockStored

from vllm_replay import (Engine, MultiModalFeatureSpec, PlaceholderRange, ReplayAsyncScheduler, ReplayScheduler,
                         Request, RequestStatus, plugin)

BS = 8


def make_pool(pages, tenants, sizing=None, max_model_len=256, events=0):
    cfg = {"geometry": {"tokens_per_page": BS, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp16"},
           "pages": pages, "max_context_tokens": max_model_len, "allow_undersized_pool": True,
           "tenants": [t if isinstance(t, dict) else {"name": t} for t in tenants]}
    if sizing:
        cfg["sizing"] = sizing
    if events:
        cfg["prefix"] = {"event_buffer": events}
    return kvfence.Pool(cfg)


def make(pages=64, tenants=("a", "b"), sizing=None, max_model_len=256, lookahead=0, spec=0, base=ReplayScheduler,
         events=0, **kw):
    pool = make_pool(pages, tenants, sizing, max_model_len, events)
    mgr = KVCacheManager(pool, max_model_len, resolver("trace_header:x-tenant"), log_stats=True,
                         enable_kv_cache_events=bool(events), num_lookahead_tokens=lookahead, num_spec_tokens=spec)
    sched = plugin(base)(mgr, max_model_len=max_model_len, num_lookahead_tokens=lookahead, num_spec_tokens=spec, **kw)
    return pool, mgr, sched


def prompt(n, seed=0):
    return [(7 * i + 13 * seed + 1) % 997 for i in range(n)]


def checker(sched, log=None):
    """The check after each step: the worker's tables against the leases."""
    mgr = sched.kv_cache_manager

    def check(out):
        seen_domains = {}
        for rid, table in sched_worker(sched).tables.items():
            lease = mgr.lease_of(rid)
            assert lease is not None, "the worker holds blocks of %s, which holds no lease" % rid
            full = lease.block_table()
            assert table == full[:len(table)], "%s: worker %s, lease %s" % (rid, table, full)
            assert len(set(table)) == len(table), "%s: an ID twice: %s" % (rid, table)
            assert len(table) <= mgr.max_blocks_per_request
            req = sched.requests[rid]
            if rid in out.num_scheduled_tokens:
                want = min(req.num_computed_tokens + sched.num_lookahead_tokens, sched.max_model_len)
                assert len(table) * BS >= want, "%s: %d blocks for %d tokens" % (rid, len(table), want)
            seen_domains.setdefault(mgr.tenant_of(rid), set()).update(table)
        tenants = list(seen_domains)
        for i, a in enumerate(tenants):
            for b in tenants[i + 1:]:
                assert not seen_domains[a] & seen_domains[b], "tenants %s and %s hold one page" % (a, b)
        # Nothing published past what the processed steps wrote.
        for rid, held in mgr._held.items():
            req = sched.requests[rid]
            assert held.published <= max(held.hit, req.num_computed_tokens - req.num_in_flight_tokens)
        if log is not None:
            log.append({rid: list(t) for rid, t in sched_worker(sched).tables.items()})
    return check


_workers = {}


def sched_worker(sched):
    return _workers[id(sched)]


def engine(sched, **kw):
    e = Engine(sched, **kw)
    _workers[id(sched)] = e.worker
    e.check = checker(sched)
    return e


def end_clean(pool, mgr, sched):
    assert not mgr.held_requests(), "leases left: %s" % mgr.held_requests()
    pool.check()
    s = pool.stats()
    assert s["in_use_pages"] == 0 and s["live_leases"] == 0


# ---- vLLM's call sequence


def test_waiting_to_running_with_chunked_prefill_and_finish():
    pool, mgr, sched = make(max_num_batched_tokens=40, long_prefill_token_threshold=24)
    reqs = [Request("a-%d" % i, prompt(50 + 9 * i, i), max_tokens=12, tenant="a") for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    e = engine(sched)
    first = e.step()
    # vLLM's order: new_step_starts, the waiting loop's lookup, allocation
    # and get_blocks for each admitted request.
    assert sched.calls[:4] == [("new_step_starts", None), ("get_computed_blocks_for_connector", "a-0"),
                               ("allocate_slots", "a-0"), ("get_blocks", "a-0")]
    assert first.num_scheduled_tokens == {"a-0": 24, "a-1": 16}  # chunked by the threshold and the budget
    steps = e.run()
    assert steps < 100
    assert e.finished() == {r.request_id: "length" for r in reqs}
    for r in reqs:
        assert r.num_output_tokens == 12
    end_clean(pool, mgr, sched)


def test_prefix_hit_reports_the_shared_pages_first():
    pool, mgr, sched = make()
    system = prompt(40, 9)
    a = Request("a-0", system + [1, 2, 3], max_tokens=4, tenant="a")
    sched.add_request(a)
    e = engine(sched)
    e.run()
    shared = mgr.pool.stats()["prefix"]
    assert shared["domains"][0]["indexed_pages"] >= 5
    b = Request("a-1", system + [4, 5], max_tokens=4, tenant="a")
    sched.add_request(b)
    out = e.step()
    assert b.num_computed_tokens == 42 and out.num_scheduled_tokens["a-1"] == 2  # 40 tokens hit: 5 pages
    assert mgr.estimate_cached_tokens(b) == 40
    stats = sched.prefix_stats[-1]
    assert isinstance(stats, PrefixCacheStats) and stats.hits == 40 and stats.requests == 1
    c = Request("b-0", system + [4, 5], max_tokens=4, tenant="b")
    sched.add_request(c)
    e.step()
    assert mgr.estimate_cached_tokens(c) == 0, "another tenant's identical prompt shared KV"
    e.run()
    end_clean(pool, mgr, sched)


def test_preemption_for_pages_and_resumption():
    # 12 pages, leases grown on demand: decoding runs the pool dry and
    # vLLM's running loop preempts the newest request (None is
    # back-pressure); it resumes on its cached pages.
    pool, mgr, sched = make(pages=12, sizing={"mode": "on_demand", "headroom_tokens": 1}, max_num_batched_tokens=64)
    reqs = [Request("a-%d" % i, prompt(20, i), max_tokens=30, tenant="a") for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    e = engine(sched)
    e.run()
    assert e.finished() == {r.request_id: "length" for r in reqs}
    assert sum(r.num_preemptions for r in reqs) > 0
    assert any(r.num_preemptions and mgr.pool.stats()["growth"]["preempt_kept_pages"] for r in reqs)
    end_clean(pool, mgr, sched)


def test_abort_running_and_waiting():
    pool, mgr, sched = make(max_num_batched_tokens=16)
    a, b = Request("a-0", prompt(40), max_tokens=20, tenant="a"), Request("a-1", prompt(40, 1), max_tokens=20,
                                                                          tenant="a")
    sched.add_request(a)
    sched.add_request(b)
    e = engine(sched)
    e.step()  # a in prefill, b waiting
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    sched.finish_requests(["a-0", "a-1"], RequestStatus.FINISHED_ABORTED)
    assert mgr.held_requests() == []
    e.run()
    end_clean(pool, mgr, sched)


@pytest.mark.parametrize("spec,accept", [(0, 0), (3, 1)])
def test_async_scheduling(spec, accept):
    pool, mgr, sched = make(base=ReplayAsyncScheduler, max_num_batched_tokens=48, spec=spec, lookahead=spec)
    reqs = [Request("a-%d" % i, prompt(30 + 5 * i, i), max_tokens=10, tenant="ab"[i % 2]) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    e = engine(sched, async_depth=2, accept=accept)
    e.run()
    assert set(e.finished()) == {r.request_id for r in reqs}
    assert ("cache_blocks", "a-0") in sched.calls  # AsyncScheduler publishes through cache_blocks
    end_clean(pool, mgr, sched)


def test_spec_decode_lookahead_rows_cover_the_drafts():
    pool, mgr, sched = make(spec=2, lookahead=2, max_num_batched_tokens=64)
    reqs = [Request("a-%d" % i, prompt(17, i), max_tokens=15, tenant="a") for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    e = engine(sched, accept=1)
    e.run()
    assert e.finished() == {r.request_id: "length" for r in reqs}
    end_clean(pool, mgr, sched)


def test_deltas_are_never_reported_twice():
    pool, mgr, sched = make(max_num_batched_tokens=24)
    r = Request("a-0", prompt(60), max_tokens=40, tenant="a")
    sched.add_request(r)
    e = engine(sched)
    reported = []
    while sched.has_requests():
        out = e.step()
        for rid, ids in out.scheduled_new_reqs:
            reported.extend(ids[0])
        for rid, ids, resumed in out.scheduled_cached_reqs:
            assert not resumed
            if ids is not None:
                reported.extend(ids[0])
    assert len(reported) == len(set(reported)) == 13  # ceil(100 / 8): the prompt and every output token's KV
    end_clean(pool, mgr, sched)


# ---- tenants


def test_a_tenant_over_quota_never_blocks_or_preempts_another():
    tenants = [{"name": "a", "quota_pages": 8}, {"name": "b"}]
    pool, mgr, sched = make(pages=64, tenants=tenants, max_num_batched_tokens=512)
    a_reqs = [Request("a-%d" % i, prompt(24, i), max_tokens=8, tenant="a") for i in range(4)]  # 4 pages each
    never = Request("a-big", prompt(40, 7), max_tokens=40, tenant="a")  # 10 pages: over a's whole quota
    b_reqs = [Request("b-%d" % i, prompt(24, 10 + i), max_tokens=8, tenant="b") for i in range(3)]
    for r in a_reqs + [never] + b_reqs:
        sched.add_request(r)
    e = engine(sched)
    e.step()
    # a's quota holds 2 of its requests; the others wait, and b's, behind
    # them in the queue, run in the same step.
    assert {r.request_id for r in sched.running} == {"a-0", "a-1", "b-0", "b-1", "b-2"}
    assert mgr.refusal_of("a-2").kind == DEFERRED
    assert never.status == RequestStatus.FINISHED_ERROR
    e.run()
    assert e.finished()["a-big"] == "error"
    assert all(e.finished()[r.request_id] == "length" for r in a_reqs + b_reqs)
    assert all(r.num_preemptions == 0 for r in b_reqs)
    end_clean(pool, mgr, sched)


def test_a_tenant_growing_past_its_quota_preempts_only_its_own():
    tenants = [{"name": "a", "quota_pages": 6}, {"name": "b"}]
    sizing = {"mode": "on_demand", "headroom_tokens": 1}
    pool, mgr, sched = make(pages=64, tenants=tenants, sizing=sizing, max_num_batched_tokens=512)
    a_reqs = [Request("a-%d" % i, prompt(15, i), max_tokens=20, tenant="a") for i in range(3)]
    b_reqs = [Request("b-%d" % i, prompt(15, 10 + i), max_tokens=20, tenant="b") for i in range(3)]
    for x, y in zip(a_reqs, b_reqs):
        sched.add_request(x)
        sched.add_request(y)
    e = engine(sched)
    e.run()
    assert all(e.finished()[r.request_id] == "length" for r in a_reqs + b_reqs)
    assert sum(r.num_preemptions for r in a_reqs) > 0, "a's quota never bound"
    assert all(r.num_preemptions == 0 for r in b_reqs), "a's quota preempted b"
    end_clean(pool, mgr, sched)


def test_pages_reserved_for_another_tenant_skip_not_block():
    tenants = [{"name": "a"}, {"name": "b", "reserved_pages": 8}]
    pool, mgr, sched = make(pages=16, tenants=tenants, max_num_batched_tokens=512)
    a0 = Request("a-0", prompt(50), max_tokens=14, tenant="a")   # 8 pages: every unreserved one
    a1 = Request("a-1", prompt(10, 1), max_tokens=6, tenant="a")  # then nothing unreserved is left
    b0 = Request("b-0", prompt(40, 2), max_tokens=8, tenant="b")  # b's reservation
    for r in (a0, a1, b0):
        sched.add_request(r)
    e = engine(sched)
    e.step()
    refusal = mgr.refusal_of("a-1")
    assert refusal is not None and refusal.kind == DEFERRED and refusal.error.cause == "reserved"
    assert b0.status == RequestStatus.RUNNING, "a's refusal blocked b's reservation"
    e.run()
    assert set(e.finished().values()) == {"length"} and len(e.finished()) == 3
    end_clean(pool, mgr, sched)


def test_pool_exhaustion_is_back_pressure():
    pool, mgr, sched = make(pages=8, tenants=("a", "b"), max_num_batched_tokens=512)
    a0 = Request("a-0", prompt(50), max_tokens=14, tenant="a")  # every page
    b0 = Request("b-0", prompt(10, 1), max_tokens=6, tenant="b")
    sched.add_request(a0)
    sched.add_request(b0)
    e = engine(sched)
    e.step()
    assert mgr.refusal_of("b-0").kind == BACKPRESSURE and b0.status == RequestStatus.WAITING
    e.run()
    assert e.finished() == {"a-0": "length", "b-0": "length"}
    end_clean(pool, mgr, sched)


# ---- bad input through the plugin


def test_bad_requests_get_their_own_error_and_the_engine_serves_the_others():
    tenants = [{"name": "a", "quota_pages": 16}, {"name": "b"}]
    pool, mgr, sched = make(pages=32, tenants=tenants, max_model_len=512, max_num_batched_tokens=512)
    bad = [Request("unknown", prompt(10), 4, tenant="nobody"),
           Request("unauthenticated", prompt(10), 4, tenant=None),
           Request("client-set", prompt(10), 4, tenant="a", extra_args={"kvfence_tenant": "b"}),
           Request("too-long", prompt(200), 100, tenant="a"),   # 38 pages: more than the pool
           Request("over-quota", prompt(100), 40, tenant="a")]  # 18 pages: more than a's quota
    good = [Request("a-0", prompt(10, 1), 4, tenant="a"), Request("b-0", prompt(10, 2), 4, tenant="b")]
    for r in bad[:3] + good[:1] + bad[3:] + good[1:]:
        sched.add_request(r)
    e = engine(sched)
    e.run()
    done = e.finished()
    assert {r.request_id: done[r.request_id] for r in bad} == {r.request_id: "error" for r in bad}
    assert done["a-0"] == done["b-0"] == "length"
    assert all(r.status == RequestStatus.FINISHED_ERROR for r in bad)
    end_clean(pool, mgr, sched)


def test_plugin_needs_kvfences_connector():
    pool = make_pool(8, ["a"])
    mgr = KVCacheManager(pool, 64, resolver("static:a"))
    with pytest.raises(ValueError, match="KV connector"):
        plugin(ReplayScheduler)(mgr, connector=False)


def test_tenant_resolvers():
    r = Request("x", [1], 1, tenant="acme")
    assert resolver("trace_header:x-tenant")(r) == "acme"
    assert resolver("static:solo")(r) == "solo"
    assert resolver("os.path:basename") is not None
    for bad in ("", "nothing", "static:", "trace_header:", 3):
        with pytest.raises(ValueError):
            resolver(bad)


# ---- keys: LoRA, multimodal, salt


def admit(mgr, req):
    blocks, hit, _ = mgr.get_computed_blocks(req)
    assert mgr.refusal_of(req.request_id) is None, mgr.refusal_of(req.request_id)
    new = mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    req.status = RequestStatus.RUNNING
    mgr.cache_blocks(req, req.num_tokens)
    return hit, set(mgr.lease_of(req.request_id).block_table())


def image(ident, offset, length):
    return MultiModalFeatureSpec(ident, PlaceholderRange(offset, length))


def test_lora_salt_and_images_never_share_a_page():
    pool, mgr, sched = make(pages=128)
    toks = prompt(64, 3)  # 8 pages; placeholders at 24..40 are pages 3, 4 and the start of 5
    base_hit, base_pages = admit(mgr, Request("r0", toks, 4, tenant="a"))
    assert base_hit == 0
    cases = {
        "same": (dict(), 56),  # all but the last page
        "lora x": (dict(lora_name="x"), 0),
        "cache salt": (dict(cache_salt="s1"), 0),
        "image A": (dict(mm_features=[image("A", 24, 17)]), 24),  # the 3 pages before the image
    }
    for i, (name, (kw, want)) in enumerate(cases.items()):
        hit, pages = admit(mgr, Request("r%d" % (i + 1), toks, 4, tenant="a", **kw))
        assert hit == want, name
        assert len(pages & base_pages) == want // BS, name
    # Same image: shares with the first image request; another image or
    # the image elsewhere does not, past the pages before it.
    hit, _ = admit(mgr, Request("r10", toks, 4, tenant="a", mm_features=[image("A", 24, 17)]))
    assert hit == 56
    hit, _ = admit(mgr, Request("r11", toks, 4, tenant="a", mm_features=[image("B", 24, 17)]))
    assert hit == 24
    hit, _ = admit(mgr, Request("r12", toks, 4, tenant="a", mm_features=[image("A", 25, 16)]))
    assert hit == 24
    hit, _ = admit(mgr, Request("r13", toks, 4, tenant="a", lora_name="x"))
    assert hit == 56, "the same LoRA shares"
    for rid in mgr.held_requests():
        mgr.free(sched_req(rid))
    pool.check()


def sched_req(rid):
    r = Request(rid, [1], 1)
    r.status = RequestStatus.FINISHED_ABORTED
    return r


def test_a_salt_of_the_server_narrows_sharing():
    pool = make_pool(64, ["a"])
    plain = KVCacheManager(pool, 256, resolver("static:a"))
    salted = KVCacheManager(pool, 256, resolver("static:a"), salt="weights-v2")
    toks = prompt(40)
    admit(plain, Request("p", toks, 4))
    hit, _ = admit(salted, Request("s", toks, 4))
    assert hit == 0
    hit, _ = admit(plain, Request("p2", toks, 4))
    assert hit == 32


# ---- reset, stats, events, result types


def test_reset_prefix_cache_drops_what_was_computed_before():
    pool, mgr, sched = make(events=64)
    toks = prompt(40, 5)
    first = Request("a-0", toks, 4, tenant="a")
    sched.add_request(first)
    e = engine(sched)
    e.run()
    events = sched.events
    assert any(isinstance(ev, BlockStored) for ev in events)
    assert all(len(h) == 32 for ev in events for h in getattr(ev, "block_hashes", []))
    running = Request("a-1", prompt(30, 6), 8, tenant="a")
    sched.add_request(running)
    e.step()  # admitted with the old weights' KV
    assert sched.reset_prefix_cache() is True
    e.step()
    assert any(isinstance(ev, AllBlocksCleared) for ev in sched.events)
    assert sched.prefix_stats[-1].reset is True
    again = Request("a-2", toks, 4, tenant="a")
    sched.add_request(again)
    e.step()
    assert mgr.estimate_cached_tokens(again) == 0, "a hit on KV of the old weights"
    e.run()
    stats = pool.stats()["prefix"]["domains"]
    assert sum(d["hit_tokens"] for d in stats) == 0, "a hit on KV of the old weights"
    end_clean(pool, mgr, sched)


def test_reset_with_running_requests_preempts_and_resumes():
    pool, mgr, sched = make()
    reqs = [Request("a-%d" % i, prompt(30, i), max_tokens=10, tenant="a") for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    e = engine(sched)
    e.step()
    e.step()
    assert sched.reset_prefix_cache(reset_running_requests=True)
    e.run()
    assert set(e.finished().values()) == {"length"}
    end_clean(pool, mgr, sched)


def test_result_types():
    blocks = KVCacheBlocks(([3, 4],))
    assert blocks.get_block_ids() == ([3, 4],)
    assert KVCacheBlocks(((),)).get_block_ids(allow_none=True) is None
    assert KVCacheBlocks(([],)).get_block_ids(allow_none=False) == ([],)
    assert (blocks + KVCacheBlocks(([5],))).get_block_ids() == ([3, 4, 5],)
    assert blocks.new_empty().get_block_ids(allow_none=True) is None
    pool, mgr, sched = make()
    assert mgr.get_num_common_prefix_blocks("x") == [0]
    assert mgr.take_kv_cache_block_copies() == ([], [])
    assert mgr.take_new_block_ids() == [] and mgr.take_partial_tail_offloads() == {}
    assert 0.0 <= mgr.usage <= 1.0
    assert mgr.block_pool.hash_block_size == BS
    with pytest.raises(ValueError):
        mgr.block_pool.free_blocks([1])
    r = Request("a-0", prompt(9), 4, tenant="a")
    with pytest.raises(ValueError):
        mgr.allocate_slots(r, 0)
    pool.close()
