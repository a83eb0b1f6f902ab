#!/usr/bin/env bash
# CI steps for the prefill → decode handoff beyond `go test -race ./...`
# (which .ci/run runs): fuzzing of the manifest codec, the data-frame
# parser and tcpx's frame reader past their seeds, and the two-process
# example over both transports. FUZZTIME overrides the fuzzing budget.
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime="${FUZZTIME:-20000x}" # inputs, not seconds: see .ci/run
# Fuzz the manifest decoder and parser, and the data-frame parser over
# messages in parts, briefly beyond their seed corpus.
go test -run '^$' -fuzz '^FuzzDecode$' -fuzztime "$fuzztime" ./handoff
go test -run '^$' -fuzz '^FuzzParse$' -fuzztime "$fuzztime" ./handoff
go test -run '^$' -fuzz '^FuzzParseData$' -fuzztime "$fuzztime" ./handoff
# And tcpx's frame reader, which reads what any peer sends.
go test -run '^$' -fuzz '^FuzzFrameReader$' -fuzztime "$fuzztime" ./handoff/tcpx
go run ./examples/disagg >/dev/null
go run ./examples/disagg -transport tcpx >/dev/null
