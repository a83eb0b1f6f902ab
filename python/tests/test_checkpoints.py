"""State checkpoints through the package (ABI 10), as capi_test_v10.inc
drives them from C: a checkpoint at the prefill's checkpoint is restored
by the next admission of the domain with the same prompt, byte for byte
(read back through the pool's region views), the rest of its window ring
scrubbed; every refusal raises its class and leaves the pool as it was
(its stats unchanged); the config keys' bad values are refused naming
the field; stats()["checkpoints"] counts it all.

The pool is test_hybrid_handoff's miniature hybrid model (4-token pages,
a window of 8 tokens, a 9,096-byte state slot), scrubbed to zeros.
"""

import pytest

import kvfence

PROMPT = 22     # 6 pages
AT = 20         # its prefill's checkpoint: 5 pages, the window's pages 3 and 4
STATE_BYTES = 2 * 128 + 96 + 9000
GROUPS = ("kv", "swa", "state")
REGIONS = {"kv": (0, 1), "swa": (2, 3), "state": (4, 5)}


def config(prefix=None, acme=None, cache=True):
    if not cache:
        cfg = {"geometry": {"tokens_per_page": 4, "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "fp16"},
               "pages": 32, "max_context_tokens": 128, "tenants": [{"name": "acme"}]}
    else:
        cfg = {"cache": {"model": "py-ckpt", "groups": [
            {"name": "kv", "kind": "per_token", "tokens_per_page": 4, "regions": [
                {"name": "l1.latent", "dtype": "bf16", "page_bytes": 128},
                {"name": "l1.indexer", "dtype": "fp8_e4m3", "also_holds": ["fp32"], "page_bytes": 80}]},
            {"name": "swa", "kind": "sliding_window", "tokens_per_page": 4, "window_tokens": 8, "regions": [
                {"name": "l2.k", "dtype": "bf16", "page_bytes": 64},
                {"name": "l2.v", "dtype": "bf16", "page_bytes": 64}]},
            {"name": "state", "kind": "state", "regions": [
                {"name": "l0.conv", "dtype": "bf16", "page_bytes": 96},
                {"name": "l0.state", "dtype": "fp32", "page_bytes": 9000}]}]},
            "max_leases": 4, "pages": 64, "max_context_tokens": 128,
            "tenants": [dict({"name": "acme"}, **(acme or {})), {"name": "globex"}]}
    if prefix is not None:
        cfg["prefix"] = prefix
    return cfg


def prompt(seed, n=PROMPT):
    return [seed * 1000 + i for i in range(n)]


def stamp(seed, g, lp, k, n):
    return bytes((seed * 131 + GROUPS.index(g) * 61 + lp * 29 + k * 17 + i * 7 + (i >> 8)) & 0xFF for i in range(n))


def pages(pool, lease, kv_pages):
    """{(group, logical page, region k): memoryview of that page}: the
    lease's first kv_pages per-token pages, its window ring and its slot,
    through the pool's region views."""
    views = [pool.region(i).memoryview() for i in range(6)]
    regs = pool.regions()
    out = {}
    for g in GROUPS:
        first, table = lease.group_table(g)
        if g == "kv":
            table = table[:kv_pages]
        for j, page in enumerate(table):
            for k, r in enumerate(REGIONS[g]):
                off = page * regs[r]["stride"]
                out[(g, first + j, k)] = views[r][off:off + regs[r]["page_bytes"]]
    return out


def write(pool, lease, seed, kv_pages):
    for (g, lp, k), page in pages(pool, lease, kv_pages).items():
        page[:] = stamp(seed, g, lp, k, len(page))


def restored_wrong(pool, lease, seed):
    """The pages that do not hold what a hit on seed's checkpoint at AT
    must: seed's bytes in the 5 shared pages, the window's pages 3 and 4
    and the slot; zeros (scrubbed) in the ring's other page."""
    first, _ = lease.group_table("swa")
    assert first == 3
    wrong = []
    for (g, lp, k), page in pages(pool, lease, AT // 4).items():
        want = bytes(len(page)) if g == "swa" and lp >= 5 else stamp(seed, g, lp, k, len(page))
        if bytes(page) != want:
            wrong.append((g, lp, k))
    return wrong


def advance(lease, n):
    lease.commit(n)
    lease.slide_windows()


def ckpts(pool):
    return pool.stats()["checkpoints"]


@pytest.fixture
def pools():
    made = []

    def make(*a, **kw):
        made.append(kvfence.Pool(config(*a, **kw)))
        return made[-1]
    yield make
    for p in made:
        p.close()


def test_a_hit_restores_the_checkpoint(pools):
    pool = pools({"checkpoint_slots": 2})
    with pool.admit_tokens("a", "acme", prompt(1), max_new_tokens=8) as a:
        assert a.prefill_checkpoint() == AT
        a.begin_prefill()
        advance(a, AT)
        write(pool, a, 1, AT // 4)
        a.checkpoint_state(AT)
        c = ckpts(pool)
        assert (c["live"], c["taken"], c["existing"], c["state_bytes"]) == (1, 1, 0, STATE_BYTES)
        assert c["copy_nanos"] > 0
        a.checkpoint_state(AT, stream=kvfence.STREAM_LEGACY)  # there already: kept
        assert (ckpts(pool)["taken"], ckpts(pool)["existing"]) == (1, 1)
        advance(a, PROMPT)  # the state and window move on; the published pages stay
        write(pool, a, 2, 0)
        a.finish_prefill()

    with pool.admit_tokens("b", "acme", prompt(1), max_new_tokens=8) as b:
        assert b.hit_tokens() == AT
        assert b.info()["written_tokens"] == AT
        assert restored_wrong(pool, b, 1) == []
        c = ckpts(pool)
        assert (c["hits"], c["hit_tokens"], c["misses"], c["restoring"]) == (1, AT, 0, 0)
        assert c["restore_nanos"] > 0
    with pool.admit_tokens("other", "globex", prompt(1)) as other:
        assert other.hit_tokens() == 0  # another domain
    with pool.admit_tokens("short", "acme", prompt(1, 17)) as short:
        assert short.hit_tokens() == 0  # its matched pages end before the checkpoint
    c = ckpts(pool)
    assert (c["misses"], c["miss_tokens"]) == (1, 16)
    pool.check()


def refused(pool, lease, tokens, cls, says):
    before = pool.stats()
    with pytest.raises(cls) as e:
        lease.checkpoint_state(tokens)
    assert says in e.value.message
    assert pool.stats() == before
    pool.check()


def test_refusals_change_nothing(pools):
    pool = pools({"checkpoint_slots": 2, "max_checkpoints": 3}, {"max_checkpoints": 1})
    with pool.admit_tokens("held", "acme", prompt(1)) as held:  # acme's one checkpoint
        advance(held, 8)
        held.checkpoint_state(8)
    c = pool.admit_tokens("c", "acme", prompt(2), max_new_tokens=8)
    c.begin_prefill()
    advance(c, 8)
    for n, says in ((6, "not a positive multiple of the page size"), (0, "not a positive multiple"),
                    (-4, "-4"), (-2 ** 63, str(-2 ** 63)), (12, "which has 8 written"), (24, "past lease"),
                    (2 ** 63 - 1, str(2 ** 63 - 1))):
        refused(pool, c, n, kvfence.InvalidArgument, says)
    assert issubclass(kvfence.InvalidArgument, ValueError)

    # Over acme's bound: refused and counted, nothing else.
    before = pool.stats()
    with pytest.raises(kvfence.CheckpointCapacity) as e:
        c.checkpoint_state(8)
    assert "MaxCheckpoints is 1" in e.value.message and e.value.name == "KVF_ERR_CHECKPOINT_CAPACITY"
    after = pool.stats()
    assert after["checkpoints"]["capacity_skips"] == before["checkpoints"]["capacity_skips"] + 1
    after["checkpoints"]["capacity_skips"] = before["checkpoints"]["capacity_skips"]
    assert after == before
    # update_tenant keeps the bound; replace_tenant_config replaces it.
    pool.update_tenant("acme", quota_pages=0)
    with pytest.raises(kvfence.CheckpointCapacity):
        c.checkpoint_state(8)
    pool.replace_tenant_config({"name": "acme", "max_checkpoints": 2})
    c.checkpoint_state(8)

    advance(c, AT)
    refused(pool, c, 12, kvfence.InvalidArgument, "has moved past its pages")  # the window slid past
    c.release()
    refused(pool, c, 16, kvfence.LeaseReleased, "released")
    assert c.prefill_checkpoint() == AT  # described until freed
    c.free()
    with pytest.raises(kvfence.InvalidHandle):
        c.checkpoint_state(16)

    # The pool's bound of 3.
    with pool.admit_tokens("d0", "globex", prompt(3)) as d0, pool.admit_tokens("d1", "globex", prompt(4)) as d1:
        advance(d0, 8)
        advance(d1, 8)
        d0.checkpoint_state(8)
        assert ckpts(pool)["live"] == 3
        with pytest.raises(kvfence.CheckpointCapacity) as e:
            d1.checkpoint_state(8)
        assert "Prefix.MaxCheckpoints is 3" in e.value.message
    pool.check()

    plain = pools(cache=False)
    with plain.admit_tokens("p", "acme", prompt(5, 40)) as p:
        p.commit(32)
        assert p.prefill_checkpoint() == 0
        refused(plain, p, 16, kvfence.NoStateGroup, "nothing to checkpoint")
    assert ckpts(plain) == {k: 0 for k in ckpts(plain)}


@pytest.mark.parametrize("prefix,acme,says", [
    ({"max_checkpoints": -1}, None, "Prefix.MaxCheckpoints = -1"),
    ({"max_checkpoints": 2 ** 24 + 1}, None, "Prefix.MaxCheckpoints = 16777217"),
    ({"max_checkpoints": "4"}, None, "prefix.max_checkpoints"),
    ({"checkpoint_slots": -1}, None, "Prefix.CheckpointSlots = -1"),
    ({"checkpoint_slots": 2 ** 24 - 3}, None, "Prefix.CheckpointSlots = 16777213"),
    ({"checkpoint_slots": 2.5}, None, "prefix.checkpoint_slots"),
    (None, {"max_checkpoints": -1}, 'tenant "acme" MaxCheckpoints -1'),
    (None, {"max_checkpoints": 2 ** 24 + 1}, 'tenant "acme" MaxCheckpoints 16777217'),
])
def test_config_refusals_name_the_field(prefix, acme, says):
    with pytest.raises(kvfence.InvalidConfig) as e:
        kvfence.Pool(config(prefix, acme))
    assert says in e.value.message


def test_tenant_refusals_name_the_field(pools):
    with pytest.raises(kvfence.InvalidConfig) as e:
        kvfence.Pool(config({"checkpoint_slots": 2}, cache=False))
    assert "no sliding-window or state group" in e.value.message
    pool = pools({"max_checkpoints": 4}, {"max_checkpoints": 1})
    before = pool.stats()
    for bad, says in (({"name": "initech", "max_checkpoints": -1}, "MaxCheckpoints -1"),
                      ({"name": "initech", "max_checkpoints": "1"}, "max_checkpoints")):
        with pytest.raises(kvfence.InvalidTenant) as e:
            pool.add_tenant_config(bad)
        assert says in e.value.message
        with pytest.raises(kvfence.InvalidTenant):
            pool.replace_tenant_config(dict(bad, name="acme"))
    assert pool.stats() == before
    pool.add_tenant_config({"name": "initech", "max_checkpoints": 2})
    assert [t["name"] for t in pool.stats()["tenants"]] == ["acme", "globex", "initech"]
