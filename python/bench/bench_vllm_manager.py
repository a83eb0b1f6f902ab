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

vLLM's own KVCacheManager is not driven here: its source (manager,
coordinator, single-type managers, block pool) could not be brought onto
the machine this was written on (python/README.md, "Running kvfence in
vLLM").
"""

import argparse
import os
import statistics
import sys
import time

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = ap.parse_args()
    names = args.scenarios.split(",")
    rows = {n: [] for n in names}
    for r in range(args.rounds):
        overhead = timer_overhead()
        for n in names:
            res = run(n, overhead)
            rows[n].append(res)
            print("round %d %-9s manager %7.0f ns / request-step (%.1f calls), whole step %7.0f ns / request-step, "
                  "%d request-steps in %d steps, timer %.0f ns / call"
                  % (r, n, res["manager_ns_per_request_step"], res["calls_per_request_step"],
                     res["step_ns_per_request_step"], res["request_steps"], res["steps"], overhead), flush=True)

    def mmm(xs):
        return "%.0f / %.0f / %.0f" % (min(xs), statistics.median(xs), max(xs))
    print("\nscenario   manager ns per request-step (min / median / max)   whole step ns per request-step")
    for n in names:
        print("%-10s %-48s %s" % (n, mmm([x["manager_ns_per_request_step"] for x in rows[n]]),
                                   mmm([x["step_ns_per_request_step"] for x in rows[n]])))


if __name__ == "__main__":
    main()
