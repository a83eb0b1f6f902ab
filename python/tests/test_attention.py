"""Paged attention over kvfence's host pages equals attention over
contiguous K/V of the same values, for a batch of requests of several
tenants, in the pool's own memory and in vLLM's and SGLang's layouts."""

import pytest
import torch

from caches import BLOCK, LAYERS, Cache
from conftest import TinyModel, contiguous_attention, paged_attention, tolerance

REQUESTS = [("a-1", "a", 13), ("b-1", "b", 40), ("a-2", "a", 7), ("c-1", "c", 64), ("b-2", "b", 33)]
KINDS = ["owned", "vllm", "sglang"]


def prompt(rid, n):
    base = sum(map(ord, rid)) * 7
    return [(base + 31 * i) % 1000 for i in range(n)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_over_kvfence_pages_equals_contiguous_attention(kind, dtype):
    cache = Cache(kind, dtype, pages=48, tenants=["a", "b", "c"])
    models = [TinyModel(seed=layer) for layer in range(LAYERS)]
    try:
        leases, kvs = [], {}
        for rid, tenant, n in REQUESTS:
            ids = prompt(rid, n)
            lease = cache.pool.admit_tokens(rid, tenant, ids, max_new_tokens=4)
            leases.append((rid, tenant, ids, lease))
        # Pages of different requests never overlap, whatever the tenant.
        tables = [set(lease.block_table()) for *_, lease in leases]
        for i in range(len(tables)):
            for j in range(i):
                assert not tables[i] & tables[j]

        # Prefill: every prompt's K/V written at its slots, layer by layer.
        for layer, m in enumerate(models):
            for rid, _, ids, lease in leases:
                k, v, q = m.kvq(ids)
                cache.write(layer, cache.slots(lease, 0, len(ids)), k, v)
                kvs[rid, layer] = (k.to(dtype), v.to(dtype), q)
        for *_, lease in leases:
            lease.commit(lease.info()["prompt_tokens"])

        bt = cache.pool.block_tables([lease for *_, lease in leases])
        lens = [len(ids) for _, _, ids, _ in leases]
        for layer in range(LAYERS):
            kc, vc = cache.pages(layer)
            outs = paged_attention([kvs[rid, layer][2] for rid, *_ in leases], [0] * len(leases), lens, bt, kc, vc)
            for (rid, *_), out in zip(leases, outs):
                k, v, q = kvs[rid, layer]
                ref = contiguous_attention(q, k, v, 0)
                torch.testing.assert_close(out, ref, atol=tolerance(dtype), rtol=tolerance(dtype))

        # One decode step: each request writes its next token at the slot
        # after its prompt and attends over prompt + token.
        new_ids = [7 * i + 3 for i in range(len(leases))]
        for layer, m in enumerate(models):
            for (rid, _, ids, lease), t in zip(leases, new_ids):
                k, v, q = m.kvq([t], start=len(ids))
                cache.write(layer, cache.slots(lease, len(ids), len(ids) + 1), k, v)
                pk, pv, _ = kvs[rid, layer]
                kvs[rid, layer] = (torch.cat([pk, k.to(dtype)]), torch.cat([pv, v.to(dtype)]), q)
        bt = cache.pool.block_tables([lease for *_, lease in leases], dtype=torch.int64)
        for layer in range(LAYERS):
            kc, vc = cache.pages(layer)
            outs = paged_attention([kvs[rid, layer][2] for rid, *_ in leases], lens, [n + 1 for n in lens], bt, kc, vc)
            for (rid, _, ids, _), out in zip(leases, outs):
                k, v, q = kvs[rid, layer]
                ref = contiguous_attention(q, k, v, len(ids))
                torch.testing.assert_close(out, ref, atol=tolerance(dtype), rtol=tolerance(dtype))
        for *_, lease in leases:
            lease.free()
        cache.pool.check()
    finally:
        cache.close()


def test_block_tables_tensor_is_each_lease_table_padded():
    cache = Cache("owned", torch.float32, pages=32, tenants=["a"])
    try:
        a = cache.pool.admit("x", "a", 3 * BLOCK + 1)
        b = cache.pool.admit("y", "a", BLOCK)
        bt = cache.pool.block_tables([a, b], pad=-1)
        assert bt.dtype == torch.int32 and bt.shape == (2, 4)
        assert bt[0].tolist() == a.block_table()
        assert bt[1].tolist() == b.block_table() + [-1, -1, -1]
        with pytest.raises(ValueError, match="does not fit width 2"):
            cache.pool.block_tables([a, b], width=2)
        sm = cache.pool.slot_mappings([(a, 0, 3), (b, 5, 8)])
        assert sm.dtype == torch.int64
        assert sm.tolist() == a.slot_mapping(0, 3) + b.slot_mapping(5, 8)
        a.free()
        b.free()
    finally:
        cache.close()


def test_slot_mappings_checks_every_span_before_writing_any(monkeypatch):
    """The output holds the sum of the spans' lengths: a reversed span
    (end < start) makes it shorter than the spans before it, which must
    not be written into it (they would run past its end): every span is
    checked before the first C call. Spans given by a generator are all
    written too."""
    import kvfence
    calls = []
    real = kvfence._lib.lease_slot_mapping
    monkeypatch.setattr(kvfence._lib, "lease_slot_mapping", lambda *a: calls.append(a[1:5]) or real(*a))
    cache = Cache("owned", torch.float32, pages=32, tenants=["a"])
    try:
        a = cache.pool.admit("x", "a", 4 * BLOCK)
        for spans in ([(a, 0, 4 * BLOCK), (a, 5, 2)], [(a, 0, 3), (a, 2, 1), (a, 0, 3)], [(a, 1, 0)]):
            with pytest.raises(ValueError, match="token range"):
                cache.pool.slot_mappings(spans)
            assert calls == [], "a C call wrote %s before a bad span was seen" % calls
        # Spans from a generator, which can be read only once, are every
        # slot written, not an uninitialized tensor.
        want = a.slot_mapping(0, 3) + a.slot_mapping(BLOCK, 2 * BLOCK)
        assert cache.pool.slot_mappings(sp for sp in [(a, 0, 3), (a, BLOCK, 2 * BLOCK)]).tolist() == want
        a.free()
    finally:
        cache.close()


def test_batch_tables_refuse_a_lease_of_another_pool(monkeypatch):
    """A lease's page IDs index its own pool's memory: in another pool's
    batch they name pages of that pool's other leases (other tenants'),
    which the kernel would read and write. Refused before any C call."""
    import kvfence
    calls = []
    for name in ("lease_block_table", "lease_slot_mapping"):
        real = getattr(kvfence._lib, name)
        monkeypatch.setattr(kvfence._lib, name, lambda *a, real=real: calls.append(a[0]) or real(*a))
    mine = Cache("owned", torch.float32, pages=32, tenants=["a"])
    other = Cache("owned", torch.float32, pages=32, tenants=["a"])
    try:
        a = mine.pool.admit("x", "a", 2 * BLOCK)
        b = other.pool.admit("x", "a", 2 * BLOCK)
        with pytest.raises(kvfence.InvalidArgument, match="another pool"):
            mine.pool.block_tables([a, b])
        with pytest.raises(kvfence.InvalidArgument, match="another pool"):
            mine.pool.slot_mappings([(a, 0, 3), (b, 0, 3)])
        assert calls == []
        assert other.pool.block_tables([b])[0].tolist() == b.block_table()
        a.free()
        b.free()
    finally:
        mine.close()
        other.close()


def test_write_block_table_fills_the_engines_row_or_refuses_a_short_one():
    import array

    import kvfence
    import numpy as np
    cache = Cache("owned", torch.float32, pages=32, tenants=["a"])
    try:
        lease = cache.pool.admit("x", "a", 3 * BLOCK + 1)  # 4 pages
        want = lease.block_table()
        for out in (torch.full((8,), -1, dtype=torch.int32), np.full(8, -1, dtype=np.int32), array.array("i", [-1] * 8)):
            assert lease.write_block_table(out) == 4
            assert list(out[:4]) == want and list(out[4:]) == [-1] * 4
        short = torch.full((3,), -1, dtype=torch.int32)
        with pytest.raises(kvfence.BufferTooSmall) as ei:
            lease.write_block_table(short)
        assert ei.value.need == 4 and short.tolist() == [-1, -1, -1]
        for bad in (torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int32).to_sparse(),
                    torch.zeros(8, dtype=torch.int32, device="meta"), torch.zeros(16, dtype=torch.int32)[::2]):
            with pytest.raises(ValueError):
                lease.write_block_table(bad)
        with pytest.raises(TypeError):
            lease.write_block_table([0] * 8)
        lease.free()
    finally:
        cache.close()
