#!/usr/bin/env python3
"""Two tenants share one kvfence pool through the C ABI; a prefix is
shared between two requests of one tenant; a prompt's KV is handed off
from a prefill pool to a decode pool; a tensor-parallel group of two
worker processes (this script with --rank-worker) scrubs its shards.

It uses the kvfence package (python/): installed (`pip install
--no-build-isolation ./python`), or from this checkout with the library
built beside the C ABI:

    go build -buildmode=c-shared -o capi/libkvfence.so ./capi
    python3 examples/python/demo.py        # or KVFENCE_LIB=/path/libkvfence.so
"""

import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True  # keep the source tree clean when CI runs this
try:
    import kvfence  # noqa: F401  (installed)
except ImportError:  # this checkout's python/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

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


# The tensor-parallel group of ranks_demo: each rank holds 2 of the 4 KV
# heads of 2 layers (4 regions), 16 pages of 4 fp32 tokens: 128 bytes per
# page and region on each rank.
RANKS = 2
RANK_PAGES = 16
RANK_PAGE_BYTES = 128
RANK_REGIONS = 4


def rank_worker(connect, rank):
    """A worker process of the group (what a vLLM or SGLang worker would
    run beside its model), driven by ranks_demo on stdin: its shard is host
    memory here; on a GPU it would be the KV tensors' data_ptr()s."""
    shard = [bytearray(b"\xee" * (RANK_PAGES * RANK_PAGE_BYTES)) for _ in range(RANK_REGIONS)]
    regions = [{"memory": m, "pages": RANK_PAGES, "page_bytes": RANK_PAGE_BYTES} for m in shard]
    with kvfence.RankWorker(connect, rank, regions, connect_timeout_ms=30000) as w:
        print("ready", flush=True)
        for line in sys.stdin:
            cmd = line.split()
            try:
                if cmd[0] == "write":  # the engine writes KV into pages
                    for m in shard:
                        for p in map(int, cmd[2:]):
                            m[p * RANK_PAGE_BYTES:(p + 1) * RANK_PAGE_BYTES] = bytes([int(cmd[1])]) * RANK_PAGE_BYTES
                    answer = "ok"
                elif cmd[0] == "step":  # after the engine step's kernels
                    answer = "stepped %d" % w.step()
                elif cmd[0] == "word":  # the first word of a page, and whether every word is that one
                    p = int(cmd[1])
                    words = set()
                    for m in shard:
                        words.update(struct.unpack_from("<%dI" % (RANK_PAGE_BYTES // 4), m, p * RANK_PAGE_BYTES))
                    answer = "word %08x %d" % (struct.unpack_from("<I", shard[0], p * RANK_PAGE_BYTES)[0], len(words) == 1)
                elif cmd[0] == "wait":
                    answer = "ended %d" % w.wait(int(cmd[1]))
                else:
                    break
            except kvfence.KvfenceError as e:
                answer = "error %s" % e.name
            print(answer, flush=True)
        regions_seen = len(w.regions())
    print("closed, %d regions" % regions_seen, flush=True)


class Rank:
    """ranks_demo's end of one worker process."""

    def __init__(self, connect, rank):
        self.rank = rank
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-worker", connect, str(rank)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def line(self):
        out = self.p.stdout.readline().strip()
        if not out:
            raise RuntimeError("rank %d ended" % self.rank)
        return out

    def do(self, *cmd):
        self.p.stdin.write(" ".join(map(str, cmd)) + "\n")
        self.p.stdin.flush()
        return self.line()

    def step_arrived(self):
        """Steps until the batch the scheduler just handed over (it
        reaches the worker asynchronously) has been launched."""
        for _ in range(5000):
            out = self.do("step")
            if out != "stepped 0":
                return out
            time.sleep(0.002)
        return out


def ranks_demo():
    """The scheduler's pool over a group of two worker processes: a page
    is free again only once every rank has scrubbed its shard of it, each
    on its own step, and the canary audit reads every rank's shard."""
    tmp = tempfile.mkdtemp(prefix="kvfd")
    connect = "unix:" + os.path.join(tmp, "s")
    ranks = [Rank(connect, r) for r in range(RANKS)]  # they wait for the scheduler to listen
    config = {
        "geometry": {"tokens_per_page": 4, "layers": 2, "kv_heads": 2 * RANKS, "head_dim": 4, "dtype": "fp32"},
        "pages": RANK_PAGES, "max_context_tokens": 64, "tenants": [{"name": "acme"}, {"name": "globex"}],
        "scrub": {"kind": "canary"},
        "device": {"kind": "remote", "listen": connect, "ranks": RANKS, "report_timeout_ms": 20000},
    }
    try:
        with kvfence.Pool(config) as pool:  # returns once every rank connected and scrubbed its shard
            for r in ranks:
                assert r.line() == "ready"
                assert r.do("word", 0).endswith(" 1") and not r.do("word", 0).startswith("word eeeeeeee")
                assert r.do("step") == "stepped 0"  # before any batch: from now on scrubs wait for a step
            s = pool.stats()
            print("ranks: pool over %s, %d pages of %d bytes (%d per rank)"
                  % (s["device"], s["total_pages"], pool.regions()[0]["page_bytes"], RANK_PAGE_BYTES))
            lease = pool.admit("tp-1", "acme", prompt_tokens=60)
            table = lease.block_table()
            for r in ranks:
                assert r.do("write", 0x5A, *table) == "ok"
            lease.release()
            for r in ranks:
                time.sleep(0.02)  # a report that must not come
                q = pool.stats()["quarantined_pages"]
                print("ranks: %d pages quarantined before rank %d stepped" % (q, r.rank))
                assert q == len(table) and r.do("word", table[0]) == "word 5a5a5a5a 1"
                assert r.step_arrived() == "stepped 1"
                word = r.do("word", table[0])
                assert word.endswith(" 1") and word != "word 5a5a5a5a 1"
                print("ranks: rank %d stepped, its shard of page %d now holds %s" % (r.rank, table[0], word.split()[1]))
            for _ in range(5000):
                if pool.stats()["free_pages"] == RANK_PAGES:
                    break
                time.sleep(0.002)
            s = pool.stats()
            print("ranks: %d/%d pages free once every rank reported" % (s["free_pages"], s["total_pages"]))
            assert s["free_pages"] == RANK_PAGES
            other = pool.admit("tp-2", "globex", prompt_tokens=64)  # every page, audited on every rank
            s = pool.stats()
            assert s["scrub"]["canary_failures"] == 0 and not s["fault"]
            print("ranks: canary audit of %d pages over both shards passed" % s["scrub"]["canary_checks"])
            other.free()
            for r in ranks:
                assert r.step_arrived() == "stepped 1"
            pool.check()
        for r in ranks:
            assert r.do("wait", 10000) == "ended 1"
            out = r.do("step")
            print("ranks: rank %d after the pool's destruction: %s" % (r.rank, out))
            assert out == "error KVF_ERR_POOL_CLOSED"
            r.p.stdin.close()
            assert r.line() == "closed, %d regions" % RANK_REGIONS
            assert r.p.wait(10) == 0
    finally:
        for r in ranks:
            if r.p.poll() is None:
                r.p.kill()
                r.p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


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

    # RankWorker.step() orders after the same stream; the C call is
    # replaced by one that records what it is given.
    given = []

    def fake_step(handle, stream, event, launched):
        given.append(stream)
        return kvfence.OK

    real_step, kvfence._lib.rank_step = kvfence._lib.rank_step, fake_step
    worker = kvfence.RankWorker.__new__(kvfence.RankWorker)
    worker._h = 1

    sys.modules["torch"] = Torch()
    try:
        assert kvfence.default_stream() == kvfence.STREAM_LEGACY
        worker.step()
        Torch.cuda.handle = 0x7f00dead
        assert kvfence.default_stream() == 0x7f00dead
        worker.step()
        worker.step(stream=0x1234)
        assert given == [kvfence.STREAM_LEGACY, 0x7f00dead, 0x1234], given
    finally:
        kvfence._lib.rank_step = real_step
        worker._h = 0
        if real is None:
            del sys.modules["torch"]
        else:
            sys.modules["torch"] = real
    print("default stream: PyTorch's current stream, its default one as STREAM_LEGACY (Lease.release, RankWorker.step)")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--rank-worker":
        rank_worker(sys.argv[2], int(sys.argv[3]))
        sys.exit(0)
    main()
    ranks_demo()
    check_default_stream()
