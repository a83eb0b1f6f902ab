#!/bin/sh
# CI step for bench/: the kvbench tests, the trace importers fuzzed, a
# short kvbench acceptance run
# with the prefix cache on and both sharing-domain layouts (JSON and all
# plots written, audit of every safe policy passes, the unsafe
# baseline's fails, the layouts compared), full against on-demand lease
# sizing (growth, preemption, re-admission), a Mooncake-format trace
# imported and replayed against its bound, and by a hybrid model with
# state checkpoints, the incident's shape (every
# request longer than the context window) replayed to the end, and one
# iteration of every benchmark, so that they keep compiling, running and
# passing their result checks (-short: the replay of Mooncake's
# conversation trace only on its small pool, and only where the public
# traces are present, ../shared/traces or $KVFENCE_TRACES).
# Takes about 20 s on a 2-core machine with the public traces (they add
# about 10 s); needs ~300 MiB of memory.
set -eu
cd "$(dirname "$0")/.."

go test ./bench/...
# The importers beyond their seeds (.ci/run fuzzes kvbench's own format).
go test -run '^$' -fuzz '^FuzzReadTrace$' -fuzztime "${FUZZTIME:-20000x}" ./bench/internal/kvsim

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
plots="hit-rate.png queue.png utilisation.png admission-latency-cdf.png scrub-bandwidth.png"
# Every plot is written, saying "no data" where it has none; a plot that
# fails makes kvbench exit 1, so all of them must be there.
check_plots() {
	for plot in $plots; do
		test -s "$1/$plot" || {
			echo "ci-kvbench: $plot missing or empty in $1" >&2
			exit 1
		}
	done
}
want() { # want FILE TEXT WHY
	grep -q -- "$2" "$1" || {
		echo "ci-kvbench: want \"$2\" in the report ($3)" >&2
		cat "$1" >&2
		exit 1
	}
}
go build -o "$out/kvbench" ./bench/cmd/kvbench

"$out/kvbench" -duration 5s -pool-pages 2048 -audit -domains per-tenant,shared -out "$out/synthetic" >"$out/synthetic.txt"
test -s "$out/synthetic/report.json"
check_plots "$out/synthetic"
for w in 'audit none/per-tenant: FAILED' 'audit none/shared: FAILED' 'shared vs per-tenant domains'; do
	want "$out/synthetic.txt" "$w" "the unsafe baseline's audit finds stale pages; the layouts are compared"
done

# A Mooncake trace (chains of 512-token blocks): 60 requests, every one
# opening with block 0, odd ones continuing the conversation before them.
awk 'BEGIN {
	next_id = 1
	for (i = 0; i < 60; i++) {
		if (i % 2 == 0) chain = "0"
		chain = chain ", " next_id++
		n = split(chain, ids, ", ")
		printf "{\"timestamp\": %d, \"input_length\": %d, \"output_length\": %d, \"hash_ids\": [%s]}\n", 250 * i, 512 * n - 100, 8, chain
	}
}' >"$out/mooncake.jsonl"
"$out/kvbench" -trace "$out/mooncake.jsonl" -trace-tenants 4 -org-size 2 -domains per-tenant,shared -policies zero,none \
	-layers 1 -kv-heads 1 -head-dim 2 -pool-tokens 1M -audit -out "$out/mooncake" >"$out/mooncake.txt"
check_plots "$out/mooncake"
for w in '(mooncake, blocks of 512 tokens), 60 requests from 4 tenants' "infinite-cache hit rate (the trace's bound)" 'hit rate  bound  served' \
	'audit zero/shared: passed'; do
	want "$out/mooncake.txt" "$w" "the Mooncake trace is imported and replayed against its bound"
done

# A hybrid model (Qwen3-Next: a state slot per lease) on the same trace:
# prefixes are shared through state checkpoints, taken at page-aligned
# prefill chunk ends; the report compares its hits with the same trace on
# its per-token pages alone, and the audit covers the restored prefixes
# and every state slot handed out.
"$out/kvbench" -trace "$out/mooncake.jsonl" -model qwen3-next-80b-a3b -state-shrink 64 -max-leases 8 -checkpoint-slots 32 \
	-prefill-tokens 512 -pool-tokens 64k -policies zero,none -audit -out "$out/hybrid" >"$out/hybrid.txt"
check_plots "$out/hybrid"
for w in 'model: qwen3-next-80b-a3b' 'state checkpoints (hit rate' 'per-token only' 'audit zero: passed' 'state slots checked' 'audit none: FAILED'; do
	want "$out/hybrid.txt" "$w" "a hybrid model replays with state checkpoints against its per-token pages alone"
done
test "$(grep -c '"hits": [1-9]' "$out/hybrid/report.json")" -ge 2 || {
	echo "ci-kvbench: want checkpoint hits in both runs of $out/hybrid/report.json" >&2
	exit 1
}

# Leases sized on demand against full reservation, every budget the rest
# of an 8k window on a pool of one window: full sizing runs one request at
# a time, on-demand runs many, preempts when growth is refused, and the
# preempted requests are admitted again; the audit covers grown and
# re-admitted pages.
"$out/kvbench" -duration 3s -rate 20 -pool-pages 512 -max-context 8192 -budget window -sizing full,on-demand -policies zero,none \
	-audit -out "$out/sizing" >"$out/sizing.txt"
check_plots "$out/sizing"
for w in 'on-demand vs full sizing (512 pages, per-tenant, zero): concurrent' 'audit zero/on-demand: passed' 'audit none/on-demand: FAILED'; do
	want "$out/sizing.txt" "$w" "full and on-demand sizing are compared, the audit covers grown pages"
done
test "$(grep -c '"preempted": [1-9]' "$out/sizing/report.json")" -ge 2 || {
	echo "ci-kvbench: want preemptions in both on-demand runs of $out/sizing/report.json" >&2
	exit 1
}

# The incident's shape: every request longer than the 1,048,576-token
# window, on a pool of 681,280 tokens. It runs to the end and refuses
# each request, by reason.
awk 'BEGIN {
	print "{\"type\":\"tenant\",\"name\":\"a\"}"
	for (i = 0; i < 100; i++) printf "{\"type\":\"request\",\"at\":%g,\"tenant\":\"a\",\"prompt\":%d,\"output\":1}\n", 0.1 * i, 1048577 + i
}' >"$out/incident.jsonl"
"$out/kvbench" -trace "$out/incident.jsonl" -max-context 1048576 -pool-tokens 681280 -layers 1 -kv-heads 1 -head-dim 2 \
	-policies zero,none -out "$out/incident" >"$out/incident.txt"
check_plots "$out/incident"
want "$out/incident.txt" 'refused:exceeds_max_context' "every refusal is reported by reason"
test "$(grep -c '"exceeds_max_context": 100' "$out/incident/report.json")" -ge 4 || {
	echo "ci-kvbench: want 100 exceeds_max_context refusals and drops in each run of $out/incident/report.json" >&2
	exit 1
}

go test -short -run '^$' -bench . -benchtime 1x ./bench/ >/dev/null
echo "ci-kvbench: ok"
