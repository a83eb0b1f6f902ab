#!/usr/bin/env bash
# kvfence.vllm's KVCacheManager beside vLLM's own, both driven by the replay
# of vLLM's scheduler (python/tests/vllm_replay.py) in interleaved rounds of
# one run: ns per scheduled request per step, each round and min / median /
# max, and the ratio vLLM / kvfence. Not part of CI: it needs vLLM's source,
#   VLLM_SRC=/path/holding/vllm/v1/core scripts/bench-vllm-manager.sh [rounds]
# (see bench/vllmcmp/manager.py for the files it loads). Run it under
# `flock -x /work/bench.lock` on a shared machine.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${VLLM_SRC:?set VLLM_SRC to a directory holding vllm/v1/core/kv_cache_manager.py}"
rounds=${1:-5}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
go build -buildmode=c-shared -o "$tmp/libkvfence.so" ./capi
KVFENCE_LIB="$tmp/libkvfence.so" PYTHONPATH=python /usr/bin/python3 python/bench/bench_vllm_manager.py \
	--rounds "$rounds" --vllm-src "$VLLM_SRC"
