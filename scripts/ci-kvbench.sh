#!/bin/sh
# CI step for bench/: the kvbench tests, a short kvbench acceptance run
# with the prefix cache on and both sharing-domain layouts (JSON and all
# three plots written, audit of every safe policy passes, the unsafe
# baseline's fails, the layouts compared), and one iteration of every
# benchmark, so that they keep compiling, running and passing their result
# checks.
# Takes about 30 s on a 2-core machine; needs ~300 MiB of memory.
set -eu
cd "$(dirname "$0")/.."

go test ./bench/...

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
go run ./bench/cmd/kvbench -duration 5s -pool-pages 2048 -audit -domains per-tenant,shared -out "$out" >"$out/stdout.txt"
test -s "$out/report.json"
# Every plot is written, saying "no data" where it has none; a plot that
# fails makes kvbench exit 1 above, so all three are there.
for plot in utilisation.png admission-latency-cdf.png scrub-bandwidth.png; do
	test -s "$out/$plot" || {
		echo "ci-kvbench: $plot missing or empty in $out" >&2
		exit 1
	}
done
for want in 'audit none/per-tenant: FAILED' 'audit none/shared: FAILED' 'shared vs per-tenant domains'; do
	grep -q "$want" "$out/stdout.txt" || {
		echo "ci-kvbench: want \"$want\" in the report (the unsafe baseline's audit finds stale pages; the layouts are compared)" >&2
		cat "$out/stdout.txt" >&2
		exit 1
	}
done

go test -run '^$' -bench . -benchtime 1x ./bench/ >/dev/null
echo "ci-kvbench: ok"
