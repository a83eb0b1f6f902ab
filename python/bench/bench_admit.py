#!/usr/bin/env python3
"""Admit + release of a 2,048-token prompt from Python, against the same
cycle in pure Go in the same run, and (with --vllm-src) against vLLM's
own Python path for the same request: its block hashing (hash_block_tokens
over the prompt's 128 full blocks with vLLM's sha256) plus BlockPool
get_new_blocks and free_blocks.

The kvfence cycle is what a scheduler does per request: admit by token
IDs, the block table into the engine's int32 row (by the admission
itself, or after it; or as a new tensor or list), Lease.free() (release
after torch's current stream, and free: on a host pool one call,
kvf_lease_free, since host pools ignore orderings; on CUDA two). The
admission copies the 2,048 IDs into the lease and walks the tenant
domain's prefix trie with them; nothing is published, so nothing matches
and no page key is hashed (kvcache hashes a prompt's keys only while its
domain holds pages published by keys alone, and when a lease publishes).
The Go cycle (BenchmarkGoAdmitTokensRelease in capi/) is the same on a
pool of the same config. Rounds interleave the sides so that
all see the same machine load; each prints its figures, and the summary
gives min / median / max over the rounds.

    python3 python/bench/bench_admit.py [--rounds 5] [--vllm-src DIR]

needs torch, Go (it builds the capi test binary unless --go-test names
one) and the kvfence package (PYTHONPATH=python KVFENCE_LIB=... or
installed). --vllm-src: a directory holding vllm/v1/core/block_pool.py
and kv_cache_utils.py from a vLLM checkout (bench/vllmcmp/blockpool.py
loads them with stand-ins for the rest of vLLM; no vLLM code is in this
repository). vLLM's side is timed as its scheduler pays for a new
request: the prompt's 128 block hashes (its default "sha256" hash:
SHA-256 of the pickled (parent, tokens, extra keys)) and BlockPool's
get_new_blocks + free_blocks of 128 blocks.
"""

import argparse
import array
import json
import os
import pickle
import hashlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import kvfence

