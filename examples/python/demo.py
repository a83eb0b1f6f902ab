#!/usr/bin/env python3
"""Two tenants share one kvfence pool through the C ABI; a prefix is
shared between two requests of one tenant; a prompt's KV is handed off
from a prefill pool to a decode pool.

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

        rs = pool.regions()
        print("regions: %d (K and V of 4 layers), %d pages of %d bytes each"
              % (len(rs), rs[0]["pages"], rs[0]["page_bytes"]))
        prefix_demo(pool)
    handoff_demo()
    growth_demo()
    cache_groups_demo()


def prefix_demo(pool):
    """Two requests of acme with the same system prompt: the second shares
    the first's computed pages instead of recomputing them."""
    system = list(range(5000, 5000 + 96))  # 6 pages of 16 tokens
    first = pool.admit_tokens("chat-1", "acme", system + [1, 2, 3, 4], max_new_tokens=32)
    print("prefix: chat-1 hit %d tokens (cold)" % first.hit_tokens())
    first.commit(100)  # the engine computed the whole prompt
    print("prefix: chat-1 published %d tokens" % first.cache_prefix(100))
    second = pool.admit_tokens("chat-2", "acme", system + [9, 8, 7, 6, 5], max_new_tokens=32)
    hit = second.hit_tokens()
    print("prefix: chat-2 hit %d tokens, prefill starts at token %d" % (hit, hit))
    assert hit == 96 and first.block_table()[:6] == second.block_table()[:6]
    other = pool.admit_tokens("chat-3", "globex", system + [1, 2, 3, 4], max_new_tokens=32)
    print("prefix: globex's identical prompt hit %d tokens (another domain)" % other.hit_tokens())
    assert other.hit_tokens() == 0
    for lease in (first, second, other):
        lease.free()
    dom = [d for d in pool.stats()["prefix"]["domains"] if d["name"] == "tenant:acme"][0]
    print("prefix: domain %s hit %d pages, missed %d" % (dom["name"], dom["hit_pages"], dom["miss_pages"]))


KEY = b"demo handoff key: 32 or more secret bytes"


def handoff_demo():
    """Prefill in one pool, decode in another, bytes carried by the caller
    (here in memory; in a deployment over any transport)."""
    with kvfence.Pool(CONFIG) as prefill, kvfence.Pool(CONFIG) as decode, decode.receiver(KEY) as rcv:
        lease = prefill.admit("req-7", "acme", prompt_tokens=300, max_new_tokens=0)
        lease.begin_prefill()
        lease.commit(300)  # ... the engine writes the prompt's KV ...
        lease.finish_prefill()
        with lease.export(KEY, max_new_tokens=200, ttl_ms=10000) as exp:
            manifest = exp.manifest()
            info = exp.info()
            pages = exp.read_pages(0, info["pages"])
            print("handoff: manifest %d bytes, %d pages of %d bytes, checksum %08x"
                  % (len(manifest), info["pages"], info["page_bytes"], info["checksum"]))

            forged = bytearray(manifest)
            forged[40] ^= 1
            try:
                rcv.begin(bytes(forged))
            except kvfence.KvfenceError as e:
                print("handoff: forged manifest refused:", e.name)

            with rcv.begin(manifest) as imp:
                imp.write_pages(0, pages)
                decoded = imp.complete()
            exp.ack()
        li = decoded.info()
        print("handoff: decode lease %s, %d pages, %d prompt tokens written, room for %d new"
              % (decoded.phase(), li["pages"], li["written_tokens"], li["max_new_tokens"]))
        try:
            rcv.begin(manifest)
        except kvfence.KvfenceError as e:
            print("handoff: replay refused:", e.name)
        decoded.free()
        lease.free()
        prefill.check()
        decode.check()
        print("handoff: prefill pool %d/%d pages free, decode pool %d/%d"
              % (prefill.stats()["free_pages"], prefill.stats()["total_pages"],
                 decode.stats()["free_pages"], decode.stats()["total_pages"]))


def growth_demo():
    """A lease sized on demand holds its prompt and grows as it generates;
    refused growth means preempt, and preemption keeps the computed pages
    for the request's next admission."""
    config = dict(CONFIG, pages=16, max_context_tokens=256, tenants=[{"name": "acme"}, {"name": "globex"}],
                  sizing={"mode": "on_demand", "headroom_tokens": 16})
    with kvfence.Pool(config) as pool:
        other = pool.admit("batch-1", "globex", prompt_tokens=96)  # 6 of the 16 pages
        prompt = list(range(7000, 7000 + 40))
        lease = pool.admit_tokens("chat-1", "acme", prompt, max_new_tokens=200)
        print("on demand: %d pages for a 40-token prompt of up to 240 tokens" % lease.info()["pages"])
        lease.commit(40)
        written = list(prompt)
        while True:
            try:
                lease.grow(16)  # room for the next 16 tokens
            except kvfence.KvfenceError as e:
                print("growth refused (%s: need %d, have %d): preempt" % (e.name, e.need, e.have))
                break
            written += list(range(9000 + len(written), 9000 + len(written) + 16))
            lease.commit(len(written))
        kept = lease.preempt(written)
        lease.free()
        other.release()
        other.free()
        again = pool.admit_tokens("chat-1", "acme", written, max_new_tokens=240 - len(written))
        print("preempted after %d tokens, kept %d; readmitted with %d tokens shared"
              % (len(written), kept, again.hit_tokens()))
        assert again.hit_tokens() == kept - (16 if kept == len(written) else 0)
        again.release()
        again.free()
        pool.check()

