#!/usr/bin/env python3
"""kvfence.vllm's KVCacheManager per scheduled request per step, driven by
vLLM's own call sequence (python/tests/vllm_replay.py: vLLM's Scheduler
and AsyncScheduler at 003df29, with the scheduler plugin around them).

Each scenario runs a workload to its end; every manager method the
scheduler calls is timed (perf_counter_ns around the call, the timer's own
cost measured on an empty method and subtracted), and the total is divided
by the request-steps the scheduler scheduled. The whole step (scheduler,
plugin and manager) is reported beside it. Rounds interleave the
scenarios; the summary gives min / median / max over the rounds.

    PYTHONPATH=python KVFENCE_LIB=... python3 python/bench/bench_vllm_manager.py [--rounds 5]

Scenarios (block size 16, 4,096 pages, prompts of 512 tokens of which the
first 256 are shared by each tenant's requests, 64 output tokens, two
tenants, 64 requests, at most 32 running, 2,048 tokens a step):

- decode: synchronous scheduler, pool sized "full";
- on_demand: the same with leases grown on demand (headroom 16 tokens);
- async: AsyncScheduler, two batches in flight;
- spec: synchronous, 3 speculative tokens, 3 lookahead slots.

The pool is a host pool of a tiny page (1 layer, 1 head of 8 fp16): the
bookkeeping is what is timed; with vLLM the pool is over remote ranks and
the scrubs run on the GPUs.

With --vllm-src, vLLM's own KVCacheManager (loaded from its source by
bench/vllmcmp/manager.py: one full-attention group of the same block size
and number of blocks, prefix caching on) is driven by the same replayed
scheduler, requests and model in rounds interleaved with kvfence's, and
timed the same way; the replay's KV connector is then one that matches
nothing (vLLM's manager has no tenants), so both managers see the same
calls. vLLM computes block hashes in its Request (on creation and on each
appended token), not in the manager: that time is reported beside the
manager's, and in the total compared with kvfence's manager, whose keys
are computed inside it. scripts/bench-vllm-manager.sh runs it.
"""

import argparse
import os
import statistics
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import kvfence  # noqa: E402
from kvfence.vllm import KVCacheManager, resolver  # noqa: E402

import vllm_replay as vr  # noqa: E402

CALLS = ("new_step_starts", "get_computed_blocks", "get_computed_blocks_for_connector", "allocate_slots",
         "get_blocks", "get_block_ids", "get_block_ids_for_computed_tokens", "free", "cache_blocks",
         "record_prefix_cache_stats", "get_num_common_prefix_blocks", "take_events", "make_prefix_cache_stats",
         "take_kv_cache_block_copies", "take_new_block_ids", "take_partial_tail_offloads", "remove_skipped_blocks",
         "ensure_room", "refusal_of", "take_errors", "_usage")


