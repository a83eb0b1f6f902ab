#!/usr/bin/env bash
# ci-cuda.sh: the CUDA part of CI, for a machine without a GPU (.ci/run
# calls it). About a minute with a warm cache (.cache/cuda-sdk); the first
# run downloads ~860 MB of Debian packages (~40 s here).
#
#  1. fill.ptx assembles with ptxas for the oldest and newest targets,
#     without a stack frame or spills. (Its behaviour is tested by
#     go test: the simulated driver runs its text, internal/ptx.)
#  2. The gorgonia adapter is vetted and its tests compiled against the
#     CUDA 11.8 headers. They cannot run here: gorgonia.org/cu calls cuInit
#     in its package init and exits the process without a GPU.
#  3. cudaops tests run with the driver stub as libcuda.so.1 (cuInit fails
#     with CUDA_ERROR_STUB_LIBRARY: the tests must see ErrNoDevice and skip
#     the GPU parts, not crash), then without any libcuda, then built
#     without cgo.
#  4. The cudaops test binary must not link libcuda (the driver is opened
#     with dlopen at run time).
#  5. The GPU check's bundle (scripts/gpu-check.sh) builds within its size
#     limit, and its run.sh fails, with exit status 2, without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== ci-cuda: %s\n' "$*"; }

step "CUDA SDK (headers, stubs, ptxas)"
eval "$(scripts/cuda-sdk.sh)"
# go-nvml's header marks many functions deprecated; keep the log readable.
export CGO_CFLAGS="$CGO_CFLAGS -Wno-deprecated-declarations"

step "ptxas cudaops/fill.ptx"
# The oldest target the module declares and the H100/H200's. The fill
# must not spill or use a stack: a scrub that goes through local memory
# costs bandwidth the engine needs.
for arch in sm_50 sm_90; do
	info=$("$KVFENCE_PTXAS" -v -arch="$arch" cudaops/fill.ptx -o /dev/null 2>&1)
	echo "$info" | sed -n 's/^ptxas info *: Used/'"$arch"': used/p'
	if ! grep -q '0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads' <<<"$info"; then
		echo "$info" >&2
		echo "ci-cuda: kvf_fill uses a stack or spills on $arch" >&2
		exit 1
	fi
done

step "go vet -tags gorgonia (CUDA 11.8 headers)"
go vet -tags gorgonia ./...
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
go test -tags gorgonia -c -o "$tmp/gorgoniacu.test" ./cudaops/gorgoniacu

step "go test ./cudaops/... with the stub libcuda.so.1 on LD_LIBRARY_PATH"
LD_LIBRARY_PATH="$KVFENCE_CUDA_STUB_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
	KVFENCE_EXPECT_CUDA_ERROR=CUDA_ERROR_STUB_LIBRARY \
	go test -count=1 -race ./cudaops/...

step "go test ./cudaops/... without libcuda"
env -u LD_LIBRARY_PATH go test -count=1 ./cudaops/...

step "CGO_ENABLED=0 go test ./cudaops/..."
CGO_ENABLED=0 go test -count=1 ./cudaops/...

step "the cudaops test binary does not link libcuda"
go test -c -o "$tmp/cudaops.test" ./cudaops
if readelf -d "$tmp/cudaops.test" | grep NEEDED | grep -v -E '\[(libc|libdl|libpthread|libm)\.so'; then
	echo "cudaops.test links more than libc/libdl" >&2
	exit 1
fi
step "the GPU check's bundle builds, fits in 64 MiB, and fails without a GPU"
# scripts/gpu-check.sh is run for real only on a GPU machine; here its
# bundle must build (it checks its own size) and its run.sh must refuse,
# with exit status 2 and its message, to pass on a machine without a GPU
# (with the stub driver on the library path too).
scripts/gpu-check.sh "$tmp/carry"
for ld in "" "$KVFENCE_CUDA_STUB_LIB"; do
	set +e
	LD_LIBRARY_PATH="$ld" OUT="$tmp/gpu-out" "$tmp/carry/run.sh" >"$tmp/gpu-run.txt" 2>&1
	rc=$?
	set -e
	if [ "$rc" -ne 2 ] || ! grep -q 'gpu-check: FAIL: no usable CUDA device here' "$tmp/gpu-run.txt"; then
		cat "$tmp/gpu-run.txt" >&2
		echo "ci-cuda: run.sh exited $rc without a GPU (LD_LIBRARY_PATH='$ld'), want 2 and its message" >&2
		exit 1
	fi
done
echo "run.sh without a GPU: exit 2, \"$(tail -1 "$tmp/gpu-run.txt")\""
echo "ci-cuda: ok"
