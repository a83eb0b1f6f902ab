#!/usr/bin/env bash
# bench-host.sh: run every CPU benchmark with its in-benchmark baseline and
# write the output, with the machine's description, to
# bench/results/<date>-host.txt (benchstat reads it). Takes about 4 minutes
# on a 2-core machine; run it when the machine is otherwise idle.
#
#   scripts/bench-host.sh [COUNT]
set -euo pipefail
cd "$(dirname "$0")/.."
count=${1:-3}
out=bench/results/$(date -u +%Y-%m-%d)-host.txt
mkdir -p bench/results
# Decided before the output file is truncated: that file is not a change.
dirty=$(git diff --quiet -- . ':!bench/results' || echo ' (dirty)')
{
	echo "# kvfence CPU benchmarks, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
	echo "# $(go version); $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
	echo "# load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
	echo "# commit $(git rev-parse --short HEAD)$dirty"
} >"$out"
run() {
	echo "== $*" >&2
	go test -run '^$' -count "$count" "$@" | grep -E '^(Benchmark|goos|goarch|pkg|cpu)' | tee -a "$out"
}
run -bench '^BenchmarkAllocFree$' -benchtime 200000x ./allocator
run -bench '^BenchmarkAdmitRelease$' -benchtime 20000x ./kvcache
run -bench '^BenchmarkHostFill$' -benchtime 20x ./cudaops
run -bench '^(BenchmarkPrefixMatch|BenchmarkPageKey)$' ./kvcache
run -bench '^BenchmarkCAdmitRelease$' ./capi
run -bench '^BenchmarkManifest2048$' ./handoff
run -bench '^(BenchmarkHandoff|BenchmarkGRPCStream)$' -benchtime 10x ./handoff/grpcx
run -bench . -benchtime 300ms ./bench
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out"
echo "bench-host: wrote $out" >&2
