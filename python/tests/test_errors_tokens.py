"""Exceptions carry the Go error's name and numbers and leave the pool as
it was; token IDs in any form reach Go as the same int32s; a bad form is
refused before anything is admitted."""

import array

import kvfence
import numpy as np
import pytest
import torch
from kvfence.errors import BY_STATUS, STATUSES

from caches import BLOCK


def pool(pages=16, tenants=({"name": "a", "quota_pages": 4}, {"name": "b"}), **extra):
    cfg = {"geometry": {"tokens_per_page": BLOCK, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp16"},
           "pages": pages, "max_context_tokens": pages * BLOCK, "tenants": list(tenants)}
    cfg.update(extra)
    return kvfence.Pool(cfg)


def test_status_table_names_match_the_librarys():
    for code, cname, go in STATUSES:
        assert kvfence.status_name(code) == cname, (code, go)
        assert BY_STATUS[code].go_error == go and BY_STATUS[code].__name__ == go.split(".Err")[1]


def test_every_status_the_library_knows_has_an_exception_class():
    for code in range(1, 256):
        name = kvfence.status_name(code)
        if name != "KVF_ERR_UNKNOWN_STATUS":
            assert code in BY_STATUS, "status %d (%s) has no exception class" % (code, name)


def test_quota_refusal_carries_go_error_and_numbers_and_changes_nothing():
    with pool() as p:
        keep = p.admit("a-0", "a", BLOCK)  # one of tenant a's 4 pages
        before = p.stats()
        with pytest.raises(kvfence.ExceedsQuota) as ei:
            p.admit("a-1", "a", 4 * BLOCK)
        e = ei.value
        assert isinstance(e, kvfence.AdmissionError) and isinstance(e, kvfence.KvfenceError)
        assert (e.status, e.name, e.go_error) == (25, "KVF_ERR_EXCEEDS_QUOTA", "kvcache.ErrExceedsQuota")
        assert (e.need, e.limit) == (4, 4) and e.retryable and not e.permanent
        assert "quota" in e.message
        after = p.stats()
        assert after["refused"]["total"] == before["refused"]["total"] + 1
        for k in ("free_pages", "in_use_pages", "live_leases", "admitted"):
            assert after[k] == before[k], k
        with pytest.raises(kvfence.ExceedsQuota) as ei:
            p.admit("a-2", "a", 5 * BLOCK)
        assert ei.value.permanent  # more than the whole quota
        keep.free()


def test_exhausted_pool_is_retryable_and_over_long_is_permanent():
    with pool(pages=4, tenants=[{"name": "a"}, {"name": "b"}]) as p:
        hold = p.admit("b-0", "b", 4 * BLOCK)
        with pytest.raises(kvfence.PoolExhausted) as ei:
            p.admit("a-0", "a", BLOCK)
        assert ei.value.retryable and (ei.value.need, ei.value.have) == (1, 0)
        with pytest.raises(kvfence.ExceedsMaxContext) as ei:
            p.admit("a-1", "a", 4 * BLOCK + 1)
        assert ei.value.permanent and ei.value.need == 4 * BLOCK + 1 and ei.value.limit == 4 * BLOCK
        hold.free()


def test_bad_config_is_invalid_config_naming_the_field():
    with pytest.raises(kvfence.InvalidConfig) as ei:
        kvfence.Pool({"geometry": {"tokens_per_page": 16}, "pages": 4, "max_context_tokens": 64,
                      "tenants": [{"name": "a"}], "bogus": 1})
    assert isinstance(ei.value, ValueError) and "bogus" in ei.value.message


def test_cuda_pool_without_a_driver_is_no_device():
    with pytest.raises(kvfence.NoDevice) as ei:
        kvfence.Pool({"geometry": {"tokens_per_page": 16, "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "bf16"},
                      "pages": 4, "max_context_tokens": 64, "tenants": [{"name": "a"}],
                      "device": {"kind": "cuda", "ordinal": 0}})
    assert ei.value.go_error == "cudaops.ErrNoDevice" and ei.value.message


IDS = [(11 * i + 3) % 50000 for i in range(3 * BLOCK + 2)]


@pytest.mark.parametrize("form", ["list", "tuple", "array", "torch32", "torch64", "numpy32", "numpy64", "range"])
def test_token_ids_in_any_form_derive_the_same_page_keys(form):
    ids = {"list": list(IDS), "tuple": tuple(IDS), "array": array.array("i", IDS),
           "torch32": torch.tensor(IDS, dtype=torch.int32), "torch64": torch.tensor(IDS, dtype=torch.int64),
           "numpy32": np.array(IDS, dtype=np.int32), "numpy64": np.array(IDS, dtype=np.int64),
           "range": None}[form]
    if ids is None:
        global_ids = list(range(100, 100 + 3 * BLOCK + 2))
        first, ids = global_ids, range(100, 100 + 3 * BLOCK + 2)
    else:
        first = IDS
    with pool() as p:
        a = p.admit_tokens("first", "b", first)
        a.commit(len(first))
        assert a.cache_prefix(len(first)) == 3 * BLOCK
        a.free()
        b = p.admit_tokens("second", "b", ids)
        assert b.hit_tokens() == 3 * BLOCK
        b.free()


@pytest.mark.parametrize("bad,exc", [
    (torch.tensor([1, 2, 1 << 31]), ValueError),
    (np.array([-(1 << 31) - 1, 2]), ValueError),
    ([1, 2, 1 << 40], ValueError),
    (torch.tensor([1.0, 2.0]), TypeError),
    (torch.ones(2, 2, dtype=torch.int32), ValueError),
    (torch.ones(3, dtype=torch.int32).to_sparse(), TypeError),  # its values are not at data_ptr()
    (torch.ones(3, dtype=torch.int32, device="meta"), ValueError),  # no data at all
    ("1234", TypeError),
    (b"\x01\x00\x00\x00", TypeError),
])
def test_token_ids_that_are_not_int32s_are_refused_before_admission(bad, exc):
    with pool() as p:
        before = p.stats()
        with pytest.raises(exc):
            p.admit_tokens("r", "b", bad)
        assert p.stats() == before


def test_release_is_ordered_after_torchs_current_stream(monkeypatch):
    """Lease.release(), the context manager, free(), slide_windows() and
    RankWorker.step() order after torch.cuda.current_stream() by
    default; its default stream (cuda_stream 0) goes as STREAM_LEGACY,
    never 0 ("all work of the context": a stall)."""
    seen = []
    real_release = kvfence._lib.lease_release

    def release(h, stream, event):
        seen.append(("release", stream))
        return real_release(h, stream, event)

    class Stream:
        cuda_stream = 0

    monkeypatch.setattr(kvfence._lib, "lease_release", release)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    assert kvfence.default_stream() == kvfence.STREAM_LEGACY
    with pool() as p:
        p.device = ("cuda", 0)  # free() releases with an ordering only where one means something
        p.admit("r1", "b", 4).release()
        Stream.cuda_stream = 0x7F00DEAD
        with p.admit("r2", "b", 4):
            pass
        p.admit("r3", "b", 4).release(stream=0x1234)
        lease = p.admit("r4", "b", 4)
        lease.release(stream=0, event=0)
        lease.free()  # released already: no second release ordering
    assert [s for _, s in seen[:4]] == [kvfence.STREAM_LEGACY, 0x7F00DEAD, 0x1234, 0], seen

    stepped = []
    monkeypatch.setattr(kvfence._lib, "rank_step", lambda h, s, e, n: stepped.append(s) or 0)
    w = kvfence.RankWorker.__new__(kvfence.RankWorker)
    w._h = 1
    w.step()
    w.step(stream=5)
    w._h = 0
    assert stepped == [0x7F00DEAD, 5]


def test_a_name_with_a_nul_byte_is_refused_not_cut_to_another_tenants():
    """C strings end at the first NUL: "a\\0x" would reach Go as "a", and
    be admitted as (and charged to) tenant a. Every string argument that
    travels as a C string is refused, with the status a bad value of it
    has, before anything reaches the library."""
    with pool() as p:
        before = p.stats()
        for bad in ("a\0x", b"a\0x"):
            with pytest.raises(kvfence.InvalidRequest, match="NUL"):
                p.admit("r", bad, BLOCK)
            with pytest.raises(kvfence.InvalidRequest, match="NUL"):
                p.admit("r\0x", "a", BLOCK)
            with pytest.raises(kvfence.InvalidRequest, match="NUL"):
                p.admit_tokens("r", bad, IDS)
            with pytest.raises(kvfence.InvalidRequest, match="NUL"):
                p.admit_tokens(bad, "a", IDS, block_table=torch.zeros(8, dtype=torch.int32))
            with pytest.raises(kvfence.InvalidRequest, match="NUL"):
                p.admit_tokens("r", "b", IDS, adapter=bad)
            with pytest.raises(kvfence.InvalidTenant, match="NUL"):
                p.add_tenant(bad)
            with pytest.raises(kvfence.UnknownTenant, match="NUL"):
                p.update_tenant(bad, quota_pages=1)
        assert p.stats() == before
        with p.admit_tokens("r", "b", IDS) as lease:
            with pytest.raises(kvfence.InvalidArgument, match="NUL"):
                lease.group_table("kv\0x")


def test_stats_that_grow_between_the_size_query_and_the_copy_are_read_again(monkeypatch):
    """Pool.stats() asks the library for the JSON's size, then copies it.
    Another thread may change the pool in between (a new tenant, a count
    that gains a digit), and the JSON outgrow the buffer: that is a
    reason to ask again, not a BufferTooSmall for the caller."""
    real = kvfence._lib.pool_stats_json
    with pool() as p:
        added = []

        def stats_json(h, buf, n, need):
            st = real(h, buf, n, need)
            if len(added) < 2:  # after each of the first two calls: another thread's change
                added.append("t%d" % len(added))
                p.add_tenant(added[-1])
            return st

        monkeypatch.setattr(kvfence._lib, "pool_stats_json", stats_json)
        names = [t["name"] for t in p.stats()["tenants"]]
        assert added == ["t0", "t1"] and set(added) <= set(names)


def test_preempt_with_another_prompt_is_refused_and_the_lease_stays_live():
    with pool(pages=8, sizing={"mode": "on_demand", "headroom_tokens": 1}) as p:
        prompt = list(range(7, 7 + 2 * BLOCK))
        lease = p.admit_tokens("r", "b", prompt, max_new_tokens=BLOCK)
        lease.commit(len(prompt))
        forged = list(prompt)
        forged[1] += 1
        with pytest.raises(kvfence.errors.InvalidArgument, match="admitted with"):
            lease.preempt(forged)
        assert lease.live
        assert lease.preempt(prompt) == len(prompt)
        again = p.admit_tokens("r2", "b", forged, max_new_tokens=1)
        assert again.hit_tokens() == 0  # the pages hold the admitted prompt's KV, not the forged one's
        again.release()
        p.check()
