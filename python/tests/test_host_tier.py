"""The host tier (the config's "host_tier", ABI 12): a prompt the pool's
pages evict is kept in host memory and copied back into the pages of the
next admission that shares it, which gives the same attention output
without recomputing it, in every engine layout; another tenant's domain
never gets it; a preempted request's pages swap there and back. In a
pool with window or state groups (ABI 13) the tier keeps the state
checkpoints the device evicts, and a hit restores one byte for byte."""

import pytest
import torch

import kvfence
from caches import BLOCK, Cache
from conftest import TinyModel, contiguous_attention, paged_attention, tolerance
from test_checkpoints import AT, STATE_BYTES, advance, prompt, restored_wrong, write
from test_checkpoints import config as hybrid_config

SHARED = [(29 * i + 3) % 1000 for i in range(4 * BLOCK)]  # 4 full pages


def attend(cache, lease, q, q_start, seq_len):
    kc, vc = cache.pages(0)
    return paged_attention([q], [q_start], [seq_len], cache.pool.block_tables([lease]), kc, vc)[0]


def evict(pool, tenant):
    """A request of every page: the pool's cache goes into the tier."""
    pool.admit("hog", tenant, pool.num_pages * BLOCK).free()


@pytest.mark.parametrize("kind", ["owned", "vllm", "sglang"])
def test_a_prompt_evicted_into_the_tier_comes_back_as_hits(kind):
    dtype = torch.float32
    cache = Cache(kind, dtype, pages=8, tenants=["a", {"name": "b", "tier_pages": 2}], host_tier={"pages": 16})
    try:
        first = SHARED + [1, 2, 3]
        m = TinyModel()
        a = cache.pool.admit_tokens("a-1", "a", first)
        k, v, _ = m.kvq(first)
        cache.write(0, cache.slots(a, 0, len(first)), k, v)
        cache.write(1, cache.slots(a, 0, len(first)), k * 2, v * 2)
        a.commit(len(first))
        assert a.cache_prefix(len(first)) == len(SHARED)
        a.free()
        evict(cache.pool, "b")
        t = cache.pool.tier_stats()
        assert t["enabled"] and t["offloads"] == 4 and t["cached"] == 4
        assert cache.pool.stats()["cached_pages"] == 0, "the device's copies are gone"

        second = SHARED + [9, 8, 7, 6]
        m2 = TinyModel()
        b = cache.pool.admit_tokens("a-2", "a", second)
        hit = b.hit_tokens()
        assert hit == len(SHARED), "the 4 pages came back from the tier"
        k, v, q = m2.kvq(second[hit:], start=hit)
        assert m2.computed == len(second) - hit
        cache.write(0, cache.slots(b, hit, len(second)), k, v)
        out = attend(cache, b, q, hit, len(second))
        fk, fv, fq = TinyModel().kvq(second)
        ref = contiguous_attention(fq[hit:], fk, fv, hit)
        torch.testing.assert_close(out, ref, atol=tolerance(dtype), rtol=tolerance(dtype))
        b.free()
        assert cache.pool.tier_stats()["onloads"] == 4

        other = cache.pool.admit_tokens("b-1", "b", second)
        assert other.hit_tokens() == 0, "another domain got the tier's pages"
        other.free()
        doms = {d["name"]: d for d in cache.pool.stats()["prefix"]["domains"]}
        assert doms["tenant:a"]["tier_hit_pages"] == 4 and doms["tenant:b"]["tier_bound"] == 2
        cache.pool.check()
    finally:
        cache.close()


def test_a_preempted_request_swaps_to_the_tier_and_back():
    dtype = torch.float32
    cache = Cache("owned", dtype, pages=8, tenants=["a"], host_tier={"pages": 8}, prefix={"disable": True})
    try:
        ids = [(7 * i + 11) % 1000 for i in range(2 * BLOCK + 3)]
        m = TinyModel()
        lease = cache.pool.admit_tokens("r", "a", ids[:BLOCK + 2], max_new_tokens=BLOCK + 4)
        k, v, _ = m.kvq(ids)
        cache.write(0, cache.slots(lease, 0, len(ids)), k, v)
        lease.commit(len(ids))
        assert lease.preempt(ids) == len(ids), "every written token kept: swapped"
        t = cache.pool.tier_stats()
        assert t["swaps_out"] == 1 and t["swapped"] == 3

        back = cache.pool.admit_tokens("r", "a", ids, max_new_tokens=2)
        hit = back.hit_tokens()
        assert hit == len(ids) - 1, "all but the last token came back"
        _, _, q = m.kvq(ids[hit:], start=hit)
        out = attend(cache, back, q, hit, len(ids))
        ref = contiguous_attention(TinyModel().kvq(ids)[2][hit:], k, v, hit)
        torch.testing.assert_close(out, ref, atol=tolerance(dtype), rtol=tolerance(dtype))
        back.free()
        assert cache.pool.tier_stats()["swaps_in"] == 1
        cache.pool.check()
    finally:
        cache.close()


