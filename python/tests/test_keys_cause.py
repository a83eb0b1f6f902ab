"""ABI 8 through the package: extra key material per prompt page
(admit_tokens(page_extra=)), dropping the prefix cache, and the cause of a
PoolExhausted refusal."""

import array

import kvfence
import pytest


def pool(pages=32, tenants=({"name": "a"},)):
    return kvfence.Pool({"geometry": {"tokens_per_page": 4, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp16"},
                         "pages": pages, "max_context_tokens": pages * 4, "tenants": list(tenants)})


def publish(p, rid, toks, **kw):
    lease = p.admit_tokens(rid, "a", toks, **kw)
    lease.commit(len(toks))
    lease.cache_prefix(len(toks))
    return lease


def test_page_extra_and_clear():
    toks = list(range(100, 126))  # 6 full pages + 2
    with pool() as p:
        pub = publish(p, "pub", toks, page_extra=[None, None, b"cat", b"cat"])
        for rid, extra, want in (("same", [None, None, b"cat", b"cat"], 24), ("dog", [b"", None, b"dog"], 8),
                                 ("none", None, 8)):
            with p.admit_tokens(rid, "a", toks, page_extra=extra) as lease:
                assert lease.hit_tokens() == want, rid
        with pytest.raises(kvfence.InvalidRequest):
            p.admit_tokens("bad", "a", toks, page_extra=[None] * 8)  # 7 pages
        with pytest.raises(TypeError):
            p.admit_tokens("bad", "a", toks, page_extra=["cat"])
        row = array.array("i", [0] * 16)
        with p.admit_tokens("row", "a", toks, page_extra=[b"x"], block_table=row) as lease:
            assert lease.table_len == 7 and list(row[:7]) == lease.block_table()
        p.clear_prefix_cache()
        with p.admit_tokens("after", "a", toks, page_extra=[None, None, b"cat", b"cat"]) as lease:
            assert lease.hit_tokens() == 0
        pub.free()
        p.check()


def test_exhausted_cause():
    with pool(8, ({"name": "a"}, {"name": "b", "reserved_pages": 4})) as p:
        with p.admit("a1", "a", 16) as a1:
            with pytest.raises(kvfence.PoolExhausted) as e:
                p.admit("a2", "a", 4)
            assert e.value.cause == "reserved" and e.value.retryable
            with p.admit("b1", "b", 16):
                with pytest.raises(kvfence.PoolExhausted) as e:
                    p.admit("a2", "a", 4)
                assert e.value.cause is None
            assert a1.live
