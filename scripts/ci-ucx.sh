#!/usr/bin/env bash
# CI for handoff/ucxx, the handoff over UCX: installs Debian's libucx-dev
# and ucx-utils when they are missing (CI runs as root), checks that the
# package builds and reports UCX unavailable without it (no cgo, or
# without the build tag ucx), and runs its tests with it: over TCP and
# over shared memory (UCX_TLS=tcp; UCX_TLS=sm,self: sysv and posix, over
# which UCX emulates the puts), the conformance suite, the faults
# and the two-process tests; examples/disagg -transport ucx; then
# libkvfence built with UCX, its C test
# program and the Python package's UCX test over both.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! dpkg -s libucx-dev ucx-utils >/dev/null 2>&1; then
	echo "ci-ucx: installing libucx-dev ucx-utils"
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libucx-dev ucx-utils >/dev/null
fi

echo "== without UCX: the package builds and says so"
go test -count=1 ./handoff/ucxx/...
CGO_ENABLED=0 go test -count=1 ./handoff/ucxx/...

echo "== with UCX: vet, and the tests over TCP (with -race) and over shared memory"
go vet -tags ucx ./handoff/ucxx/...
UCX_TLS=tcp go test -race -count=1 -tags ucx ./handoff/ucxx/...
UCX_TLS=sm,self go test -count=1 -tags ucx ./handoff/ucxx/...

echo "== the transport's share of a handoff, one iteration (it checks its result)"
UCX_TLS=sm,self go test -run '^$' -bench '^BenchmarkPut$' -benchtime 1x -tags ucx ./handoff/ucxx/ >/dev/null

echo "== examples/disagg over UCX: a hybrid model's every group, over shared memory and TCP"
UCX_TLS=sm,self go run -tags ucx ./examples/disagg -transport ucx -model glm-5.3-flash >/dev/null
UCX_TLS=tcp go run -tags ucx ./examples/disagg -transport ucx -model qwen3-next-80b-a3b >/dev/null

echo "== the C ABI and the Python package, with UCX in libkvfence"
out="$(mktemp -d "${TMPDIR:-/tmp}/kvfence-ci-ucx.XXXXXX")"
trap 'rm -rf "$out"' EXIT
go test -count=1 -tags ucx ./capi/internal/bridge/
go build -tags ucx -buildmode=c-shared -o "$out/libkvfence.so" ./capi
gcc -std=c11 -Wall -Wextra -Werror -I capi/include capi/testdata/capi_test.c -L "$out" -lkvfence -lpthread -o "$out/capi_test"
for tls in tcp sm,self; do
	UCX_TLS=$tls LD_LIBRARY_PATH="$out" "$out/capi_test"
	if /usr/bin/python3 -c 'import pytest, numpy, torch' 2>/dev/null; then
		(cd python/tests && UCX_TLS=$tls KVF_REQUIRE_UCX=1 KVFENCE_LIB="$out/libkvfence.so" PYTHONPATH=.. \
			PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 -m pytest -q -p no:cacheprovider test_ucx_handoff.py)
	else
		echo "ci-ucx: Debian's python3 lacks pytest/numpy/torch (ci-python.sh installs them): Python's UCX test skipped"
	fi
done
