#!/usr/bin/env bash
# gpu-check.sh: build here, run on the GPU machine, in one prepared run.
#
# The GPU machine has no Go toolchain (its driver is 580, CUDA 13), so this
# script builds, on the build machine, a carry directory (default
# .cache/gpu-carry, gitignored) of stripped binaries and run.sh, which runs
# there in at most about 6 minutes (350 s of steps; KVFENCE_GPU_BUDGET
# changes it), each step bounded and its output kept:
#
#   device       GPU 0 opens, the fill kernel loads and fills a page
#                (TestCUDADeviceUsable); without a usable GPU run.sh stops
#                here and exits 2, loudly: every test runs with
#                KVFENCE_REQUIRE_GPU=1, which turns skips into failures
#   conformance  the conformance suite in kernel and memset mode, the
#                kernel's geometry check in every variant (adopted strides
#                ≡ 8 mod 16, pages larger than a chunk, spans, the ring),
#                and kvcache/pooltest on GPU 0: a hybrid pool's handoff
#                (staged copies, the state slot in ranges), state
#                checkpoints (device-to-device copies) and host tier
#                (page-locked copies), read back byte for byte, every
#                free page audited for the scrub pattern
#   sanitizer    the geometry check, the conformance suite's kernel fills
#                and the pool paths under compute-sanitizer --tool memcheck
#                (the machine's own where it has one, else the carried one;
#                on a gVisor machine it refuses the device, and the step
#                keeps its message)
#   bench        BenchmarkCUDAFill: GB/s, x-memset, launches/op,
#                kernel-only times (Llama-3.1-8B and DeepSeek-V3 pages)
#   staged       BenchmarkCUDAStagedCopies: a handoff's staged copies of a
#                Llama-3.1-8B prompt each way, GB/s and x-memcpy (against
#                one plain cuMemcpyDtoHAsync / HtoDAsync of its bytes)
#   ordering     legacy, per-thread and engine streams, an engine kernel
#                still writing at release; a Group over every GPU; remote
#                ranks in worker processes
#   torch        python/tests/test_torch_device.py under the machine's own
#                PyTorch and pytest, over the carried libkvfence.so:
#                pools over KV tensors torch allocated on the GPU (vLLM's
#                and the MLA layout), scaled_dot_product_attention over
#                pages gathered by kvfence's block tables, a release on
#                torch.cuda.current_stream() while a kernel still writes
#                the pages, and every reused page holding only the scrub
#                pattern
#   gpuinfo      the NVML probe
#   kvbench      a short kvbench -device cuda run with the isolation audit
#   capi         the C ABI test program, on a CUDA pool
#   gorgoniacu   the gorgonia.org/cu adapter (when built)
#
# The carry must stay under 64 MiB with the working tree: binaries are
# stripped, compute-sanitizer (Debian's nvidia-cuda-toolkit, which
# scripts/cuda-sdk.sh fetches) goes without its headers, and all of it
# travels as one bundle.tar.gz (about 23 MB) that run.sh unpacks into a
# temporary directory.
#
#   scripts/gpu-check.sh [CARRY]            # build (fetches the SDK once)
#   CARRY/run.sh                            # on the GPU machine; results
#                                           # in $OUT, or CARRY/out
#   scripts/gpu-check.sh collect RESULTS    # file a run's results under
#                                           # bench/results/DATE-gpu-MODEL/
#
# cudaops.test opens libcuda.so.1 with dlopen, so it links only libc (and
# libdl/libpthread on old glibc); the build fails if that ever changes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

