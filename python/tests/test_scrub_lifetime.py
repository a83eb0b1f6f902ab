"""After a release, the views of a reused page show only the scrub
pattern; views never outlive the memory they show; a view of a closed
pool raises."""

import ctypes
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings

import kvfence
import pytest
import torch

from caches import BLOCK, Cache


def bits(t):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("kind", ["owned", "vllm", "sglang"])
@pytest.mark.parametrize("dtype,scrub,word", [
    (torch.float32, {"kind": "zero"}, 0),
    (torch.float32, {"kind": "poison"}, -(1 << 31)),          # fp32 -0
    (torch.float32, {"kind": "poison", "pattern": "0x40490fdb"}, 0x40490FDB),  # pi
    (torch.bfloat16, {"kind": "poison"}, -(1 << 15)),         # bf16 -0
])
def test_reused_pages_show_only_the_scrub_pattern(kind, dtype, scrub, word):
    pages = 8
    cache = Cache(kind, dtype, pages, ["a", "b"], scrub=scrub)
    try:
        a = cache.pool.admit("a-1", "a", pages * BLOCK)  # every page
        table = a.block_table()
        assert sorted(table) == list(range(pages))
        for layer in range(2):
            kc, vc = cache.pages(layer)
            kc[table] = 2.5
            vc[table] = -7.0
        a.free()
        b = cache.pool.admit("b-1", "b", pages * BLOCK)  # tenant b gets the same pages
        assert sorted(b.block_table()) == list(range(pages))
        for layer in range(2):
            for t in cache.pages(layer):
                seen = bits(t[b.block_table()]).unique().tolist()
                assert seen == [word], "page holds %s, not only the scrub word %#x" % (seen, word)
        b.free()
    finally:
        cache.close()


@pytest.mark.parametrize("kind", ["owned", "vllm"])
def test_async_host_fills_hand_out_only_scrubbed_pages(kind):
    # "async_fills": a release returns before its scrub; the pages come
    # back, scrubbed, once it has ended (the admission waits for them).
    pages = 8
    cache = Cache(kind, torch.float32, pages, ["a", "b"], scrub={"kind": "poison"},
                  device={"kind": "host", "async_fills": True})
    try:
        for i in range(20):
            a = cache.pool.admit("a-%d" % i, "a", pages * BLOCK, wait_ms=60000)
            for layer in range(2):
                for t in cache.pages(layer):
                    seen = bits(t[a.block_table()]).unique().tolist()
                    assert seen == [-(1 << 31)], "round %d: a page holds %s, not only the scrub word" % (i, seen)
                    t[a.block_table()] = 1.5 + i
            a.free()
    finally:
        cache.close()


