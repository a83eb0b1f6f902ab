"""The scheduler-side adapter in vLLM's KV cache manager vocabulary."""

import kvfence
import pytest
from kvfence.vllm import KVCacheManager, Request

from caches import BLOCK

SYSTEM = [(5 * i + 2) % 1000 for i in range(3 * BLOCK)]


def pool(pages=16, sizing=None, tenants=("a", "b")):
    cfg = {"geometry": {"tokens_per_page": BLOCK, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp16"},
           "pages": pages, "max_context_tokens": pages * BLOCK, "tenants": [{"name": t} for t in tenants]}
    if sizing:
        cfg["sizing"] = sizing
    return kvfence.Pool(cfg)


def run_prefill(mgr, req):
    blocks, computed = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - computed, computed, blocks)
    assert new is not None
    req.num_computed_tokens = req.num_tokens  # the model step wrote the KV
    mgr.cache_blocks(req, req.num_computed_tokens)
    return blocks, computed, new


def test_adapter_admits_in_get_computed_blocks_and_reports_prefix_hits():
    with pool() as p:
        mgr = KVCacheManager(p)
        a = Request("a-1", SYSTEM + [1, 2, 3], max_tokens=5, tenant="a")
        blocks, computed, new = run_prefill(mgr, a)
        assert computed == 0 and blocks.get_block_ids() == ([],)
        assert new.get_block_ids()[0] == mgr.get_block_ids("a-1")[0][:4]  # ceil(27 / 8) blocks
        shared = mgr.get_block_ids("a-1")[0][:3]
        mgr.free(a)

        b = Request("a-2", SYSTEM + [7, 7], max_tokens=5, tenant="a")
        blocks, computed, new = run_prefill(mgr, b)
        assert computed == 3 * BLOCK and blocks.get_block_ids() == (shared,)
        assert mgr.get_block_ids("a-2")[0][:4] == shared + new.get_block_ids()[0]
        stats = mgr.make_prefix_cache_stats()
        assert stats["hits"] == 3 * BLOCK and stats["queries"] >= stats["hits"]
        assert mgr.make_prefix_cache_stats() == {"queries": 0, "hits": 0}

        c = Request("b-1", SYSTEM + [7, 7], max_tokens=5, tenant="b")
        blocks, computed, _ = run_prefill(mgr, c)
        assert computed == 0, "a tenant hit another tenant's prefix"
        assert not set(mgr.get_block_ids("b-1")[0]) & set(shared)
        for r in (b, c):
            mgr.free(r)
        assert mgr.reset_prefix_cache() is False
        p.check()


def test_adapter_returns_none_while_the_pool_cannot_admit_and_raises_what_never_fits():
    with pool(pages=4) as p:
        mgr = KVCacheManager(p)
        big = Request("b-0", list(range(3 * BLOCK)), max_tokens=BLOCK, tenant="b")  # every page
        run_prefill(mgr, big)
        a = Request("a-0", list(range(BLOCK)), max_tokens=1, tenant="a")
        assert mgr.get_computed_blocks(a)[1] == 0
        assert mgr.allocate_slots(a, BLOCK) is None  # the scheduler's "not now"
        mgr.free(big)
        assert mgr.allocate_slots(a, BLOCK) is not None
        mgr.free(a)
        with pytest.raises(kvfence.ExceedsMaxContext):
            mgr.get_computed_blocks(Request("a-1", list(range(4 * BLOCK)), max_tokens=1, tenant="a"))
        with pytest.raises(kvfence.UnknownTenant):
            mgr.get_computed_blocks(Request("z-1", [1, 2], max_tokens=1, tenant="z"))
        assert p.stats()["in_use_pages"] == 0


def test_adapter_grows_on_demand_and_preemption_keeps_the_computed_pages():
    with pool(pages=6, sizing={"mode": "on_demand", "headroom_tokens": 1}) as p:
        mgr = KVCacheManager(p)
        other = Request("b-0", list(range(2 * BLOCK - 1)), max_tokens=1, tenant="b")
        run_prefill(mgr, other)  # 2 of the 6 pages
        req = Request("a-0", list(range(100, 100 + BLOCK)), max_tokens=5 * BLOCK, tenant="a")
        run_prefill(mgr, req)
        steps = 0
        while True:  # decode one token a step until growth is refused
            new = mgr.allocate_slots(req, 1)
            if new is None:
                break
            req.output_token_ids.append(500 + steps)
            req.num_computed_tokens += 1
            steps += 1
        assert req.num_computed_tokens == 4 * BLOCK and len(mgr.get_block_ids("a-0")[0]) == 4
        kept = mgr.preempt(req)
        assert kept == 4 * BLOCK
        mgr.free(other)
        req.num_computed_tokens = 0
        blocks, computed = mgr.get_computed_blocks(req)
        assert computed == 4 * BLOCK - BLOCK  # never the page of the last token
        mgr.free(req)
        p.check()
