#!/usr/bin/env bash
# CI for what operators and routers read (metrics/, kvevents/,
# examples/router) beyond `go test ./...`: installs Debian's python3-zmq and
# python3-msgpack when /usr/bin/python3 lacks them (CI runs as root), runs
# the Python KV-event subscriber test with them required, fuzzes the
# ZMTP reader and handshake past their seeds, runs the collector's
# benchmark once (it checks its own result), and runs the router example
# briefly, scraping its /metrics and checking where its router sent each
# domain's requests, over NULL and over CURVE.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! /usr/bin/python3 -c 'import zmq, msgpack' 2>/dev/null; then
	echo "ci-ops: installing python3-zmq python3-msgpack"
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-zmq python3-msgpack >/dev/null
fi

echo "== Python subscriber (libzmq through pyzmq) against the publisher"
KVF_REQUIRE_ALL=1 KVF_PYTHON=/usr/bin/python3 go test -count=1 -run 'TestPythonSubscriber' ./kvevents

echo "== the ZMTP reader and handshake, which read what any peer sends, fuzzed"
for target in FuzzReadMessage FuzzHandshake; do
	go test -run '^$' -fuzz "^${target}\$" -fuzztime "${FUZZTIME:-20000x}" ./kvevents
done

echo "== collector and publisher benchmark, one iteration"
go test -run '^$' -bench . -benchtime 1x ./metrics >/dev/null

echo "== examples/router: -help, then two seconds of load with a scrape"
# Not `... | grep -q`: under pipefail, grep quitting at its first match can
# kill the writer with SIGPIPE (status 141) and fail the step.
help=$(go run ./examples/router -help 2>&1)
grep -q -- '-metrics' <<<"$help"
go build -o "${TMPDIR:-/tmp}/kvfence-router" ./examples/router
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
"${TMPDIR:-/tmp}/kvfence-router" -metrics 127.0.0.1:0 -events tcp://127.0.0.1:0 -replay tcp://127.0.0.1:0 -duration 3s 2>"$log" &
pid=$!
for _ in $(seq 50); do
	addr=$(sed -n 's|.*"metrics":"http://\([^/"]*\)/metrics".*|\1|p' "$log" | head -1)
	[ -n "$addr" ] && break
	sleep 0.1
done
[ -n "${addr:-}" ] || { cat "$log" >&2; echo "ci-ops: the router example did not start" >&2; exit 1; }
sleep 1
scrape=$(/usr/bin/python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://$addr/metrics').read().decode())")
for name in 'vllm:kv_cache_usage_perc' 'vllm:prefix_cache_hits_total' 'kvfence_admissions_total' 'kvfence_kv_event_batches_total'; do
	grep -q "^$name" <<<"$scrape" || { echo "ci-ops: /metrics lacks $name" >&2; exit 1; }
done
wait "$pid"
grep -q '"router example done"' "$log" || { cat "$log" >&2; exit 1; }
# The router side: acme's prompts on pod-a, globex's on pod-b, a third
# domain's on none; and every block indexed (none skipped).
routed() { grep -q "\"msg\":\"routed\",\"tenant\":\"$1\".*\"pod\":\"$2\"" "$log" || { cat "$log" >&2; echo "ci-ops: $1 not routed to $2" >&2; exit 1; }; }
check_routing() {
	routed acme-support pod-a
	routed globex pod-b
	routed initech none
	if grep -q '"routed".*"tenant":"initech".*"pod":"pod-' "$log" || grep -q '"routed".*"tenant":"acme-support".*"pod":"pod-b"' "$log"; then
		cat "$log" >&2; echo "ci-ops: a request routed to another domain's pod" >&2; exit 1
	fi
	grep -q '"router example done".*"blocks_skipped":0' "$log" || { cat "$log" >&2; echo "ci-ops: blocks the router could not index" >&2; exit 1; }
}
check_routing
echo "== examples/router over CURVE"
"${TMPDIR:-/tmp}/kvfence-router" -curve -metrics 127.0.0.1:0 -events tcp://127.0.0.1:0 -replay tcp://127.0.0.1:0 -duration 3s 2>"$log"
grep -q '"CURVE on"' "$log" || { cat "$log" >&2; exit 1; }
check_routing
echo "ci-ops: ok"
