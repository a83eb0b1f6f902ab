#!/usr/bin/env bash
# ci-cuda.sh: the CUDA part of CI, for a machine without a GPU (.ci/run
# calls it). About a minute with a warm cache (.cache/cuda-sdk); the first
# run downloads ~860 MB of Debian packages (~40 s here).
#
#  1. fill.ptx assembles with ptxas for the oldest and newest targets.
#  2. The gorgonia adapter is vetted and its tests compiled against the
#     CUDA 11.8 headers. They cannot run here: gorgonia.org/cu calls cuInit
#     in its package init and exits the process without a GPU.
#  3. cudaops tests run with the driver stub as libcuda.so.1 (cuInit fails
#     with CUDA_ERROR_STUB_LIBRARY: the tests must see ErrNoDevice and skip
#     the GPU parts, not crash), then without any libcuda, then built
#     without cgo.
#  4. The cudaops test binary must not link libcuda (the driver is opened
#     with dlopen at run time).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== ci-cuda: %s\n' "$*"; }

step "CUDA SDK (headers, stubs, ptxas)"
eval "$(scripts/cuda-sdk.sh)"
# go-nvml's header marks many functions deprecated; keep the log readable.
export CGO_CFLAGS="$CGO_CFLAGS -Wno-deprecated-declarations"

step "ptxas cudaops/fill.ptx"
for arch in sm_50 sm_90; do
	"$KVFENCE_PTXAS" -arch="$arch" cudaops/fill.ptx -o /dev/null
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
echo "ci-cuda: ok"
