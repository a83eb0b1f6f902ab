"""The worker side of kvfence's KV connector: a kvfence RankWorker per
tensor-parallel rank over KV cache tensors in vLLM's layouts (adopted, on
the CPU here), serving the scheduler's pool over remote ranks, its scrubs
launched at the step hook (wait_for_save) one step late."""

import threading
import time
from types import SimpleNamespace

import kvfence
import pytest
from kvfence.vllm import KVCacheManager, resolver
from kvfence.vllm._plugin import ConnectorScheduler, ConnectorWorker, kv_regions, plugin_config, pool_config

from vllm_replay import Request, RequestStatus

torch = pytest.importorskip("torch")

TP, LAYERS, BLOCKS, BS, HEADS, DIM = 2, 2, 16, 4, 1, 4
NAMES = ["model.layers.%d.self_attn.attn" % i for i in range(LAYERS)]


def transfer_config(addr, **extra):
    cfg = {"listen": addr, "tenant_resolver": "static:a", "tenants": [{"name": "a"}, {"name": "b"}]}
    cfg.update(extra)
    return SimpleNamespace(kv_connector_extra_config={"kvfence": cfg})


def wait_clean(pool, workers, timeout=10):
    """Steps the workers until the pool has no page waiting for its scrub."""
    deadline = time.monotonic() + timeout
    while pool.stats()["quarantined_pages"]:
        assert time.monotonic() < deadline, "scrubs never completed"
        for w in workers:
            w.wait_for_save()
        time.sleep(0.005)


@pytest.fixture
def group(tmp_path):
    """A scheduler's pool over TP ranks, each a ConnectorWorker over its
    vLLM flash-attention tensors [2, blocks, block_size, heads, dim]."""
    addr = "unix:" + str(tmp_path / "kvf.sock")
    caches = [{n: torch.full((2, BLOCKS, BS, HEADS, DIM), 7.0) for n in NAMES} for _ in range(TP)]
    workers = [ConnectorWorker(addr, r, NAMES, BLOCKS, step_lag=1, connect_timeout_ms=30000) for r in range(TP)]
    for w, c in zip(workers, caches):
        w.register_kv_caches(c)
    cfg = plugin_config(transfer_config(addr))
    pc = pool_config(cfg, block_size=BS, layers=LAYERS, kv_heads=HEADS * TP, head_dim=DIM, dtype=torch.float32,
                     num_blocks=BLOCKS, max_model_len=BLOCKS * BS, ranks=TP)
    pool = kvfence.Pool(pc)  # waits for both ranks, and their scrub of every page
    for w in workers:
        assert w.ready(10)
    yield pool, workers, caches
    # Destroying the pool scrubs its cached pages on every rank: the
    # engine's workers step while it runs.
    done = threading.Event()

    def step():
        while not done.is_set():
            for w in workers:
                w.wait_for_save()
            time.sleep(0.002)

    t = threading.Thread(target=step)
    t.start()
    try:
        pool.close()
    finally:
        done.set()
        t.join()
    for w in workers:
        w.close()


def pages_of(caches, pages):
    return [t[:, p] for c in caches for t in c.values() for p in pages]


