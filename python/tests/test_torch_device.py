"""Pools over KV tensors that torch allocated, read and written through
torch, on the CPU and, where there is one, on a CUDA GPU: issue 34's torch
step, which scripts/gpu-check.sh runs on the GPU machine with its own
PyTorch (KVFENCE_REQUIRE_GPU set: a CUDA case that would skip fails).

- Adopted caches, in vLLM's layout ([2, blocks, block_size, heads, dim]
  per layer) and in vLLM's MLA layout (one latent tensor per layer): a
  page handed to a new lease holds only the scrub pattern, read through
  torch, round after round, whatever the last tenant wrote.
- Paged attention over kvfence's block tables: torch's
  scaled_dot_product_attention over the pages the block table gathers
  equals it over the contiguous K/V, within bf16's tolerance (torch
  without it, before 2.0, runs the same softmax by hand).
- On CUDA, a release ordered on torch.cuda.current_stream() while a torch
  kernel queued on it is still to write the pages: the scrub lands after
  that write, and the release does not wait for it.

Each case prints what it timed (pytest -s shows it)."""

import math
import os
import time

import kvfence
import pytest

torch = pytest.importorskip("torch")

TENANTS = [{"name": "a"}, {"name": "b"}]
POISON = {"kind": "poison"}  # bf16's -0: 0x8000
POISON_BITS = -(1 << 15)


def _cuda_or_skip():
    if torch.cuda.is_available():
        return
    if os.environ.get("KVFENCE_REQUIRE_GPU"):
        pytest.fail("KVFENCE_REQUIRE_GPU is set and torch sees no CUDA device")
    pytest.skip("no CUDA device")


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """The torch device of the case; a CUDA case needs a GPU."""
    if request.param == "cuda":
        _cuda_or_skip()
        return "cuda:0"
    return "cpu"


def pool_config(device, pages, block, **extra):
    cfg = {"pages": pages, "max_context_tokens": pages * block, "tenants": TENANTS, "scrub": POISON}
    if device.startswith("cuda"):
        cfg["device"] = {"kind": "cuda", "ordinal": 0}
    cfg.update(extra)
    return cfg


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bits(t):
    return t.contiguous().view(torch.int16)


def layout(kind, device, pages, block):
    """An engine cache of kind, allocated by torch on device, and a
    function giving the tensors that hold a layer's pages, each indexed by
    page first."""
    if kind == "vllm":
        cache = kvfence.layouts.vllm(2, pages, block, 2, 64, dtype="bf16", device=device)
        return cache, lambda layer: [cache.tensors[layer][0], cache.tensors[layer][1]]
    cache = kvfence.layouts.mla(2, pages, block, kv_lora_rank=64, qk_rope_head_dim=16, dtype="bf16", device=device)
    return cache, lambda layer: [cache.tensors[layer]]


@pytest.mark.parametrize("kind", ["vllm", "mla"])
def test_adopted_pages_reach_a_new_lease_holding_only_the_scrub_pattern(device, kind):
    pages, block = 32, 16
    cache, tensors = layout(kind, device, pages, block)
    assert all(t.device.type == device.split(":")[0] for layer in range(2) for t in tensors(layer))
    with kvfence.Pool(pool_config(device, pages, block), adopt=cache) as pool:
        t0 = time.perf_counter()
        for rnd in range(6):
            tenant = "ab"[rnd % 2]
            # Every page, so each round reuses the last round's pages.
            lease = pool.admit("r-%d" % rnd, tenant, pages * block, wait_ms=60000)
            table = lease.block_table()
            assert sorted(table) == list(range(pages))
            idx = torch.as_tensor(table, dtype=torch.long, device=device)
            for layer in range(2):
                for t in tensors(layer):
                    seen = bits(t[idx]).unique().tolist()
                    assert seen == [POISON_BITS], "round %d: a page of layer %d holds %s, not only the scrub word" % (
                        rnd, layer, seen[:8])
                    t[idx] = 1.5 + rnd  # this tenant's KV, on the current stream
            lease.free()  # ordered after torch.cuda.current_stream() on a GPU
        sync(device)
        pool.check()
        print("%s %s: 6 rounds of %d pages in %.1f ms" % (kind, device, pages, (time.perf_counter() - t0) * 1e3))


def attention(q, k, v):
    """Causal attention of q [H, n, D] over k, v [H, n, D]: torch's
    scaled_dot_product_attention, or the same by hand before torch 2.0."""
    sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
    if sdpa is not None:
        return sdpa(q, k, v, is_causal=True)
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    return (scores.masked_fill(mask, float("-inf")).softmax(-1) @ v.float()).to(q.dtype)