if [ "${1:-}" = collect ]; then
	src=${2:?usage: scripts/gpu-check.sh collect RESULTS}
	test -s "$src/summary.txt" || {
		echo "gpu-check: $src has no summary.txt: not the results of a run" >&2
		exit 1
	}
	model=$(sed -n 's/^gpu: //p' "$src/env.txt" | head -1 | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
	dest=bench/results/$(date -u +%Y-%m-%d)-gpu-${model:-unknown}
	mkdir -p "$dest"
	cp "$src"/*.txt "$dest/"
	if [ -f "$src/kvbench/report.json" ]; then
		cp "$src/kvbench/report.json" "$dest/kvbench-report.json"
	fi
	echo "gpu-check: results in $dest"
	exit 0
fi

carry=${1:-$root/.cache/gpu-carry}
rm -rf "$carry"
mkdir -p "$carry"
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
mkdir -p "$bin/lib"
strip=(-ldflags='-s -w')

go test -c "${strip[@]}" -o "$bin/cudaops.test" ./cudaops
needed=$(readelf -d "$bin/cudaops.test" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p')
for lib in $needed; do
	case $lib in
	libc.so.* | libdl.so.* | libpthread.so.*) ;;
	*)
		echo "gpu-check: cudaops.test needs $lib; it must link only libc/libdl" >&2
		exit 1
		;;
	esac
done
glibc=$(objdump -T "$bin/cudaops.test" | grep -o 'GLIBC_[0-9.]*' | sort -V | tail -1)
echo "gpu-check: cudaops.test needs $needed, up to $glibc" >&2
# The NVML probe lives in its own package (go-nvml resolves its symbols at
# run time); its binary also loads without the library.
go test -c "${strip[@]}" -o "$bin/gpuinfo.test" ./cudaops/gpuinfo
go build "${strip[@]}" -o "$bin/kvbench" ./bench/cmd/kvbench
go build -buildmode=c-shared "${strip[@]}" -o "$bin/lib/libkvfence.so" ./capi
rm -f "$bin/lib/libkvfence.h"
# The Python package and its device test, for the torch step.
mkdir -p "$bin/py/tests"
cp -r python/kvfence "$bin/py/"
find "$bin/py" -name __pycache__ -prune -exec rm -rf {} +
cp python/tests/test_torch_device.py "$bin/py/tests/"
gcc -std=c11 -Wall -Wextra -Werror -I capi/include capi/testdata/capi_test.c -L "$bin/lib" -lkvfence -lpthread \
	-Wl,-rpath,'$ORIGIN/lib' -s -o "$bin/capi_test"

sdk=$(scripts/cuda-sdk.sh)
sanitizer=$(eval "$sdk" && echo "$KVFENCE_SANITIZER")
cp -r "$sanitizer" "$bin/compute-sanitizer"
(
	eval "$sdk"
	CGO_CFLAGS="$CGO_CFLAGS -Wno-deprecated-declarations" \
		go test -tags gorgonia -c "${strip[@]}" -o "$bin/gorgoniacu.test" ./cudaops/gorgoniacu
)

# The memcheck step, a script of its own so that run.sh can bound it with
# timeout: the kernel's geometry check, the conformance suite's kernel
# fills and the pool's copy paths; it fails unless the tests pass and
# memcheck reports no error.
cat >"$bin/sanitize.sh" <<'SAN'
#!/usr/bin/env bash
set -u
# The machine's own compute-sanitizer matches its driver (CUDA 13 on the
# lent machines); the carried one (Debian's, older) is the fallback.
sanitizer=./compute-sanitizer/compute-sanitizer
for own in "$(command -v compute-sanitizer)" /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
	if [ -n "$own" ] && [ -x "$own" ]; then
		sanitizer=$own
		break
	fi
done
echo "sanitizer: $sanitizer ($("$sanitizer" --version 2>&1 | grep -i version | head -1))"
memcheck() {
	"$sanitizer" --tool memcheck --error-exitcode 3 --print-limit 20 \
		./cudaops.test "$@" -test.v -test.count=1 || exit
}
memcheck -test.run '^TestCUDAFillKernelGPU$'
memcheck -test.run '^TestCUDAConformance$/^kernel$/^(FillCorrectness|Spans|Pipelined)$'
memcheck -test.run '^TestCUDAPoolPathsGPU$'
SAN
chmod +x "$bin/sanitize.sh"
du -sh "$bin"/* "$bin"/compute-sanitizer/* >&2
tar -C "$bin" -czf "$carry/bundle.tar.gz" .

cat >"$carry/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs on the GPU machine; see scripts/gpu-check.sh. Exit status: 0 every
# step passed; 1 a step failed or did not fit the budget; 2 no usable GPU.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/kvfence-gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
tar -C "$work" -xzf "$here/bundle.tar.gz" || {
	echo "gpu-check: FAIL: cannot unpack $here/bundle.tar.gz" | tee "$out/summary.txt" >&2
	exit 1
}
cd "$work"
export KVFENCE_REQUIRE_GPU=1
budget=${KVFENCE_GPU_BUDGET:-350}
start=$SECONDS
rc=0
summary=()

{
	echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
	echo "host: $(uname -srm)"
	if command -v nvidia-smi >/dev/null; then
		echo "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | head -1)"
		nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.memory --format=csv 2>&1
	else
		echo "gpu: (no nvidia-smi)"
	fi
	echo "ldd cudaops.test:"
	ldd ./cudaops.test 2>&1
} >"$out/env.txt"
cat "$out/env.txt"

# The first check decides whether anything else runs.
if ! timeout -k 5 60 ./cudaops.test -test.run '^TestCUDADeviceUsable$' -test.v -test.count=1 >"$out/device.txt" 2>&1 ||
	! grep -q -- '--- PASS: TestCUDADeviceUsable' "$out/device.txt"; then
	cat "$out/device.txt" >&2
	echo "gpu-check: FAIL: no usable CUDA device here (GPU 0 did not open, or its fill kernel did not load and run); nothing else was run" | tee "$out/summary.txt" >&2
	exit 2
fi
grep -E 'device cuda' "$out/device.txt"

# step NAME SECONDS CMD...: runs CMD, output in $out/NAME.txt, for at most
# SECONDS and never past the budget; a failure, a timeout or a step the
# budget leaves no time for fails the run.
step() {
	local name=$1 limit=$2
	shift 2
	local left=$((budget - (SECONDS - start)))
	if [ "$left" -lt 10 ]; then
		echo "$name: NOT RUN (the ${budget} s budget is spent)" | tee "$out/$name.txt"
		summary+=("$name: NOT RUN")
		rc=1
		return
	fi
	if [ "$limit" -gt "$left" ]; then
		limit=$left
	fi
	local t0=$SECONDS
	echo "== $name (at most ${limit} s)"
	timeout -k 5 "$limit" "$@" >"$out/$name.txt" 2>&1
	local r=$?
	local verdict=ok
	if [ "$r" -ne 0 ]; then
		verdict="FAIL (exit $r)"
		if [ "$r" -eq 124 ] || [ "$r" -eq 137 ]; then
			verdict="FAIL (timed out after ${limit} s)"
		fi
		rc=1
		grep -E -e '--- FAIL|^FAIL|panic|Error|ERROR' "$out/$name.txt" | head -20
		tail -15 "$out/$name.txt"
	fi
	echo "   $verdict in $((SECONDS - t0)) s"
	summary+=("$name: $verdict in $((SECONDS - t0)) s")
}

step conformance 100 ./cudaops.test -test.v -test.count=1 -test.run '^(TestCUDAConformance|TestCUDAFillKernelGPU|TestCUDAPoolPathsGPU|TestOpenCUDAHere)$'
step sanitizer 90 ./sanitize.sh
step bench 120 ./cudaops.test -test.run '^$' -test.bench '^BenchmarkCUDAFill$' -test.benchtime 300ms -test.count 1
step staged 45 ./cudaops.test -test.run '^$' -test.bench '^BenchmarkCUDAStagedCopies$' -test.benchtime 300ms -test.count 1
step ordering 60 ./cudaops.test -test.v -test.count=1 -test.run '^(TestCUDAOrderingGPU|TestCUDAGroupGPU|TestRemoteRanksGPU)$'
step torch 60 env KVFENCE_LIB="$work/lib/libkvfence.so" PYTHONPATH="$work/py" \
	python3 -m pytest -q -s -rA -p no:cacheprovider py/tests/test_torch_device.py
step gpuinfo 20 ./gpuinfo.test -test.v -test.count=1
step kvbench 45 ./kvbench -device cuda -duration 5s -pool-pages 2048 -audit -out "$out/kvbench"
step capi 30 ./capi_test
if [ -x ./gorgoniacu.test ]; then
	step gorgoniacu 30 ./gorgoniacu.test -test.v -test.count=1
fi

echo "== benchmark"
grep -hE '^Benchmark' "$out/bench.txt" "$out/staged.txt"
{
	printf '%s\n' "${summary[@]}"
	if [ "$rc" -eq 0 ]; then
		echo "gpu-check: PASS in $((SECONDS - start)) s"
	else
		echo "gpu-check: FAIL in $((SECONDS - start)) s"
	fi
} | tee "$out/summary.txt"
exit $rc
RUN
chmod +x "$carry/run.sh"

# Every test the run names must exist: on the GPU a pattern that matches
# no test passes having run nothing. Each -test.run and -test.bench
# pattern in run.sh and sanitize.sh (its top level, before a subtest's /;
# each name of an alternation ^(A|B)$ on its own) is listed against the
# binary named on its line (sanitize.sh's memcheck runs cudaops.test).
for script in "$carry/run.sh" "$bin/sanitize.sh"; do
	while IFS= read -r line; do
		binary=$(grep -oP '\./\w+\.test' <<<"$line" | head -1 || true)
		binary=${binary:-./cudaops.test}
		for p in $(grep -oP -- "-test\.(run|bench) '\K[^']*" <<<"$line" || true); do
			top=${p%%/*}
			if [ "$top" = '^$' ]; then
				continue # no tests: the benchmarks alone
			elif [[ $top =~ ^\^\((.*)\)\$$ ]]; then
				names=${BASH_REMATCH[1]//|/ }
			else
				names=$top
				names=${names#^}
				names=${names%$}
			fi
			for name in $names; do
				if ! (cd "$bin" && "$binary" -test.list "^$name\$" 2>/dev/null) | grep -qx "$name"; then
					echo "gpu-check: ${binary#./} has no test or benchmark $name ($(basename "$script") names it)" >&2
					exit 1
				fi
			done
		done
	done <"$script"
done

size=$(du -sb "$carry" | cut -f1)
limit=$((64 << 20))
if [ "$size" -gt "$limit" ]; then
	echo "gpu-check: the bundle is $size bytes, over the 64 MiB a run carries" >&2
	exit 1
fi
echo "gpu-check: built $carry ($((size >> 20)) MiB; run $carry/run.sh on the GPU machine)" >&2
