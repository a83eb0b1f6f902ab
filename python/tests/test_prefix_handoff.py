"""A prefix-cache hit gives the same attention output without recomputing
the shared pages; a handoff from a prefill pool to a decode pool gives
the same output on the decode side."""

import pytest
import torch

from caches import BLOCK, Cache
from conftest import TinyModel, contiguous_attention, paged_attention, tolerance

KEY = b"test handoff key: 32 or more secret bytes"
SHARED = [(17 * i + 5) % 1000 for i in range(4 * BLOCK)]  # 4 full pages


def attend(cache, lease, q, q_start, seq_len, layer=0):
    kc, vc = cache.pages(layer)
    bt = cache.pool.block_tables([lease])
    return paged_attention([q], [q_start], [seq_len], bt, kc, vc)[0]


@pytest.mark.parametrize("kind", ["owned", "vllm", "sglang"])
def test_prefix_hit_gives_the_same_output_without_recomputing_shared_pages(kind):
    dtype = torch.float32
    cache = Cache(kind, dtype, pages=32, tenants=["a", "b"])
    try:
        first = SHARED + [1, 2, 3, 4, 5]
        m = TinyModel()
        a = cache.pool.admit_tokens("a-1", "a", first, max_new_tokens=8)
        assert a.hit_tokens() == 0
        k, v, _ = m.kvq(first)
        cache.write(0, cache.slots(a, 0, len(first)), k, v)
        a.commit(len(first))
        assert a.cache_prefix(len(first)) == len(SHARED)  # the 4 full pages
        shared_pages = a.block_table()[:4]
        a.free()  # published pages stay cached for tenant a's domain

        kc, _ = cache.pages(0)
        before = kc[shared_pages].clone()
        second = SHARED + [9, 8, 7, 6, 5, 4, 3, 2, 1]
        m2 = TinyModel()
        b = cache.pool.admit_tokens("a-2", "a", second, max_new_tokens=8)
        hit = b.hit_tokens()
        assert hit == len(SHARED) and b.block_table()[:4] == shared_pages
        k, v, q = m2.kvq(second[hit:], start=hit)  # prefill starts after the hit
        assert m2.computed == len(second) - hit
        cache.write(0, cache.slots(b, hit, len(second)), k, v)
        assert torch.equal(cache.pages(0)[0][shared_pages], before), "the shared pages were written"
        out = attend(cache, b, q, hit, len(second))

        fresh = TinyModel()
        fk, fv, fq = fresh.kvq(second)
        ref = contiguous_attention(fq[hit:], fk, fv, hit)
        torch.testing.assert_close(out, ref, atol=tolerance(dtype), rtol=tolerance(dtype))

        other = cache.pool.admit_tokens("b-1", "b", second, max_new_tokens=8)
        assert other.hit_tokens() == 0, "another tenant's domain shared a page"
        assert not set(other.block_table()) & set(shared_pages)
        other.free()
        b.free()
        cache.pool.check()
    finally:
        cache.close()


@pytest.mark.parametrize("kind", ["owned", "vllm", "sglang"])
def test_handoff_from_prefill_pool_gives_the_same_output_on_the_decode_pool(kind):
    dtype = torch.bfloat16
    prefill, decode = Cache(kind, dtype, 32, ["a"]), Cache(kind, dtype, 32, ["a"])
    try:
        ids = [(13 * i + 1) % 1000 for i in range(3 * BLOCK + 5)]
        m = TinyModel()
        lease = prefill.pool.admit_tokens("r", "a", ids)
        lease.begin_prefill()
        k, v, _ = m.kvq(ids)
        prefill.write(0, prefill.slots(lease, 0, len(ids)), k, v)
        prefill.write(1, prefill.slots(lease, 0, len(ids)), k * 2, v * 2)
        lease.commit(len(ids))
        lease.finish_prefill()

        with decode.pool.receiver(KEY) as rcv, lease.export(KEY, max_new_tokens=8, ttl_ms=10000) as exp:
            info = exp.info()
            buf = torch.empty(info["pages"] * info["page_bytes"], dtype=torch.uint8)
            exp.read_pages(0, info["pages"], out=buf)  # into a tensor, no copy of bytes in between
            with rcv.begin(exp.manifest()) as imp:
                imp.write_pages(0, buf)
                dec = imp.complete()
            exp.ack()
        lease.free()
        assert dec.phase() == "prefilled" and dec.info()["written_tokens"] == len(ids)

        # Decode: the next token's K/V at the decode lease's slot, attention over all.
        nk, nv, nq = m.kvq([42], start=len(ids))
        decode.write(0, decode.slots(dec, len(ids), len(ids) + 1), nk, nv)
        out = attend(decode, dec, nq, len(ids), len(ids) + 1)
        ref = contiguous_attention(nq, torch.cat([k, nk]).to(dtype), torch.cat([v, nv]).to(dtype), len(ids))
        torch.testing.assert_close(out, ref, atol=tolerance(dtype), rtol=tolerance(dtype))
        # Layer 1 moved too, page for page.
        kc1, _ = decode.pages(1)
        got = kc1[dec.block_table_tensor().long()].flatten(0, 1)[: len(ids)]
        torch.testing.assert_close(got.float(), (k * 2).to(dtype).float(), atol=0, rtol=0)
        dec.free()
        assert prefill.pool.stats()["in_use_pages"] == 0 and decode.pool.stats()["in_use_pages"] == 0
    finally:
        prefill.close()
        decode.close()
