#!/usr/bin/env python3
"""Time vLLM's own BlockPool allocation and free, to compare kvfence's
allocator with it in the same run (scripts/bench-vllm.sh).

vLLM is not a dependency of kvfence and none of its code is in this
repository: point --vllm-src at a directory that holds
vllm/v1/core/block_pool.py and vllm/v1/core/kv_cache_utils.py from a vLLM
checkout. The rest of vLLM (config, logging, events, metrics) is replaced
by small stand-ins: the allocation path does not use them.

The measured cycle is what BenchmarkAllocFree does in Go: take a batch of
pages (BlockPool.get_new_blocks) and give them back (free_blocks, in
reverse, as vLLM's KV cache manager frees a request), on a pool whose
free queue has been churned once so that it is not in pristine order.
Prints one JSON object per round: {"pages", "batch", "ns_per_page"}.
"""

import argparse
import importlib.util
import json
import logging
import random
import sys
import time
import types


class _Anything:
    """Stands in for any name of the parts of vLLM the allocator does not
    use: callable, subscriptable, usable as a base class or a default."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __getattr__(self, name):
        return _Anything()

    def __class_getitem__(cls, item):
        return cls

    def __getitem__(self, item):
        return _Anything()

    def __or__(self, other):
        return _Anything

    def __ror__(self, other):
        return _Anything

    def __bool__(self):
        return False


def _stub(name, **names):
    mod = types.ModuleType(name)
    mod.__getattr__ = lambda attr: _Anything  # PEP 562: any other name
    for k, v in names.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    return mod


def load_vllm(src):
    """Imports vLLM's kv_cache_utils and block_pool from src with stand-ins
    for everything they import from the rest of vLLM."""
    for name in ["vllm", "vllm.v1", "vllm.v1.core", "vllm.utils", "vllm.distributed"]:
        _stub(name)
    _stub("vllm.envs", VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=False)
    sys.modules["vllm"].envs = sys.modules["vllm.envs"]
    _stub("vllm.config")
    _stub("vllm.logger", init_logger=logging.getLogger)
    _stub("vllm.utils.hashing", sha256_cbor=lambda x: b"", xxhash_cbor=lambda x: b"")
    _stub("vllm.utils.math_utils", cdiv=lambda a, b: -(-a // b))
    _stub("vllm.utils.mem_utils")
    _stub("vllm.v1.kv_cache_interface")
    _stub("vllm.v1.request")
    _stub("vllm.v1.utils")
    _stub("vllm.distributed.kv_events", MEDIUM_GPU="GPU")
    _stub("vllm.v1.core.kv_cache_metrics")

    def load(modname, path):
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        spec.loader.exec_module(mod)
        return mod

    utils = load("vllm.v1.core.kv_cache_utils", src + "/vllm/v1/core/kv_cache_utils.py")
    for name in ["BlockHashList", "BlockHashListWithBlockSize"]:
        if not hasattr(utils, name):
            setattr(utils, name, list)
    queue = utils.FreeKVCacheBlockQueue
    if not hasattr(queue, "prepend_n"):
        # Newer BlockPools put fresh blocks back at the front of the queue;
        # an older kv_cache_utils lacks the method. The same linking as
        # append_n, at the head.
        def prepend_n(self, blocks):
            if not blocks:
                return
            first = self.fake_free_list_head.next_free_block
            prev = self.fake_free_list_head
            for b in blocks:
                b.prev_free_block = prev
                prev.next_free_block = b
                prev = b
            prev.next_free_block = first
            first.prev_free_block = prev
            self.num_free_blocks += len(blocks)

        queue.prepend_n = prepend_n
    return load("vllm.v1.core.block_pool", src + "/vllm/v1/core/block_pool.py")


def round_ns_per_page(block_pool, pages, batch, cycles, seed):
    pool = block_pool.BlockPool(num_gpu_blocks=pages + 1, enable_caching=True, hash_block_size=16)
    # Churn once, as the Go benchmark does.
    half = pool.get_new_blocks(pages // 2)
    random.Random(seed).shuffle(half)
    pool.free_blocks(half)
    start = time.perf_counter_ns()
    for _ in range(cycles):
        blocks = pool.get_new_blocks(batch)
        blocks.reverse()
        pool.free_blocks(blocks)
    ns = (time.perf_counter_ns() - start) / (cycles * batch)
    if pool.get_num_free_blocks() != pages:
        raise SystemExit("vLLM pool lost pages: %d of %d free" % (pool.get_num_free_blocks(), pages))
    return ns


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-src", required=True, help="directory holding vllm/v1/core/{block_pool,kv_cache_utils}.py")
    ap.add_argument("--pages", type=int, action="append", help="pool sizes (default 1024 and 1048576)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=1.0, help="time per round and pool size")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    bp = load_vllm(args.vllm_src)
    for r in range(args.rounds):
        for pages in args.pages or [1024, 1 << 20]:
            # Calibrate the cycles to about --seconds.
            cycles = 100
            while True:
                start = time.perf_counter()
                round_ns_per_page(bp, pages, args.batch, cycles, r)
                if time.perf_counter() - start > args.seconds / 4 or cycles > 10_000_000:
                    break
                cycles *= 4
            ns = round_ns_per_page(bp, pages, args.batch, cycles, r)
            print(json.dumps({"pages": pages, "batch": args.batch, "ns_per_page": round(ns, 2)}), flush=True)


if __name__ == "__main__":
    main()
