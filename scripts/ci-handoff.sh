#!/usr/bin/env bash
# CI steps for the prefill → decode handoff (issue 5). Run from the repo root.
set -euo pipefail
go test -race -count=1 ./handoff/... 
go test -race -count=1 -run 'Phase|Export|Import|Reclaim' ./kvcache
# Fuzz the manifest decoder and parser briefly beyond their seed corpus.
go test -run '^$' -fuzz '^FuzzDecode$' -fuzztime 10s ./handoff
go test -run '^$' -fuzz '^FuzzParse$' -fuzztime 10s ./handoff
go run ./examples/disagg >/dev/null
