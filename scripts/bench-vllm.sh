#!/usr/bin/env bash
# kvfence's allocator beside vLLM's BlockPool, in interleaved rounds of one
# run: BenchmarkAllocFree (Alloc + Release + Clean of 128 pages) against
# BlockPool.get_new_blocks + free_blocks of 128 blocks, on 1,024 and
# 1,048,576 pages. Prints each round and the ratio vLLM ÷ kvfence as
# min / median / max. Not part of CI: it needs vLLM's source,
#   VLLM_SRC=/path/to/vllm-checkout scripts/bench-vllm.sh [rounds]
# (the directory holding vllm/v1/core/block_pool.py and kv_cache_utils.py;
# see bench/vllmcmp/blockpool.py).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${VLLM_SRC:?set VLLM_SRC to a directory holding vllm/v1/core/block_pool.py}"
rounds=${1:-5}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
go test -c -o "$tmp/allocator.test" ./allocator
for r in $(seq "$rounds"); do
	"$tmp/allocator.test" -test.run '^$' -test.bench 'AllocFree' -test.benchtime 1s |
		awk '/^BenchmarkAllocFree/ { split($1, a, "="); sub(/-.*/, "", a[2]); for (i = 1; i <= NF; i++) if ($(i+1) == "ns/page") print "kvfence", a[2], $i }' >>"$tmp/rounds"
	python3 bench/vllmcmp/blockpool.py --vllm-src "$VLLM_SRC" --seconds 1 |
		python3 -c 'import json,sys; [print("vllm", d["pages"], d["ns_per_page"]) for d in map(json.loads, sys.stdin)]' >>"$tmp/rounds"
	echo "round $r done" >&2
done
python3 - "$tmp/rounds" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
for pages in sorted({int(r[1]) for r in rows}):
    kv = [float(r[2]) for r in rows if r[0] == "kvfence" and int(r[1]) == pages]
    vl = [float(r[2]) for r in rows if r[0] == "vllm" and int(r[1]) == pages]
    ratio = [v / k for k, v in zip(kv, vl)]
    f = lambda xs: "min %.2f median %.2f max %.2f" % (min(xs), statistics.median(xs), max(xs))
    print("pages=%-8d kvfence ns/page %s | vLLM BlockPool ns/page %s | vLLM/kvfence %s" % (pages, f(kv), f(vl), f(ratio)))
PY