def test_paged_attention_over_block_tables_equals_contiguous_attention(device):
    pages, block, heads, dim = 48, 16, 4, 64
    cache = kvfence.layouts.vllm(2, pages, block, heads, dim, dtype="bf16", device=device)
    requests = [("a-1", "a", 37), ("b-1", "b", 130), ("a-2", "a", 16), ("b-2", "b", 201)]
    g = torch.Generator().manual_seed(34)
    with kvfence.Pool(pool_config(device, pages, block), adopt=cache) as pool:
        leases, kv = [], {}
        for rid, tenant, n in requests:
            lease = pool.admit(rid, tenant, n, wait_ms=60000)
            leases.append(lease)
            slots = lease.slot_mapping_tensor(0, n).to(device=device, dtype=torch.long)
            for layer in range(2):
                k = torch.randn(n, heads, dim, generator=g).to(device=device, dtype=torch.bfloat16)
                v = torch.randn(n, heads, dim, generator=g).to(device=device, dtype=torch.bfloat16)
                kc = pool.vllm_kv_cache(layer)  # the pool's view over the engine's tensor
                kc[0].flatten(0, 1)[slots] = k
                kc[1].flatten(0, 1)[slots] = v
                kv[rid, layer] = (k, v)
            lease.commit(n)
        tables = pool.block_tables(leases).to(device=device, dtype=torch.long)
        t0 = time.perf_counter()
        for row, (rid, _, n) in enumerate(requests):
            for layer in range(2):
                k_cache, v_cache = cache.tensors[layer][0], cache.tensors[layer][1]
                used = tables[row, :(n + block - 1) // block]
                k_paged = k_cache[used].flatten(0, 1)[:n]  # [n, heads, dim], gathered by the block table
                v_paged = v_cache[used].flatten(0, 1)[:n]
                q = torch.randn(heads, n, dim, generator=g).to(device=device, dtype=torch.bfloat16)
                k, v = kv[rid, layer]
                out = attention(q, k_paged.transpose(0, 1), v_paged.transpose(0, 1))
                ref = attention(q.float(), k.float().transpose(0, 1), v.float().transpose(0, 1))
                torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
        sync(device)
        print("paged attention %s: %d requests x 2 layers in %.1f ms" % (device, len(requests),
                                                                         (time.perf_counter() - t0) * 1e3))
        for lease in leases:
            lease.free()
        pool.check()


def test_release_on_the_current_stream_scrubs_after_the_kernel_still_writing():
    _cuda_or_skip()
    pages, block = 64, 16
    cache = kvfence.layouts.vllm(2, pages, block, 8, 128, dtype="bf16", device="cuda:0")
    with kvfence.Pool(pool_config("cuda:0", pages, block), adopt=cache) as pool:
        a = pool.admit("writer", "a", pages * block, wait_ms=60000)
        idx = torch.as_tensor(a.block_table(), dtype=torch.long, device="cuda:0")
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()  # an engine stream of its own, not the legacy default
        with torch.cuda.stream(stream):
            # The engine's work: the GPU busy for a while, then a write of
            # every page, both queued on the current stream.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(int(2e8))  # ~100 ms at the H200's clocks
            for layer in range(2):
                cache.tensors[layer][:, idx] = 3.25
            end.record()
            t0 = time.perf_counter()
            a.release()  # ordered after torch.cuda.current_stream(): this stream
            released = time.perf_counter() - t0
            pending = not end.query()
        b = pool.admit("reader", "b", pages * block, wait_ms=60000)  # the same pages, once scrubbed
        assert sorted(b.block_table()) == sorted(idx.tolist())
        torch.cuda.synchronize()
        kernel_ms = start.elapsed_time(end)
        for layer in range(2):
            seen = bits(cache.tensors[layer][:, idx]).unique().tolist()
            assert seen == [POISON_BITS], "layer %d holds %s after the scrub: it did not land after the write" % (
                layer, seen[:8])
        print("release returned in %.3f ms with the engine's write %s; the engine's work took %.1f ms" % (
            released * 1e3, "still pending" if pending else "already done", kernel_ms))
        assert pending, "the engine's kernel had ended before the release: the case proved nothing (a faster GPU?)"
        assert released * 1e3 < kernel_ms / 2, "the release waited for the engine's work instead of ordering after it"
        b.free()
        a.free()
        pool.check()