def test_rank_workers_scrub_vllm_tensors_after_a_step_between(group):
    pool, workers, caches = group
    assert all((t == 0).all() for c in caches for t in c.values()), "the pool scrubs adopted memory first"
    mgr = KVCacheManager(pool, BLOCKS * BS, resolver("static:a"))
    conn = ConnectorScheduler()
    conn.kvf_bind(mgr)
    reqs = [Request("r%d" % i, [i + 1] * 10, 2) for i in range(2)]
    for r in reqs:
        blocks, hit, _ = mgr.get_computed_blocks(r)
        assert mgr.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
        r.status, r.num_computed_tokens = RequestStatus.RUNNING, r.num_tokens
    assert [w.wait_for_save() for w in workers] == [0, 0]  # the step that computed them
    gone, kept = (mgr.lease_of(r.request_id).block_table() for r in reqs)
    for view in pages_of(caches, gone + kept):
        view.fill_(9.0)  # the requests' KV, on every rank
    reqs[0].status = RequestStatus.FINISHED_STOPPED
    mgr.free(reqs[0])
    assert conn.has_pending_push_work(), "the engine keeps stepping while a scrub waits"
    time.sleep(0.3)  # the batch reaches the ranks
    assert [w.wait_for_save() for w in workers] == [0, 0], "a scrub launched at the first step after it arrived"
    assert all((v == 9).all() for v in pages_of(caches, gone))
    assert [w.wait_for_save() for w in workers] == [1, 1], "the second step launches it"
    wait_clean(pool, workers)
    assert not conn.has_pending_push_work()
    cached, scrubbed = gone[:10 // BS], gone[10 // BS:]  # the full prompt pages stay in the prefix cache
    assert all((v == 0).all() for v in pages_of(caches, scrubbed)), "released pages scrubbed on every rank"
    assert all((v == 9).all() for v in pages_of(caches, cached))
    assert all((v == 9).all() for v in pages_of(caches, kept)), "a live lease's pages untouched"
    reqs[1].status = RequestStatus.FINISHED_ABORTED
    mgr.free(reqs[1])
    wait_clean(pool, workers)
    pool.check()


def test_kv_regions_of_vllm_layouts():
    n, bs, h, d = 6, 4, 2, 8
    flash = torch.zeros(2, n, bs, h, d)
    flashinfer = torch.zeros(n, 2, bs, h, d)
    hnd = torch.zeros(2, n, h, bs, d).permute(0, 1, 3, 2, 4)  # logical NHD over an HND layout
    page = bs * h * d * 4
    for t, k_at, v_at, stride in ((flash, lambda p: flash[0, p], lambda p: flash[1, p], page),
                                  (flashinfer, lambda p: flashinfer[p, 0], lambda p: flashinfer[p, 1], 2 * page),
                                  (hnd, lambda p: hnd[0, p], lambda p: hnd[1, p], page)):
        k, v = kv_regions({"l0": t}, ["l0"], n)
        for reg, at in ((k, k_at), (v, v_at)):
            assert reg["pages"] == n and reg["page_bytes"] == page and reg["stride"] == stride
            for p in range(n):
                assert reg["base"] + p * reg["stride"] == at(p).data_ptr()
    with pytest.raises(ValueError, match="MLA"):
        kv_regions({"l0": torch.zeros(n, bs, 576)}, ["l0"], n)
    shared = torch.zeros(2, n, bs, h, d)
    with pytest.raises(ValueError, match="share"):
        kv_regions({"l0": shared, "l1": shared}, ["l0", "l1"], n)
    strided = torch.zeros(2, n, bs, 2 * h, d)[:, :, :, :h]  # a block's K is not one span
    with pytest.raises(ValueError, match="contiguous"):
        kv_regions({"l0": strided}, ["l0"], n)


def test_plugin_config_refuses_what_it_does_not_know():
    with pytest.raises(ValueError, match="kvfence"):
        plugin_config(SimpleNamespace(kv_connector_extra_config={}))
    with pytest.raises(ValueError, match="unknown keys"):
        plugin_config(transfer_config("unix:/x", pages=3))
    with pytest.raises(ValueError, match="tenant_resolver"):
        plugin_config(transfer_config("unix:/x", tenant_resolver=""))
    cfg = plugin_config(transfer_config("unix:/run/kvf-{dp}.sock", salt="v2"))
    pc = pool_config(cfg, block_size=16, layers=4, kv_heads=8, head_dim=64, dtype="torch.bfloat16", num_blocks=100,
                     max_model_len=4096, ranks=4, data_parallel_rank=3)
    assert pc["device"] == {"kind": "remote", "listen": "unix:/run/kvf-3.sock", "ranks": 4}
    assert pc["geometry"]["dtype"] == "bf16" and pc["sizing"]["mode"] == "on_demand"
    with pytest.raises(ValueError, match="dtype"):
        pool_config(cfg, block_size=16, layers=4, kv_heads=8, head_dim=64, dtype="torch.int8", num_blocks=100,
                    max_model_len=4096, ranks=4)
