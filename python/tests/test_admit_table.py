"""Pool.admit_tokens(..., block_table=row): the admission writes the
lease's block table into the engine's row in the same call
(kvf_admit_tokens_table, ABI 6), or, with an older library, in a second
one with the same checks first. Each test runs both ways."""

import array
import ctypes

import kvfence
import numpy as np
import pytest
import torch

from caches import BLOCK

# 16 pages of BLOCK tokens; tenant a may hold 4 of them.
CONFIG = {"geometry": {"tokens_per_page": BLOCK, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp16"},
          "pages": 16, "max_context_tokens": 16 * BLOCK, "tenants": [{"name": "a", "quota_pages": 4}, {"name": "b"}]}
IDS = torch.tensor([(7 * i + 5) % 1000 for i in range(3 * BLOCK + 2)], dtype=torch.int32)  # 4 pages


@pytest.fixture(params=["one call", "two calls"])
def calls(request, monkeypatch):
    """The ABI-6 call, or the path of a library older than ABI 6."""
    if request.param == "one call":
        if kvfence._lib.admit_tokens_table is None:
            pytest.skip("libkvfence older than ABI 6")
    else:
        monkeypatch.setattr(kvfence._lib, "admit_tokens_table", None)
    return request.param


def untouched(n, kind="torch"):
    if kind == "torch":
        return torch.full((n,), -7, dtype=torch.int32)
    if kind == "numpy":
        return np.full(n, -7, dtype=np.int32)
    return array.array("i", [-7] * n)


@pytest.mark.parametrize("kind", ["torch", "numpy", "array"])
def test_admission_writes_the_leases_own_table_into_the_row(calls, kind):
    with kvfence.Pool(CONFIG) as pool:
        row = untouched(8, kind)
        lease = pool.admit_tokens("r1", "b", IDS, max_new_tokens=BLOCK, block_table=row)  # 5 pages
        assert lease.table_len == 5
        assert list(row[:5]) == lease.block_table() and list(row[5:]) == [-7] * 3
        # A prefix hit shows as the shared pages leading the next table.
        lease.commit(len(IDS))
        assert lease.cache_prefix(len(IDS)) == 3 * BLOCK
        row2 = untouched(5, kind)
        second = pool.admit_tokens("r2", "b", IDS, max_new_tokens=BLOCK, block_table=row2)
        assert second.hit_tokens() == 3 * BLOCK and second.table_len == 5
        assert list(row2[:3]) == list(row[:3]) and list(row2[3:]) != list(row[3:])
        lease.free()
        second.free()
        pool.check()


def test_a_lease_admitted_without_a_row_has_no_table_len():
    with kvfence.Pool(CONFIG) as pool:
        with pool.admit_tokens("r", "b", IDS) as lease:
            assert lease.table_len == 0
        with pool.admit("r", "b", 3) as lease:
            assert lease.table_len == 0


def test_a_short_row_admits_nothing_and_says_how_long_it_must_be(calls):
    with kvfence.Pool(CONFIG) as pool:
        before = pool.stats()
        short = untouched(4)  # 26 + 8 tokens: 5 pages
        with pytest.raises(kvfence.BufferTooSmall) as ei:
            pool.admit_tokens("r1", "b", IDS, max_new_tokens=BLOCK, block_table=short)
        assert (ei.value.need, ei.value.have) == (5, 4) and ei.value.go_error == "bridge.ErrBufferTooSmall"
        assert short.tolist() == [-7] * 4
        assert pool.stats() == before  # no lease, no refusal counted
        pool.check()
        # The ID was not taken: the right row admits it.
        lease = pool.admit_tokens("r1", "b", IDS, max_new_tokens=BLOCK, block_table=untouched(5))
        assert lease.table_len == 5
        lease.free()


def test_an_on_demand_lease_needs_room_to_grow_but_fills_what_it_holds(calls):
    cfg = dict(CONFIG, sizing={"mode": "on_demand", "headroom_tokens": 2})
    with kvfence.Pool(cfg) as pool:
        # 26 + 40 tokens at most: 9 pages; 26 + 2 now: 4 pages.
        with pytest.raises(kvfence.BufferTooSmall) as ei:
            pool.admit_tokens("r", "b", IDS, max_new_tokens=40, block_table=untouched(8))
        assert ei.value.need == 9
        row = untouched(9)
        lease = pool.admit_tokens("r", "b", IDS, max_new_tokens=40, block_table=row)
        assert lease.table_len == 4 and row[:4].tolist() == lease.block_table() and row[4:].tolist() == [-7] * 5
        lease.commit(len(IDS))
        lease.grow(BLOCK)
        assert lease.write_block_table(row) == 5 and lease.table_len == 4  # table_len: at admission
        lease.free()


@pytest.mark.parametrize("case", ["past max context", "negative max new", "no tokens"])
def test_a_request_the_admission_refuses_gets_that_refusal_even_with_a_short_row(calls, case):
    ids, max_new, exc = {"past max context": (IDS, 16 * BLOCK, kvfence.ExceedsMaxContext),
                         "negative max new": (IDS, -1, kvfence.InvalidRequest),
                         "no tokens": (torch.zeros(0, dtype=torch.int32), 0, kvfence.InvalidRequest)}[case]
    with kvfence.Pool(CONFIG) as pool:
        row = untouched(1)
        with pytest.raises(exc):
            pool.admit_tokens("r", "b", ids, max_new_tokens=max_new, block_table=row)
        assert row.tolist() == [-7] and pool.stats()["live_leases"] == 0


def test_a_refused_admission_leaves_the_row_unwritten(calls):
    with kvfence.Pool(CONFIG) as pool:
        hold = pool.admit("hold", "a", BLOCK)  # 1 of a's 4 pages
        row = untouched(8)
        with pytest.raises(kvfence.ExceedsQuota) as ei:
            pool.admit_tokens("r", "a", IDS, block_table=row)  # 4 pages: over the 3 left
        assert ei.value.retryable and ei.value.need == 4 and row.tolist() == [-7] * 8
        with pytest.raises(kvfence.DuplicateRequest):
            pool.admit_tokens("hold", "b", IDS, block_table=row)
        with pytest.raises(kvfence.UnknownTenant):
            pool.admit_tokens("r", "nobody", IDS, block_table=row)
        assert row.tolist() == [-7] * 8 and pool.stats()["live_leases"] == 1
        hold.free()
        pool.check()


@pytest.mark.parametrize("bad,exc", [
    (torch.zeros(8, dtype=torch.int64), ValueError),
    (torch.zeros(16, dtype=torch.int32)[::2], ValueError),  # not contiguous
    (torch.zeros(8, dtype=torch.int32, device="meta"), ValueError),
    (torch.zeros(8, dtype=torch.int32).to_sparse(), ValueError),
    (np.zeros(8, dtype=np.int64), ValueError),
    ([0] * 8, TypeError),
    (bytearray(32), TypeError),
])
def test_a_row_that_is_not_writable_int32_is_refused_before_admission(calls, bad, exc):
    with kvfence.Pool(CONFIG) as pool:
        before = pool.stats()
        with pytest.raises(exc):
            pool.admit_tokens("r", "b", IDS, block_table=bad)
        assert pool.stats() == before


def test_a_closed_pool_refuses_before_reading_anything():
    pool = kvfence.Pool(CONFIG)
    pool.close()
    with pytest.raises(kvfence.PoolClosed):
        pool.admit_tokens("r", "b", IDS, block_table=untouched(8))


@pytest.mark.parametrize("arg", ["max_new_tokens", "wait_ms"])
def test_a_zero_that_is_not_the_int_zero_is_still_refused_by_ctypes(arg):
    """The int 0 passes as a prepared c_int64 (a shortcut); 0.0 must not
    take it and be passed as 0, but be refused as any float is."""
    with kvfence.Pool(CONFIG) as pool:
        for bad in (0.0, 1.5):
            with pytest.raises(ctypes.ArgumentError):
                pool.admit_tokens("r", "b", IDS, **{arg: bad})
            with pytest.raises(ctypes.ArgumentError):
                pool.admit_tokens("r", "b", IDS, block_table=untouched(8), **{arg: bad})
        assert pool.stats()["live_leases"] == 0
        with pool.admit_tokens("r", "b", IDS, **{arg: 0}) as lease:
            assert lease.table_len == 0