TOKENS = 2048
CONFIG = {"geometry": {"tokens_per_page": 16, "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "fp16"},
          "pages": 1024, "max_context_tokens": 16384, "tenants": [{"name": "bench"}]}
IDS = [(i * 7919 + 13) % 50000 for i in range(TOKENS)]  # the Go benchmark's tokens


ROW = torch.zeros(1024, dtype=torch.int32)  # the request's row of an engine's persistent block-table buffer


def kvfence_cycle(pool, ids, n, table_into="row"):
    admit, tenant = pool.admit_tokens, "bench"
    start = time.perf_counter_ns()
    for i in range(n):
        check = i == n - 1
        if table_into == "row":  # the table written by the admission itself (one C call with ABI 6)
            lease = admit("bench", tenant, ids, block_table=ROW)
            lease.free()  # release after torch's current stream, and free
            continue
        lease = admit("bench", tenant, ids)
        if table_into == "write":
            table = ROW[: lease.write_block_table(ROW)] if check else lease.write_block_table(ROW)
        elif table_into == "tensor":
            table = lease.block_table_tensor()
        else:
            table = lease.block_table()
        lease.free()  # release after torch's current stream, and free
    ns = (time.perf_counter_ns() - start) / n
    if table_into == "row":
        if lease.table_len != TOKENS // 16:
            raise SystemExit("block table of %d pages" % lease.table_len)
        table = ROW[: lease.table_len]
    if len(table) != TOKENS // 16 or len(set(table.tolist() if hasattr(table, "tolist") else table)) != TOKENS // 16:
        raise SystemExit("block table of %d pages" % len(table))
    return ns


def ctypes_floor(pool, ids, n, calls=3):
    """The same C calls with every argument made once, outside the loop, as
    the ctypes instance it is passed as (no conversion per call; the lease
    handle is its out-parameter's instance): what ctypes itself costs, the
    floor under the package. calls=3: kvf_admit_tokens,
    kvf_lease_block_table, kvf_lease_free; calls=2: kvf_admit_tokens_table
    (ABI 6), kvf_lease_free."""
    import ctypes
    from kvfence import _lib
    h, m = ctypes.c_uint64(), ctypes.c_size_t()
    ph, tp, rp = ctypes.c_uint64(pool._state.handle), ctypes.c_void_p(ids.data_ptr()), ctypes.c_void_p(ROW.data_ptr())
    nt, cap, zero = ctypes.c_size_t(TOKENS), ctypes.c_size_t(1024), ctypes.c_int64(0)
    admit, table, free, admit_table = _lib.admit_tokens, _lib.lease_block_table, _lib.lease_free, _lib.admit_tokens_table
    start = time.perf_counter_ns()
    if calls == 2:
        for _ in range(n):
            if admit_table(ph, b"bench", b"bench", tp, nt, zero, None, zero, rp, cap, m, h) or free(h):
                raise SystemExit("ctypes floor: a call failed")
    else:
        for _ in range(n):
            if admit(ph, b"bench", b"bench", tp, nt, zero, None, zero, h) or table(h, rp, cap, m) or free(h):
                raise SystemExit("ctypes floor: a call failed")
    ns = (time.perf_counter_ns() - start) / n
    if m.value != TOKENS // 16:
        raise SystemExit("block table of %d pages" % m.value)
    return ns


def calibrated(fn, seconds):
    n = 64
    while True:
        t = time.perf_counter()
        fn(n)
        if time.perf_counter() - t > seconds / 4 or n > 1 << 22:
            break
        n *= 4
    return fn(max(1, int(n * seconds / max(1e-9, 4 * (time.perf_counter() - t)))))


def go_round(binary, seconds):
    out = subprocess.run([binary, "-test.run", "^$", "-test.bench", "^BenchmarkGoAdmitTokensRelease$",
                          "-test.benchtime", "%gs" % seconds], capture_output=True, text=True,
                         env=dict(os.environ, KVF_BENCH_CONFIG=json.dumps(CONFIG)), check=True).stdout
    for line in out.splitlines():
        if line.startswith("BenchmarkGoAdmitTokensRelease"):
            f = line.split()
            return float(f[f.index("ns/op") - 1])
    raise SystemExit("no benchmark line in:\n" + out)


def vllm_sha256(obj):
    """vLLM's default prefix-caching hash ("sha256": SHA-256 of the pickled
    object; vllm/utils/hashing.py)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def load_vllm(src):
    """vLLM's BlockPool and kv_cache_utils through kvfence's loader
    (bench/vllmcmp/blockpool.py), and its hash_block_tokens: the file's own
    when it has it, else (an excerpt that stops before it) restated as
    vLLM writes it: hash_function((parent or NONE_HASH, tuple(tokens),
    extra_keys)). Returns (block_pool module, hash_block_tokens, note)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "vllmcmp"))
    import blockpool  # noqa: E402
    bp = blockpool.load_vllm(src)
    utils = sys.modules["vllm.v1.core.kv_cache_utils"]
    if hasattr(utils, "init_none_hash"):
        utils.init_none_hash(vllm_sha256)
    none_hash = getattr(utils, "NONE_HASH", b"\0" * 32)
    if callable(getattr(utils, "hash_block_tokens", None)):
        return bp, utils.hash_block_tokens, "vLLM's hash_block_tokens"

    def hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys=None):
        return hash_function((parent_block_hash or none_hash, tuple(curr_block_token_ids), extra_keys))
    return bp, hash_block_tokens, "hash_block_tokens restated (the excerpt lacks it)"


