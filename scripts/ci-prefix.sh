#!/usr/bin/env bash
# CI steps of the prefix cache beyond `go test -race ./...` (which
# .ci/run runs): short fuzzing of key derivation, matching and what hit
# pages hold, and a one-iteration run of its benchmarks so they keep
# compiling and passing their own checks. FUZZTIME overrides the fuzzing
# budget.
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime="${FUZZTIME:-20000x}" # inputs, not seconds: see .ci/run

for target in FuzzPageKeys FuzzPrefixMatch FuzzPrefixContentFollowsTokens; do
	go test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" ./kvcache
done
go test -run '^$' -bench 'PrefixMatch|PageKey' -benchtime 1x ./kvcache
