#!/usr/bin/env bash
# CI for kvfence's C ABI (capi/): builds libkvfence as a shared library and
# as a static archive, checks kvfence.h against the cgo-generated header,
# runs the C test program against both builds and under valgrind memcheck,
# and runs the Python demo (examples/python, on the package in python/). Run from anywhere; needs cgo and gcc,
# uses valgrind and python3 when present (set KVF_REQUIRE_ALL=1 to make
# their absence an error). Build outputs go to a temporary directory.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="$(mktemp -d "${TMPDIR:-/tmp}/kvfence-ci-capi.XXXXXX")"
trap 'rm -rf "$out"' EXIT

step() { printf '\n== %s\n' "$*"; }
missing() {
	if [[ "${KVF_REQUIRE_ALL:-0}" == 1 ]]; then
		echo "ci-capi: $1 not found" >&2
		exit 1
	fi
	echo "ci-capi: $1 not found, skipping: $2"
}

if [[ "$(go env CGO_ENABLED)" != 1 ]] || ! command -v gcc >/dev/null; then
	echo "ci-capi: needs cgo and gcc" >&2
	exit 1
fi

cflags=(-std=c11 -Wall -Wextra -Werror -I capi/include)

step "go test (bridge with -race, ABI checks, C program, Python example)"
go test -race -count=1 ./capi/internal/bridge/
go test -count=1 ./capi/

step "c-shared build and C test program"
go build -buildmode=c-shared -o "$out/shared/libkvfence.so" ./capi
gcc "${cflags[@]}" capi/testdata/capi_test.c -L "$out/shared" -lkvfence -lpthread -o "$out/shared/capi_test"
LD_LIBRARY_PATH="$out/shared" "$out/shared/capi_test"

step "C++ compiles against kvfence.h"
if command -v g++ >/dev/null; then
	printf '#include "kvfence.h"\nint main() { kvf_pool p = 0; return kvf_pool_create("{}", &p) == KVF_ERR_INVALID_CONFIG ? 0 : 1; }\n' >"$out/cxx.cc"
	g++ -std=c++17 -Wall -Wextra -Werror -I capi/include "$out/cxx.cc" -L "$out/shared" -lkvfence -o "$out/cxx"
	LD_LIBRARY_PATH="$out/shared" "$out/cxx" || { echo "ci-capi: C++ program failed" >&2; exit 1; }
else
	missing g++ "C++ header check"
fi

step "c-archive build and statically linked C test program"
go build -buildmode=c-archive -o "$out/archive/libkvfence.a" ./capi
gcc "${cflags[@]}" capi/testdata/capi_test.c "$out/archive/libkvfence.a" -lpthread -o "$out/archive/capi_test"
"$out/archive/capi_test"

step "valgrind memcheck"
if command -v valgrind >/dev/null; then
	# -tags valgrind makes the Go runtime describe its heap and stacks to
	# memcheck; asynchronous preemption writes to goroutine stacks in ways
	# those annotations do not cover, so it is turned off. Leaks of Go's
	# garbage-collected heap are suppressed (go-runtime.supp explains why);
	# a definite leak of C memory, or any memory error, fails the run.
	# nodwarf5: valgrind before 3.20 cannot read DWARF 5 line tables.
	# GOGC=off: when the collector reuses a span, the runtime announces the
	# new objects to memcheck without retiring the old ones, and memcheck's
	# leak pass can abort on the overlapping blocks ("the 'impossible'
	# happened"), depending on GC timing. With no collection nothing is
	# reused; the test program is short, so its heap stays small.
	GOEXPERIMENT=nodwarf5 go build -tags valgrind -buildmode=c-shared -o "$out/vg/libkvfence.so" ./capi
	gcc "${cflags[@]}" -g capi/testdata/capi_test.c -L "$out/vg" -lkvfence -lpthread -o "$out/vg/capi_test"
	GOGC=off GODEBUG=asyncpreemptoff=1 LD_LIBRARY_PATH="$out/vg" valgrind -q --error-exitcode=97 \
		--leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=definite \
		--suppressions=capi/testdata/go-runtime.supp "$out/vg/capi_test"
else
	missing valgrind "memcheck run"
fi

step "Python demo (examples/python/demo.py on python/kvfence)"
if command -v python3 >/dev/null; then
	KVFENCE_LIB="$out/shared/libkvfence.so" python3 examples/python/demo.py
else
	missing python3 "Python example"
fi

step "ci-capi: all passed"