class Timed:
    """Times every call of CALLS on a manager, in ns."""

    def __init__(self, mgr):
        self.ns = 0
        self.calls = 0
        for name in CALLS:
            setattr(mgr, name, self._wrap(getattr(mgr, name)))

    def _wrap(self, fn):
        clock = time.perf_counter_ns

        def timed(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                self.ns += clock() - t
                self.calls += 1
        return timed


def timer_overhead():
    """ns a timed call costs beyond the call itself."""
    class Empty:
        def allocate_slots(self):
            return None
    e = Empty()
    plain = e.allocate_slots
    n = 200000
    t = time.perf_counter_ns()
    for _ in range(n):
        plain()
    base = time.perf_counter_ns() - t
    timed = Timed.__new__(Timed)
    timed.ns = timed.calls = 0
    f = timed._wrap(plain)
    t = time.perf_counter_ns()
    for _ in range(n):
        f()
    return max(0.0, (time.perf_counter_ns() - t - base) / n - timed.ns / n)


SCENARIOS = {
    "decode": dict(sizing=None, base=vr.ReplayScheduler, spec=0, depth=1),
    "on_demand": dict(sizing={"mode": "on_demand", "headroom_tokens": 16}, base=vr.ReplayScheduler, spec=0, depth=1),
    "async": dict(sizing=None, base=vr.ReplayAsyncScheduler, spec=0, depth=2),
    "spec": dict(sizing=None, base=vr.ReplayScheduler, spec=3, depth=1),
}


def run(name, overhead, requests=64, prompt_len=512, shared=256, max_tokens=64):
    sc = SCENARIOS[name]
    cfg = {"geometry": {"tokens_per_page": 16, "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "fp16"},
           "pages": 4096, "max_context_tokens": 4096, "tenants": [{"name": "a"}, {"name": "b"}]}
    if sc["sizing"]:
        cfg["sizing"] = sc["sizing"]
    with kvfence.Pool(cfg) as pool:
        spec = sc["spec"]
        mgr = KVCacheManager(pool, 4096, resolver("trace_header:x-tenant"), log_stats=True,
                             num_lookahead_tokens=spec, num_spec_tokens=spec)
        sched = vr.plugin(sc["base"])(mgr, max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=4096,
                                      num_lookahead_tokens=spec, num_spec_tokens=spec)
        for i in range(requests):
            t = "ab"[i % 2]
            system = [(37 * j + (0 if t == "a" else 5)) % 30000 for j in range(shared)]
            own = [(101 * i + 7 * j) % 30000 for j in range(prompt_len - shared)]
            sched.add_request(vr.Request("%s-%d" % (t, i), system + own, max_tokens, tenant=t))
        timed = Timed(mgr)
        engine = vr.Engine(sched, accept=1 if spec else 0, async_depth=sc["depth"])
        req_steps, step_ns = 0, 0
        while sched.has_requests():
            t0 = time.perf_counter_ns()
            out = engine.step()
            step_ns += time.perf_counter_ns() - t0
            req_steps += len(out.num_scheduled_tokens)
        engine.drain()
        assert len(engine.finished()) == requests, engine.finished()
        pool.check()
        mgr_ns = timed.ns - overhead * timed.calls
        return {"scenario": name, "request_steps": req_steps, "steps": engine.steps,
                "manager_ns_per_request_step": mgr_ns / req_steps, "step_ns_per_request_step": step_ns / req_steps,
                "calls_per_request_step": timed.calls / req_steps}


class NoMatchConnector:
    """A KV connector that never has external tokens, for vLLM's manager
    (the scheduler's connector path with nothing to load or save)."""

    requires_kv_delivery = False

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def request_finished(self, request, block_ids):
        return False, None

    def has_pending_push_work(self):
        return False

    def build_connector_meta(self, scheduler_output):
        return None


VLLM_CALLS = ("new_step_starts", "get_computed_blocks", "get_computed_blocks_for_connector", "allocate_slots",
              "get_blocks", "get_block_ids", "get_block_ids_for_computed_tokens", "free", "cache_blocks",
              "record_prefix_cache_stats", "get_num_common_prefix_blocks", "take_events", "make_prefix_cache_stats",
              "take_kv_cache_block_copies", "take_new_block_ids", "take_partial_tail_offloads",
              "remove_skipped_blocks", "reset_prefix_cache")


def vllm_request_class(hasher, clock):
    """vr.Request with vLLM's block_hashes, kept as vllm/v1/request.py
    keeps them (hashed on creation and as output tokens are appended);
    clock.ns accumulates the hashing time."""

    class VllmRequest(vr.Request):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.block_hashes = []
            self._prompt_embeds_per_block_hashes = {}
            self._hash()

        def _hash(self):
            t = time.perf_counter_ns()
            self.block_hashes.extend(hasher(self))
            clock.ns += time.perf_counter_ns() - t

        def append_output_token_ids(self, token_ids):
            super().append_output_token_ids(token_ids)
            self._hash()

    return VllmRequest


def run_vllm(kvm, name, overhead, requests=64, prompt_len=512, shared=256, max_tokens=64):
    """run()'s workload over vLLM's own KVCacheManager (4,096 blocks of 16,
    one of which vLLM keeps as its null block)."""
    import manager as vm
    sc = SCENARIOS[name]
    spec = sc["spec"]
    mgr = vm.make_manager(kvm, 16, 4096, 4096)
    usage = type(mgr).usage
    mgr.block_size = 16  # the replay reads its block size off the manager; vLLM's Scheduler is given it
    clock = types.SimpleNamespace(ns=0)
    Request = vllm_request_class(vm.block_hasher(16), clock)
    sched = sc["base"](mgr, max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=4096,
                       num_lookahead_tokens=spec, num_spec_tokens=spec)
    sched.connector = NoMatchConnector()
    for i in range(requests):
        t = "ab"[i % 2]
        system = [(37 * j + (0 if t == "a" else 5)) % 30000 for j in range(shared)]
        own = [(101 * i + 7 * j) % 30000 for j in range(prompt_len - shared)]
        sched.add_request(Request("%s-%d" % (t, i), system + own, max_tokens, tenant=t))
    clock.ns = 0
    timed = Timed.__new__(Timed)
    timed.ns = timed.calls = 0
    for call in VLLM_CALLS:
        setattr(mgr, call, timed._wrap(getattr(mgr, call)))
    read_usage = timed._wrap(lambda: usage.fget(mgr))
    type(mgr).usage = property(lambda self: read_usage())
    try:
        engine = vr.Engine(sched, accept=1 if spec else 0, async_depth=sc["depth"])
        req_steps, step_ns = 0, 0
        while sched.has_requests():
            t0 = time.perf_counter_ns()
            out = engine.step()
            step_ns += time.perf_counter_ns() - t0
            req_steps += len(out.num_scheduled_tokens)
        engine.drain()
    finally:
        type(mgr).usage = usage
    assert len(engine.finished()) == requests, engine.finished()
    assert mgr.block_pool.get_num_free_blocks() == 4095, mgr.block_pool.get_num_free_blocks()
    mgr_ns = timed.ns - overhead * timed.calls
    return {"scenario": name, "request_steps": req_steps, "steps": engine.steps,
            "manager_ns_per_request_step": mgr_ns / req_steps, "hash_ns_per_request_step": clock.ns / req_steps,
            "step_ns_per_request_step": step_ns / req_steps, "calls_per_request_step": timed.calls / req_steps}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--vllm-src", help="directory holding vllm/v1/core/ (see bench/vllmcmp/manager.py)")
    args = ap.parse_args()
    names = args.scenarios.split(",")
    rows = {n: [] for n in names}
    vrows = {n: [] for n in names}
    kvm = None
    if args.vllm_src:
        sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "vllmcmp"))
        import manager as vm
        kvm = vm.load(args.vllm_src, vr)
    for r in range(args.rounds):
        overhead = timer_overhead()
        for n in names:
            res = run(n, overhead)
            rows[n].append(res)
            print("round %d %-9s kvfence manager %7.0f ns / request-step (%.1f calls), whole step %7.0f ns / "
                  "request-step, %d request-steps in %d steps, timer %.0f ns / call"
                  % (r, n, res["manager_ns_per_request_step"], res["calls_per_request_step"],
                     res["step_ns_per_request_step"], res["request_steps"], res["steps"], overhead), flush=True)
            if kvm is not None:
                v = run_vllm(kvm, n, overhead)
                vrows[n].append(v)
                print("round %d %-9s vLLM    manager %7.0f ns / request-step (%.1f calls) + hashing %5.0f, whole step "
                      "%7.0f ns / request-step, %d request-steps in %d steps"
                      % (r, n, v["manager_ns_per_request_step"], v["calls_per_request_step"],
                         v["hash_ns_per_request_step"], v["step_ns_per_request_step"], v["request_steps"],
                         v["steps"]), flush=True)

    def mmm(xs):
        return "%.0f / %.0f / %.0f" % (min(xs), statistics.median(xs), max(xs))

    def mmm2(xs):
        return "%.2f / %.2f / %.2f" % (min(xs), statistics.median(xs), max(xs))
    print("\nscenario   manager ns per request-step (min / median / max)   whole step ns per request-step")
    for n in names:
        print("%-10s %-48s %s" % (n, mmm([x["manager_ns_per_request_step"] for x in rows[n]]),
                                   mmm([x["step_ns_per_request_step"] for x in rows[n]])))
    if kvm is None:
        return
    print("\nvLLM's KVCacheManager, same rounds: manager ns per request-step | + block hashing | "
          "ratio vLLM / kvfence (round by round): manager alone | manager + hashing   (min / median / max)")
    for n in names:
        kv = [x["manager_ns_per_request_step"] for x in rows[n]]
        vm_ = [x["manager_ns_per_request_step"] for x in vrows[n]]
        vh = [x["manager_ns_per_request_step"] + x["hash_ns_per_request_step"] for x in vrows[n]]
        print("%-10s %s | %s | %s | %s" % (n, mmm(vm_), mmm(vh), mmm2([v / k for v, k in zip(vm_, kv)]),
                                           mmm2([v / k for v, k in zip(vh, kv)])))


if __name__ == "__main__":
    main()
