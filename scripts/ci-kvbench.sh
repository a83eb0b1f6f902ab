#!/bin/sh
# CI step for bench/: the kvbench tests, a short kvbench acceptance run
# (JSON + plots written, audit of every safe policy passes), and one
# iteration of every benchmark so that they keep compiling and running.
# Takes about 30 s on a 2-core machine; needs ~600 MiB of memory.
set -eu
cd "$(dirname "$0")/.."

go test ./bench/...

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
go run ./bench/cmd/kvbench -duration 2s -audit -out "$out" >"$out/stdout.txt"
test -s "$out/report.json"
plots=$(find "$out" -name '*.png' | wc -l)
if [ "$plots" -lt 2 ]; then
	echo "ci-kvbench: expected at least 2 plots in $out, found $plots" >&2
	exit 1
fi
grep -q 'audit none: FAILED' "$out/stdout.txt" || {
	echo "ci-kvbench: the unsafe baseline's audit should find stale pages" >&2
	cat "$out/stdout.txt" >&2
	exit 1
}

go test -run '^$' -bench . -benchtime 1x ./bench/ >/dev/null
echo "ci-kvbench: ok"