def test_an_exception_unwinding_past_live_views_propagates_unchanged():
    # A frame that unwinds drops its views with the exception pending, and
    # torch calls their DLPack deleters then. Called straight into Python,
    # such a deleter failed (SystemError) and left the interpreter corrupt:
    # the close in the finally clause crashed the process. Run apart, so
    # that a crash fails this test, not the session.
    code = textwrap.dedent('''
        import kvfence, torch
        pool = kvfence.Pool({"geometry": {"tokens_per_page": 8, "layers": 1, "kv_heads": 1, "head_dim": 8,
                                          "dtype": "fp32"},
                             "pages": 8, "max_context_tokens": 64, "tenants": [{"name": "a"}]})
        def step():
            try:
                lease = pool.admit("a", "a", 64)
                for view in pool.kv_views(0):
                    raise KeyError("engine failure")
            finally:
                pool.close()
        try:
            step()
        except KeyError as e:
            print("propagated", e.args[0])
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stdout.strip()) == (0, "propagated engine failure"), r.stdout + r.stderr


def test_sglang_padding_page_is_never_touched_by_kvfence():
    cache = Cache("sglang", torch.float32, 4, ["a"], scrub={"kind": "poison"})
    try:
        kb = cache.engine.tensors[0][0]
        kb[:BLOCK] = 3.0  # the engine's padding page, after the pool's initial scrub
        a = cache.pool.admit("a", "a", 4 * BLOCK)
        cache.write(0, a.slot_mapping_tensor(0, 4 * BLOCK), torch.ones(4 * BLOCK, 2, 8), torch.ones(4 * BLOCK, 2, 8))
        a.free()
        assert torch.all(kb[:BLOCK] == 3.0)
        assert bits(kb[BLOCK:]).unique().tolist() == [-(1 << 31)]
    finally:
        cache.close()


def geometry_pool(pages=8, scrub=None):
    cfg = {"geometry": {"tokens_per_page": BLOCK, "layers": 1, "kv_heads": 2, "head_dim": 8, "dtype": "fp32"},
           "pages": pages, "max_context_tokens": pages * BLOCK, "tenants": [{"name": "a"}]}
    if scrub:
        cfg["scrub"] = scrub
    return kvfence.Pool(cfg)


def test_view_of_a_closed_pool_raises():
    pool = geometry_pool()
    rv = pool.region(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        pool.close()
    assert not pool.destroyed  # rv holds the memory
    for call in (rv.tensor, rv.numpy, rv.memoryview, rv.exporter, lambda: pool.region(0),
                 lambda: pool.kv_views(0), pool.regions, pool.stats, lambda: pool.admit("x", "a", 4),
                 lambda: pool.admit_tokens("x", "a", [1, 2, 3])):
        with pytest.raises(kvfence.PoolClosed):
            call()
    del rv
    assert pool.destroyed


@pytest.mark.parametrize("view", ["torch", "numpy", "memoryview"])
def test_a_view_alive_at_close_keeps_the_memory_until_it_dies(view):
    pool = geometry_pool(scrub={"kind": "poison"})
    lease = pool.admit("a", "a", 3 * BLOCK)
    table = lease.block_table()
    rv = pool.region(0)
    if view == "torch":
        v = rv.tensor()
        v[table] = 1.0
    elif view == "numpy":
        v = rv.numpy()
        v[table] = 1.0
    else:
        v = rv.memoryview()
        v[: rv.page_bytes] = b"\x01" * rv.page_bytes
    del rv
    handle = pool._state.handle
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pool.close()
    assert any(issubclass(x.category, ResourceWarning) for x in w)
    assert not pool.destroyed, "the pool was destroyed under a live view"
    with pytest.raises(kvfence.PoolClosed):
        pool.region(0)
    # The lease was released at close: its pages hold the poison (fp32 -0).
    if view == "torch":
        assert v.view(torch.int32).unique().tolist() == [-(1 << 31)]
    else:
        raw = bytes(v) if view == "memoryview" else v.tobytes()
        assert set(memoryview(raw).cast("I")) == {0x80000000}
    assert kvfence._lib.pool_check(handle) == 0  # the Go pool still exists
    del v
    gc.collect()
    assert pool.destroyed
    assert kvfence._lib.pool_check(handle) == kvfence.ERR_INVALID_HANDLE
    lease.free()


def test_a_pool_dropped_without_close_is_destroyed_once_unreachable():
    pool = geometry_pool()
    handle = pool._state.handle
    del pool
    gc.collect()
    assert kvfence._lib.pool_check(handle) == kvfence.ERR_INVALID_HANDLE


def test_lease_context_manager_and_collection_free_the_pages():
    pool = geometry_pool()
    try:
        with pool.admit_tokens("r", "a", list(range(20))) as lease:
            assert pool.stats()["in_use_pages"] == 3
        assert pool.stats()["in_use_pages"] == 0 and lease._h == 0
        dropped = pool.admit("d", "a", 9)
        del dropped
        gc.collect()
        s = pool.stats()
        assert s["in_use_pages"] == 0 and s["live_leases"] == 0
        pool.check()
    finally:
        pool.close()


def test_receiver_of_a_closed_pool_refuses_imports():
    pool = geometry_pool()
    rcv = pool.receiver(b"k" * 32)
    view = pool.region(0).tensor()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        pool.close()  # deferred: the view keeps the Go pool
    with pytest.raises(kvfence.PoolClosed):
        rcv.begin(b"manifest")
    del view


def test_view_shape_must_fill_a_page_and_leaves_the_pool_unchanged():
    pool = geometry_pool()
    try:
        before = pool.stats()
        with pytest.raises(ValueError, match="page shape"):
            pool.region(0).tensor(page_shape=(BLOCK, 2, 7))
        with pytest.raises(ValueError, match="unknown dtype"):
            pool.region(0).tensor(dtype="fp13")
        with pytest.raises(IndexError):
            pool.region(2)
        assert pool.stats() == before
        t = pool.region(1).tensor(dtype=torch.int32, page_shape=(BLOCK * 16,))
        assert t.shape == (8, BLOCK * 16) and t.dtype == torch.int32
        assert t.data_ptr() == pool.regions()[1]["base"]
        del t
    finally:
        pool.close()


def test_region_addresses_are_the_pools():
    pool = geometry_pool()
    try:
        regs = pool.regions()
        k, v = pool.kv_views(0)
        assert (k.data_ptr(), v.data_ptr()) == (regs[0]["base"], regs[1]["base"])
        assert k.shape == (8, BLOCK, 2, 8) and k.stride(0) * 4 == regs[0]["stride"]
        mv = pool.region(0).memoryview()
        assert len(mv) == regs[0]["pages"] * regs[0]["page_bytes"]
        assert ctypes.addressof(ctypes.c_char.from_buffer(mv)) == regs[0]["base"]
        del k, v, mv
    finally:
        pool.close()


def test_a_rank_worker_dropped_without_close_no_longer_touches_its_shard():
    """A RankWorker adopts the engine's buffers ("memory") and keeps them
    referenced until close(). Dropped without close(), it must close the
    Go worker before its references go: otherwise the worker, still
    connected, scrubs into buffers Python may free and reuse. Here the
    test keeps the buffers, to see whether anything writes them."""
    tmp = tempfile.mkdtemp(prefix="kvft")
    connect = "unix:" + os.path.join(tmp, "s")
    pages, page_bytes = 8, 64
    cfg = {"geometry": {"tokens_per_page": 4, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp32"},
           "pages": pages, "max_context_tokens": 4 * pages, "tenants": [{"name": "a"}],
           "device": {"kind": "remote", "listen": connect, "ranks": 1, "report_timeout_ms": 5000,
                      "accept_timeout_ms": 20000}}
    made = []
    t = threading.Thread(target=lambda: made.append(kvfence.Pool(cfg)))  # waits for the rank
    t.start()
    shard = [bytearray(pages * page_bytes) for _ in range(2)]
    try:
        w = kvfence.RankWorker(connect, 0, [{"memory": m, "pages": pages, "page_bytes": page_bytes} for m in shard],
                               connect_timeout_ms=20000)
        t.join()
        pool = made[0]
        del w
        gc.collect()
        for m in shard:
            m[:] = b"\xab" * len(m)
        lease = pool.admit("r", "a", 4 * pages)  # every page
        try:
            lease.release()
        except kvfence.KvfenceError:
            pass  # the rank is gone: the fill failed
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the scrub has run on the rank, or failed
            s = pool.stats()
            if s["fault"] or s["free_pages"] == pages:
                break
            time.sleep(0.005)
        assert all(m == b"\xab" * len(m) for m in shard), "the dropped worker wrote its shard"
        lease.free()
        try:
            pool.close()
        except kvfence.KvfenceError:
            pass  # the final scrub had no rank either
    finally:
        t.join()
        shutil.rmtree(tmp, ignore_errors=True)
