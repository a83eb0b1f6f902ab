#!/usr/bin/env python3
"""Two tenants share one kvfence pool through the C ABI.

    go build -buildmode=c-shared -o capi/libkvfence.so ./capi
    python3 examples/python/demo.py
"""

import os
import sys

sys.dont_write_bytecode = True  # keep the source tree clean when CI runs this
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvfence  # noqa: E402

CONFIG = {
    # 4 layers, 8 KV heads of 64, bf16, 16 tokens per page.
    "geometry": {"tokens_per_page": 16, "layers": 4, "kv_heads": 8, "head_dim": 64, "dtype": "bf16"},
    "pages": 256,
    "max_context_tokens": 4096,
    "tenants": [{"name": "acme", "quota_pages": 128}, {"name": "globex", "quota_pages": 64}],
    "scrub": {"kind": "poison"},  # the dtype's -0: finite, and visible to an auditor
}


def main():
    print("libkvfence", kvfence.version())
    with kvfence.Pool(CONFIG) as pool:
        a = pool.admit("acme-1", "acme", prompt_tokens=100, max_new_tokens=60)
        g = pool.admit("globex-1", "globex", prompt_tokens=40, max_new_tokens=8)
        for name, lease in (("acme-1", a), ("globex-1", g)):
            info = lease.info()
            print("%-9s %d pages for %d tokens, block table %s"
                  % (name, info["pages"], info["prompt_tokens"] + info["max_new_tokens"], lease.block_table()))
        assert not set(a.block_table()) & set(g.block_table()), "tenants share a page"
        print("slot mapping of globex-1 tokens 14..18:", g.slot_mapping(14, 18))

        # Fail closed: globex's quota is 64 pages (1024 tokens).
        try:
            pool.admit("globex-2", "globex", prompt_tokens=2000)
        except kvfence.KvfenceError as e:
            print("refused: %s need=%d limit=%d permanent=%s" % (e.name, e.need, e.limit, e.permanent))
            print("  ", e.message)

        a.commit(100)
        a.release()
        a.free()
        g.release()
        g.free()
        pool.check()
        s = pool.stats()
        print("stats: admitted=%d refused=%d free=%d/%d pages, scrubbed %d pages in %d fills"
              % (s["admitted"], s["refused"]["total"], s["free_pages"], s["total_pages"],
                 s["scrub"]["pages_scrubbed"], s["scrub"]["fills"]))
        for t in s["tenants"]:
            print("  tenant %-7s used %d of %d pages" % (t["name"], t["used_pages"], t["quota_pages"]))


if __name__ == "__main__":
    main()