def vllm_cycle(vllm, ids, n):
    bp, hash_block_tokens, _ = vllm
    pool = bp.BlockPool(num_gpu_blocks=1024 + 1, enable_caching=True, hash_block_size=16)
    bs = 16
    start = time.perf_counter_ns()
    for _ in range(n):
        parent, hashes = None, []
        for i in range(0, TOKENS, bs):  # the request's block hashes (vLLM hashes them once per request)
            parent = hash_block_tokens(vllm_sha256, parent, ids[i:i + bs], None)
            hashes.append(parent)
        blocks = pool.get_new_blocks(TOKENS // bs)
        table = [b.block_id for b in blocks]
        blocks.reverse()  # as vLLM's manager frees a request
        pool.free_blocks(blocks)
    ns = (time.perf_counter_ns() - start) / n
    if len(set(table)) != 128 or len(set(hashes)) != 128 or pool.get_num_free_blocks() != 1024:
        raise SystemExit("vLLM cycle: %d blocks, %d hashes, %d free" % (len(set(table)), len(set(hashes)),
                                                                        pool.get_num_free_blocks()))
    return ns


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0, help="per side and round")
    ap.add_argument("--go-test", help="a capi test binary (go test -c ./capi); built if absent")
    ap.add_argument("--vllm-src")
    args = ap.parse_args()
    tmp = None
    binary = args.go_test
    if binary is None:
        tmp = tempfile.mkdtemp(prefix="kvfence-bench-")
        binary = os.path.join(tmp, "capi.test")
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
        subprocess.run(["go", "test", "-c", "-o", binary, "./capi"], cwd=root, check=True)
    vllm = load_vllm(args.vllm_src) if args.vllm_src else None
    t32 = torch.tensor(IDS, dtype=torch.int32)
    # (token IDs, where the block table goes): the engine's int32 tensor of
    # token IDs into its block-table row, by the admission itself
    # (admit_tokens(block_table=): one C call with ABI 6) or by
    # write_block_table() after it (a second call); a new table tensor; IDs
    # as an array('i') into a list (no torch); IDs as a list (converted each
    # time) into the row.
    two_calls = kvfence._lib.admit_tokens_table is not None
    print("libkvfence ABI %d: admit_tokens(block_table=) is %s" % (
        kvfence.abi_version(), "kvf_admit_tokens_table" if two_calls else "kvf_admit_tokens + kvf_lease_block_table"))
    forms = {"tensor>row": (t32, "row"), "tensor>write": (t32, "write"), "tensor>new": (t32, "tensor"),
             "array>list": (array.array("i", IDS), "list"), "list>row": (list(IDS), "row")}
    rows = []
    with kvfence.Pool(CONFIG) as pool:
        for form, (ids, into) in forms.items():
            kvfence_cycle(pool, ids, 200, into)  # warm
        for r in range(args.rounds):
            row = {"round": r + 1}
            for form, (ids, into) in forms.items():
                row["py_" + form] = calibrated(lambda n: kvfence_cycle(pool, ids, n, into), args.seconds / 4)
            row["ctypes_floor"] = calibrated(lambda n: ctypes_floor(pool, t32, n), args.seconds / 4)
            if two_calls:
                row["ctypes_floor2"] = calibrated(lambda n: ctypes_floor(pool, t32, n, calls=2), args.seconds / 4)
            row["go"] = go_round(binary, args.seconds)
            if vllm:
                row["vllm"] = calibrated(lambda n: vllm_cycle(vllm, IDS, n), args.seconds)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            rows.append(row)
        pool.check()
        s = pool.stats()
        assert s["in_use_pages"] == 0 and s["live_leases"] == 0 and s["refused"]["total"] == 0

    def mmm(xs, fmt="%.0f"):
        return ("min " + fmt + " median " + fmt + " max " + fmt) % (min(xs), statistics.median(xs), max(xs))

    print("\nadmit + block table + release + free of %d tokens (%d pages), %d rounds:" % (TOKENS, TOKENS // 16, len(rows)))
    print("  Go (same run)               ns/op  %s" % mmm([r["go"] for r in rows]))
    print("  ctypes floor (3 raw calls)  ns/op  %s | x Go %s" % (mmm([r["ctypes_floor"] for r in rows]),
                                                         mmm([r["ctypes_floor"] / r["go"] for r in rows], "%.2f")))
    if two_calls:
        print("  ctypes floor (2 raw calls)  ns/op  %s | x Go %s" % (mmm([r["ctypes_floor2"] for r in rows]),
                                                             mmm([r["ctypes_floor2"] / r["go"] for r in rows], "%.2f")))
    for form in forms:
        key = "py_" + form
        print("  Python, ids>table %-10s ns/op  %s | x Go %s" % (form, mmm([r[key] for r in rows]),
                                                            mmm([r[key] / r["go"] for r in rows], "%.2f")))
        if vllm:
            print("  %-27s        vLLM / kvfence-Python %s" % ("", mmm([r["vllm"] / r[key] for r in rows], "%.1f")))
    if vllm:
        print("  vLLM hashing + BlockPool    ns/op  %s  (%s)" % (mmm([r["vllm"] for r in rows]), vllm[2]))
    if tmp:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
