"""A handoff of a hybrid pool through the package: every cache group
crosses (the per-token pages, the sliding window's pages still inside the
window at the prompt's end, the state slot in ranges), and the decode
lease holds exactly the prefill's bytes in every group, read back through
the package's region views. A decode pool of another spec or another
tensor-parallel shard refuses the manifest, a range out of order ends the
import, and an import without a group's units is refused naming it.

The pools are host pools of a miniature hybrid model: a per-token group of
MLA latents and indexer keys, a sliding window of 8 tokens, and a state
group whose slot (9,096 bytes) is larger than two ranges of 4,096.
"""

import pytest

import kvfence

torch = pytest.importorskip("torch")

KEY = b"test hybrid handoff key: 32 or more bytes"
PROMPT = 22  # 6 pages of 4 tokens; the window's pages 3..5; one state slot: 10 units
STATE = 9000


def config(shard=None, state_bytes=STATE, pages=64):
    cache = {"model": "py-hybrid", "groups": [
        {"name": "kv", "kind": "per_token", "tokens_per_page": 4, "regions": [
            {"name": "l1.latent", "dtype": "bf16", "page_bytes": 128},
            {"name": "l1.indexer", "dtype": "fp8_e4m3", "also_holds": ["fp32"], "page_bytes": 80}]},
        {"name": "swa", "kind": "sliding_window", "tokens_per_page": 4, "window_tokens": 8, "regions": [
            {"name": "l2.k", "dtype": "bf16", "page_bytes": 64},
            {"name": "l2.v", "dtype": "bf16", "page_bytes": 64}]},
        {"name": "state", "kind": "state", "regions": [
            {"name": "l0.conv", "dtype": "bf16", "page_bytes": 96},
            {"name": "l0.state", "dtype": "fp32", "page_bytes": state_bytes}]}]}
    if shard is not None:
        cache["shard"] = shard
    return {"cache": cache, "max_leases": 4, "pages": pages, "max_context_tokens": 128,
            "scrub": {"kind": "poison"}, "tenants": [{"name": "acme"}]}


GROUPS = ("kv", "swa", "state")
REGIONS = {"kv": (0, 1), "swa": (2, 3), "state": (4, 5)}  # the pool's regions of each group


