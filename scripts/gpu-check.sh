#!/usr/bin/env bash
# gpu-check.sh: build here, run on the GPU machine.
#
# The GPU machine has no Go toolchain (its driver is 580, CUDA 13), so this
# script compiles the test binaries on the build machine into a carry
# directory (default .cache/gpu-carry, gitignored) together with run.sh,
# which runs there: the conformance suite, the ordering tests (legacy
# default stream, per-thread stream, an engine kernel still writing when
# the release is issued; each stream named and as the zero ordering), the
# multi-device tests (a Group over every visible GPU, and remote ranks in
# worker processes, one per GPU), then BenchmarkCUDAFill, in well under 5
# minutes. With no usable GPU it fails at once, loudly: the tests run with
# KVFENCE_REQUIRE_GPU=1, which turns their skips into failures. It writes its output to $OUT (or carry/out) for
# committing under bench/results/<date>-<device>/.
#
#   scripts/gpu-check.sh                 # build
#   .cache/gpu-carry/run.sh              # on the GPU machine
#
# cudaops.test opens libcuda.so.1 with dlopen, so it links only libc (and
# libdl/libpthread on old glibc); the build fails if that ever changes. The
# gorgonia adapter's test binary is added when the CUDA SDK is cached
# (scripts/cuda-sdk.sh): it links libcuda.so.1 from the driver at start-up.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
carry=${1:-$root/.cache/gpu-carry}
cd "$root"
rm -rf "$carry"
mkdir -p "$carry"

go test -c -o "$carry/cudaops.test" ./cudaops
needed=$(readelf -d "$carry/cudaops.test" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p')
for lib in $needed; do
	case $lib in
	libc.so.* | libdl.so.* | libpthread.so.*) ;;
	*)
		echo "gpu-check: cudaops.test needs $lib; it must link only libc/libdl" >&2
		exit 1
		;;
	esac
done
glibc=$(objdump -T "$carry/cudaops.test" | grep -o 'GLIBC_[0-9.]*' | sort -V | tail -1)
echo "gpu-check: cudaops.test needs $needed, up to $glibc" >&2
# The NVML probe lives in its own package (go-nvml resolves its symbols at
# run time); its binary also loads without the library.
go test -c -o "$carry/gpuinfo.test" ./cudaops/gpuinfo

if [ -f "$root/.cache/cuda-sdk/.complete" ]; then
	eval "$(scripts/cuda-sdk.sh)"
	CGO_CFLAGS="$CGO_CFLAGS -Wno-deprecated-declarations" \
		go test -tags gorgonia -c -o "$carry/gorgoniacu.test" ./cudaops/gorgoniacu
fi

cat >"$carry/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs on the GPU machine; see scripts/gpu-check.sh.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
rc=0
{
	echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
	echo "host: $(uname -srm)"
	nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1
	echo "ldd cudaops.test:"
	ldd "$here/cudaops.test" 2>&1
} >"$out/env.txt"
cat "$out/env.txt"
cd "$here"
export KVFENCE_REQUIRE_GPU=1
if ! ./cudaops.test -test.run '^TestOpenCUDAHere$' -test.v >"$out/open.txt" 2>&1 ||
	grep -q 'OpenCUDA(0):' "$out/open.txt"; then
	cat "$out/open.txt" >&2
	echo "gpu-check: FAIL: no usable CUDA device on this machine" >&2
	exit 2
fi
echo "== conformance"
timeout 150 ./cudaops.test -test.v -test.count=1 \
	-test.run '^(TestCUDAConformance|TestOpenCUDAHere)$' >"$out/conformance.txt" 2>&1 || rc=1
timeout 30 ./gpuinfo.test -test.v -test.count=1 >>"$out/conformance.txt" 2>&1 || rc=1
grep -E '^(--- |ok|PASS|FAIL)|FAIL|device|NVML|OpenCUDA' "$out/conformance.txt" | grep -v -e '--- PASS' -e 'seed ' | tail -40
grep -c -- '--- PASS' "$out/conformance.txt" | sed 's/^/passed: /'
if [ -x ./gorgoniacu.test ]; then
	echo "== gorgonia adapter"
	timeout 60 ./gorgoniacu.test -test.v -test.count=1 >"$out/gorgoniacu.txt" 2>&1 || rc=1
	tail -5 "$out/gorgoniacu.txt"
fi
echo "== ordering and multi-device"
timeout 120 ./cudaops.test -test.v -test.count=1 \
	-test.run '^(TestCUDAOrderingGPU|TestCUDAGroupGPU|TestRemoteRanksGPU)$' >"$out/ordering.txt" 2>&1 || rc=1
grep -E '^(=== RUN|--- |ok|PASS|FAIL)|FAIL|stats|devices' "$out/ordering.txt" | grep -v -e '=== RUN' | tail -40
echo "== benchmarks"
timeout 240 ./cudaops.test -test.run '^$' -test.bench 'BenchmarkCUDAFill' \
	-test.benchtime 1s -test.count 1 >"$out/bench.txt" 2>&1 || rc=1
cat "$out/bench.txt"
exit $rc
RUN
chmod +x "$carry/run.sh"
echo "gpu-check: built $carry (run $carry/run.sh on the GPU machine)" >&2
ls -la "$carry" >&2