def hybrid_tier_config(tier):
    """test_checkpoints' hybrid pool with two leases and no checkpoint
    slots of its own (a second checkpoint evicts the first), and a tier."""
    cfg = hybrid_config()
    cfg["max_leases"], cfg["max_context_tokens"], cfg["host_tier"] = 2, 256, tier
    return cfg


def checkpointed(pool, rid, seed):
    """seed's prompt prefilled to AT with seed's bytes, checkpointed there."""
    with pool.admit_tokens(rid, "acme", prompt(seed), max_new_tokens=8) as lease:
        lease.begin_prefill()
        advance(lease, AT)
        write(pool, lease, seed, AT // 4)
        lease.checkpoint_state(AT)


def test_a_checkpoint_evicted_into_the_tier_is_restored():
    with kvfence.Pool(hybrid_tier_config({"pages": 32, "checkpoints": 2})) as pool:
        t = pool.tier_stats()
        assert t["slots"] == 34 and t["checkpoint_slots"] == 2 and t["checkpoint_slot_bytes"] == STATE_BYTES
        checkpointed(pool, "ck-1", 1)
        checkpointed(pool, "ck-2", 2)  # takes ck-1's slot: ck-1's checkpoint goes to the tier
        t = pool.tier_stats()
        assert t["checkpoints_stored"] == 1 and t["checkpoints"] == 1
        assert pool.stats()["checkpoints"]["live"] == 1

        def hit(rid, tenant, seed):
            with pool.admit_tokens(rid, tenant, prompt(seed), max_new_tokens=8) as lease:
                n = lease.hit_tokens()
                if n:
                    assert lease.info()["written_tokens"] == AT
                    assert restored_wrong(pool, lease, seed) == []
                return n

        assert hit("again-1", "acme", 1) == AT, "its pages on the device, its state from the tier"
        t = pool.tier_stats()
        assert t["checkpoints_restored"] == 1 and t["checkpoint_restore_bytes"] == STATE_BYTES
        assert hit("other", "globex", 1) == 0, "another domain got the tier's checkpoint"

        # A request of every page evicts the device's pages and checkpoint:
        # both prompts come back from the tier alone.
        pool.admit("hog", "globex", pool.num_pages * 4).free()
        assert pool.stats()["checkpoints"]["live"] == 0
        assert pool.tier_stats()["checkpoints"] == 2
        assert hit("back-2", "acme", 2) == AT and hit("back-1", "acme", 1) == AT
        t = pool.tier_stats()
        assert t["checkpoints_restored"] == 3 and t["onloads"] >= 10
        assert sum(t[k] for k in ("free", "cached", "swapped", "checkpoints", "in_flight", "quarantined",
                                  "retired")) == t["slots"]
        pool.check()


def test_hybrid_tier_config():
    with pytest.raises(kvfence.TierUnsupported) as e:
        kvfence.Pool(hybrid_tier_config({"pages": 32}))
    assert "HostTier.Checkpoints" in str(e.value)
    with pytest.raises(kvfence.InvalidConfig) as e:
        kvfence.Pool(hybrid_tier_config({"pages": 32, "checkpoints": -1}))
    assert "Checkpoints -1" in str(e.value)
    with pytest.raises(kvfence.InvalidConfig) as e:
        kvfence.Pool({"geometry": {"tokens_per_page": 4, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp16"},
                      "pages": 8, "max_context_tokens": 32, "host_tier": {"pages": 4, "checkpoints": 1}})
    assert "no window or state group" in str(e.value)


def test_tier_checkpoints_need_abi_13(monkeypatch):
    monkeypatch.setattr(kvfence._lib, "abi_version", lambda: 12)
    with pytest.raises(kvfence.InvalidConfig) as e:
        kvfence.Pool(hybrid_tier_config({"pages": 32, "checkpoints": 2}))
    assert "needs a library of ABI 13 (this one is 12)" in str(e.value)


def test_tier_statuses():
    assert issubclass(kvfence.TierUnsupported, ValueError)
    assert issubclass(kvfence.OnloadFailed, kvfence.AdmissionError)
    with pytest.raises(kvfence.TierUnsupported):
        kvfence.Pool({"cache": {"groups": [
            {"name": "kv", "kind": "per_token", "tokens_per_page": 4, "regions": [{"name": "k", "dtype": "fp16", "page_bytes": 64}]},
            {"name": "state", "kind": "state", "regions": [{"name": "s", "dtype": "fp32", "page_bytes": 64}]}]},
            "max_leases": 2, "pages": 16, "max_context_tokens": 64, "host_tier": {"pages": 4}})
    with pytest.raises(kvfence.InvalidConfig):
        kvfence.Pool({"geometry": {"tokens_per_page": 4, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp16"},
                      "pages": 8, "max_context_tokens": 32, "host_tier": {"pages": -1}})