def pages_of(pool, lease, prompt=PROMPT):
    """{(group, logical page, region k): memoryview of that page} for the
    prompt's units of every group, through the pool's region views."""
    views = [pool.region(i).memoryview() for i in range(6)]
    regs = pool.regions()
    out = {}
    for g in GROUPS:
        first, table = lease.group_table(g)
        n = {"kv": (prompt + 3) // 4, "swa": (prompt + 3) // 4 - first, "state": 1}[g]
        for j in range(n):
            for k, r in enumerate(REGIONS[g]):
                off = table[j] * regs[r]["stride"]
                out[(g, first + j, k)] = views[r][off:off + regs[r]["page_bytes"]]
    return out


def stamp(seed, key, n):
    g, lp, k = key
    return bytes((seed * 131 + GROUPS.index(g) * 61 + lp * 29 + k * 17 + i * 7 + (i >> 8)) & 0xFF for i in range(n))


def prefill(pool, rid, seed, prompt=PROMPT):
    lease = pool.admit(rid, "acme", prompt, max_new_tokens=8)
    lease.begin_prefill()
    lease.commit(prompt)
    lease.slide_windows()
    for key, page in pages_of(pool, lease, prompt).items():
        page[:] = stamp(seed, key, len(page))
    lease.finish_prefill()
    return lease


def holds(pool, lease, seed):
    """The pages of the prompt's units whose bytes are not seed's."""
    return [key for key, page in pages_of(pool, lease).items() if bytes(page) != stamp(seed, key, len(page))]


def in_use(pool):
    return sum(g["in_use"] for g in pool.stats()["groups"])


@pytest.fixture
def pools():
    made = []

    def make(**kw):
        made.append(kvfence.Pool(config(**kw)))
        return made[-1]
    yield make
    for p in made:
        p.close()


def test_extents_describe_every_group(pools):
    src, dst = pools(), pools()
    lease = prefill(src, "ext", 1)
    with dst.receiver(KEY) as rcv, lease.export(KEY, max_new_tokens=8, ttl_ms=10000) as exp:
        want = [
            {"group": "kv", "kind": "per_token", "first_unit": 0, "units": 6, "unit_bytes": 208, "first_page": 0},
            {"group": "swa", "kind": "sliding_window", "first_unit": 6, "units": 3, "unit_bytes": 128, "first_page": 3},
            {"group": "state", "kind": "state", "first_unit": 9, "units": 1, "unit_bytes": 9096, "first_page": 0},
        ]
        assert exp.extents() == want
        info = exp.info()
        assert (info["pages"], info["page_bytes"], info["units"], info["bytes"]) == (6, 208, 10, 6 * 208 + 3 * 128 + 9096)
        with rcv.begin(exp.manifest()) as imp:
            assert imp.extents() == want and imp.units() == 10 and imp.nbytes() == exp.nbytes()
            assert [imp.unit_bytes(u) for u in (0, 5, 6, 8, 9, 10, -1)] == [208, 208, 128, 128, 9096, 0, 0]
    lease.free()


def test_hybrid_handoff_moves_every_group(pools):
    src, dst = pools(), pools()
    lease = prefill(src, "r1", 1)
    with dst.receiver(KEY) as rcv, lease.export(KEY, max_new_tokens=8, ttl_ms=10000) as exp:
        assert holds(src, lease, 1) == []
        every = torch.empty(exp.nbytes(), dtype=torch.uint8)
        assert exp.read_units(0, out=every) is every  # into a tensor, in place
        again = exp.read_units()  # a new bytearray of every unit
        assert bytes(again) == every.numpy().tobytes()
        ext = {e["group"]: e for e in exp.extents()}
        kv, swa, state = ext["kv"], ext["swa"], ext["state"]
        at = exp.nbytes() - state["unit_bytes"]
        # The page call reads the per-token group: units 0..5.
        assert exp.read_pages(0, 6) == bytes(again[:6 * 208])
        # A run across two groups, and the slot in ranges of any size.
        assert bytes(exp.read_units(5, 2)) == bytes(again[5 * 208:6 * 208 + 128])
        slot = bytearray()
        for off in range(0, state["unit_bytes"], 1000):
            slot += exp.read_unit_range(state["first_unit"], off, min(1000, state["unit_bytes"] - off))
        assert slot == again[at:]
        tail = bytearray(96)
        assert exp.read_unit_range(9, 9000, out=tail) is tail and tail == again[-96:]

        message = bytes(again)  # as it arrived: read-only, its ranges written in place
        with rcv.begin(exp.manifest()) as imp:
            imp.write_pages(0, message[:kv["units"] * 208])
            imp.write_units(swa["first_unit"], memoryview(message)[6 * 208:at])
            mv = memoryview(message)
            for off in range(0, state["unit_bytes"], 4096):
                imp.write_unit_range(state["first_unit"], off, mv[at + off:at + min(off + 4096, state["unit_bytes"])])
            dec = imp.complete()
        exp.ack()
    lease.free()
    # The decode lease holds exactly the prefill's bytes in every group,
    # its window where the prompt's is.
    assert dec.phase() == "prefilled" and dec.info()["written_tokens"] == PROMPT
    assert dec.group_table("swa")[0] == 3
    assert holds(dst, dec, 1) == []
    dec.free()
    for p in (src, dst):
        p.check()
        assert in_use(p) == 0


def test_another_spec_or_shard_is_refused(pools):
    src = pools(shard={"rank": 0, "size": 2})
    lease = prefill(src, "r", 1)
    with lease.export(KEY, max_new_tokens=8, ttl_ms=10000) as exp:
        manifest = exp.manifest()
        for pool, exc, says in [
            (pools(shard={"rank": 1, "size": 2}), kvfence.ShardMismatch, ("rank 0 of 2", "rank 1 of 2")),
            (pools(), kvfence.ShardMismatch, ("rank 0 of 2", "unsharded")),
            (pools(shard={"rank": 0, "size": 2}, state_bytes=STATE - 4), kvfence.GeometryMismatch, ("9000", "8996")),
        ]:
            with pool.receiver(KEY) as rcv:
                with pytest.raises(exc) as e:
                    rcv.begin(manifest)
                assert all(s in str(e.value) for s in says), str(e.value)
            pool.check()
            assert in_use(pool) == 0
        same = pools(shard={"rank": 0, "size": 2})
        with same.receiver(KEY) as rcv, rcv.begin(manifest) as imp:
            imp.write_units(0, exp.read_units())
            dec = imp.complete()
        assert holds(same, dec, 1) == []
        dec.free()
        exp.ack()
    lease.free()


@pytest.mark.parametrize("shard,says", [
    ({}, "cache.shard: size missing"),
    ({"size": 2}, "cache.shard: rank missing"),
    ({"rank": 0, "size": 0}, "cache.shard: size 0"),
    ({"rank": 2, "size": 2}, "cache.shard: rank 2 of size 2, want 0 to 1"),
    ({"rank": -1, "size": 2}, "cache.shard: rank -1"),
    ({"rank": 0, "size": 2, "heads": 1}, 'unknown field "heads"'),
])
def test_bad_shard_is_refused_naming_the_field(shard, says):
    with pytest.raises(kvfence.InvalidConfig) as e:
        kvfence.Pool(config(shard=shard))
    assert says in str(e.value)


def transfer(pools, rid, seed):
    src, dst = pools(), pools()
    lease = prefill(src, rid, seed)
    exp = lease.export(KEY, max_new_tokens=8, ttl_ms=10000)
    rcv = dst.receiver(KEY)
    return src, dst, lease, exp, rcv


def test_a_range_out_of_order_ends_the_import(pools):
    src, dst, lease, exp, rcv = transfer(pools, "order", 2)
    every = exp.read_units()
    slot = memoryview(every)[-9096:]
    imp = rcv.begin(exp.manifest())
    # The caller's arithmetic: refused, the import live.
    for unit, off, n in [(9, 100, 4096), (9, 0, 4000), (9, 8192, 905), (10, 0, 4096), (-1, 0, 1)]:
        with pytest.raises(kvfence.InvalidArgument):
            imp.write_unit_range(unit, off, bytes(n))
    assert imp.info()["live"]
    imp.write_unit_range(9, 0, slot[:4096])
    with pytest.raises(kvfence.InvalidArgument) as e:
        imp.write_unit_range(9, 8192, slot[8192:])  # skips 4096..8191
    assert "in order" in str(e.value)
    assert not imp.info()["live"]
    with pytest.raises(kvfence.StaleTransfer):
        imp.write_unit_range(9, 4096, slot[4096:8192])
    imp.free()
    dst.check()
    assert in_use(dst) == 0
    # The request may be imported again, whole this time.
    with rcv.begin(exp.manifest()) as imp:
        imp.write_units(0, every)
        dec = imp.complete()
    assert holds(dst, dec, 2) == []
    dec.free()
    exp.ack()
    exp.free()
    rcv.close()
    lease.free()


def test_an_import_without_a_group_is_incomplete_naming_it(pools):
    src, dst, lease, exp, rcv = transfer(pools, "partial", 3)
    every = exp.read_units()
    # The page calls alone move the per-token group.
    with rcv.begin(exp.manifest()) as imp:
        imp.write_pages(0, every[:6 * 208])
        with pytest.raises(kvfence.IncompleteTransfer) as e:
            imp.complete()
        assert 'cache group "swa": 0 of 3' in str(e.value)
        assert not imp.info()["live"]
    assert in_use(dst) == 0
    # Every unit but the state slot.
    with rcv.begin(exp.manifest()) as imp:
        imp.write_units(0, every[:-9096])
        with pytest.raises(kvfence.IncompleteTransfer) as e:
            imp.complete()
        assert 'cache group "state": 0 of 1' in str(e.value)
    # A unit twice.
    with rcv.begin(exp.manifest()) as imp:
        imp.write_units(6, every[6 * 208:6 * 208 + 128])
        with pytest.raises(kvfence.DuplicatePage):
            imp.write_units(6, every[6 * 208:6 * 208 + 128])
        assert not imp.info()["live"]
    dst.check()
    assert in_use(dst) == 0
    exp.abort()
    exp.free()
    rcv.close()
    lease.free()
    src.check()
    assert in_use(src) == 0


def test_bad_runs_leave_the_transfer_live(pools):
    src, dst, lease, exp, rcv = transfer(pools, "runs", 4)
    with rcv.begin(exp.manifest()) as imp:
        out = bytearray(b"\x5a" * 400)
        for first, n in [(-1, 208), (10, 128), (5, 208 + 64), (0, 207), (1 << 62, 208)]:
            with pytest.raises(kvfence.InvalidArgument):
                exp.read_units(first, out=memoryview(out)[:n])
            with pytest.raises(kvfence.InvalidArgument):
                imp.write_units(first, bytes(n))
        assert out == bytearray(b"\x5a" * 400)
        with pytest.raises(kvfence.InvalidArgument):
            exp.read_units(0, count=2, out=bytearray(208))  # count and out disagree
        with pytest.raises(TypeError):
            exp.read_units(0, out=bytes(208))  # not writable
        assert exp.info()["live"] and imp.info()["live"]
        imp.write_units(0, exp.read_units())
        dec = imp.complete()
    assert holds(dst, dec, 4) == []
    dec.free()
    exp.ack()
    exp.free()
    rcv.close()
    lease.free()