def cache_groups_demo():
    """A model that is not plain K/V: an MLA latent and its sparse-attention
    indexer keys per token, and a recurrent state slot per request, in one
    pool (a "cache" spec). The latent cache is the engine's own buffer, laid
    out as vLLM lays out a layer's [num_blocks, block_size, latent]; the pool
    adopts it and scrubs its pages in place."""
    import ctypes
    import struct
    blocks, page = 32, 16 * 576 * 2  # 16 tokens of a 512+64 bf16 latent
    latent = (ctypes.c_uint8 * (blocks * page))()
    indexer = (ctypes.c_uint8 * (blocks * 16 * 132))()  # every region of a spec is adopted, or none
    state = (ctypes.c_uint8 * (2 * 16 * 128 * 128 * 4))()

    def memory(buf):
        return {"base": hex(ctypes.addressof(buf)), "bytes": len(buf)}
    config = {
        "cache": {"model": "demo-hybrid", "groups": [
            {"name": "kv", "kind": "per_token", "tokens_per_page": 16, "regions": [
                {"name": "layer.0.latent", "dtype": "bf16", "page_bytes": page, "memory": memory(latent)},
                {"name": "layer.0.indexer", "dtype": "fp8_e4m3", "also_holds": ["fp32"], "page_bytes": 16 * 132,
                 "memory": memory(indexer)}]},
            {"name": "state", "kind": "state", "regions": [
                {"name": "layer.1.state", "dtype": "fp32", "page_bytes": 16 * 128 * 128 * 4, "memory": memory(state)}]}]},
        "max_leases": 2, "pages": blocks, "max_context_tokens": 512,
        "tenants": [{"name": "acme"}, {"name": "globex"}],
        "scrub": {"kind": "poison"},
    }
    with kvfence.Pool(config) as pool:
        rs = pool.regions()
        assert rs[0]["base"] == ctypes.addressof(latent), "the pool's region is the engine's buffer"
        a = pool.admit("a", "acme", prompt_tokens=40)
        b = pool.admit("b", "globex", prompt_tokens=20)
        try:
            pool.admit("c", "acme", prompt_tokens=4)
        except kvfence.KvfenceError as e:
            assert e.name == "KVF_ERR_POOL_EXHAUSTED" and "state" in e.message, e.message
            print("cache groups: a third request is refused, naming the state group:", e.message.split(": ", 1)[1])
        first, slot = a.group_table("state")
        kv = a.block_table()
        print("cache groups: acme's lease holds pages %s and state slot %s" % (kv, slot))
        for p in kv:  # the engine writes its latents into its own buffer
            ctypes.memset(ctypes.addressof(latent) + p * page, 0x5A, page)
        a.release(stream=0)
        a.free()
        for p in kv:
            word = struct.unpack_from("<I", latent, p * page + page - 4)[0]
            assert word == 0x80008000, "page %d not scrubbed: %#x" % (p, word)
        print("cache groups: released pages hold bf16 -0 in the engine's buffer again")
        b.release(stream=0)
        b.free()
        stats = pool.stats()
        print("cache groups:", ", ".join("%s %d/%d free" % (g["name"], g["free"], g["pages"]) for g in stats["groups"]))
        pool.check()
    with kvfence.Pool({"preset": "deepseek-v3", "pages": 4, "max_context_tokens": 256,
                       "tenants": [{"name": "acme"}]}) as pool:
        print("preset deepseek-v3: %d bytes per page of %d tokens"
              % (pool.stats()["page_bytes"], pool.stats()["tokens_per_page"]))


def check_default_stream():
    """Lease.release() with no stream orders the scrub after PyTorch's
    current stream; its default stream (cuda_stream 0) is passed as the
    legacy default stream, never as 0 ("all work": a stall). A stand-in
    module plays PyTorch, so this runs without it."""
    assert kvfence.default_stream() == 0 or "torch" in sys.modules
    real = sys.modules.get("torch")

    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

    class Cuda:
        handle = 0

        def is_available(self):
            return True

        def is_initialized(self):
            return True

        def current_stream(self):
            return Stream(self.handle)

    class Torch:
        cuda = Cuda()

    sys.modules["torch"] = Torch()
    try:
        assert kvfence.default_stream() == kvfence.STREAM_LEGACY
        Torch.cuda.handle = 0x7f00dead
        assert kvfence.default_stream() == 0x7f00dead
    finally:
        if real is None:
            del sys.modules["torch"]
        else:
            sys.modules["torch"] = real
    print("default stream: PyTorch's current stream, its default one as STREAM_LEGACY")


if __name__ == "__main__":
    main()
    check_default_stream()
