#!/usr/bin/env bash
# CI steps for the prefill → decode handoff beyond `go test -race ./...`
# (which .ci/run runs): fuzzing of the manifest codec, the data-frame
# parser, the receiver's Serve and tcpx's hello and frame reader past
# their seeds, and the two-process example over both transports.
# FUZZTIME overrides the fuzzing budget.
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime="${FUZZTIME:-20000x}" # inputs, not seconds: see .ci/run
# Fuzz the manifest decoder and parser, and the data-frame parser over
# messages in parts, briefly beyond their seed corpus.
go test -run '^$' -fuzz '^FuzzDecode$' -fuzztime "$fuzztime" ./handoff
go test -run '^$' -fuzz '^FuzzParse$' -fuzztime "$fuzztime" ./handoff
go test -run '^$' -fuzz '^FuzzParseData$' -fuzztime "$fuzztime" ./handoff
# And the grant of remote memory, whatever bytes a receiver signs.
go test -run '^$' -fuzz '^FuzzParseGrant$' -fuzztime "$fuzztime" ./handoff
# Serve after a genuine manifest, whatever messages follow.
go test -run '^$' -fuzz '^FuzzServe$' -fuzztime "$fuzztime" ./handoff
go test -run '^$' -fuzz '^FuzzServeHybrid$' -fuzztime "$fuzztime" ./handoff
# And after a remote transfer's manifest, whatever messages and writes.
go test -run '^$' -fuzz '^FuzzServeRemote$' -fuzztime "$fuzztime" ./handoff
# And where the receiver sums each block as it lands (a transport that
# writes on its threads): writes in any order and pieces.
go test -run '^$' -fuzz '^FuzzServeRemoteWatched$' -fuzztime "$fuzztime" ./handoff
# And tcpx's hello and frame reader, which read what any peer sends.
go test -run '^$' -fuzz '^FuzzHello$' -fuzztime "$fuzztime" ./handoff/tcpx
go test -run '^$' -fuzz '^FuzzFrameReader$' -fuzztime "$fuzztime" ./handoff/tcpx
go run ./examples/disagg >/dev/null
go run ./examples/disagg -transport tcpx >/dev/null
# Hybrid models through the handoff: every cache group (MLA latents and
# the indexer per token with a KDA state slot; a sliding window; a Gated
# DeltaNet state slot) crosses, and the decode lease's digest matches the
# prefill's.
go run ./examples/disagg -model glm-5.3-flash -transport tcpx >/dev/null
go run ./examples/disagg -model gpt-oss-120b >/dev/null
go run ./examples/disagg -model qwen3-next-80b-a3b -transport tcpx >/dev/null
