#!/usr/bin/env bash
# CI for handoff/ucxx, the handoff over UCX: installs Debian's libucx-dev
# and ucx-utils when they are missing (CI runs as root), checks that the
# package builds and reports UCX unavailable without it (no cgo, or
# without the build tag ucx), and runs its tests with it.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! dpkg -s libucx-dev ucx-utils >/dev/null 2>&1; then
	echo "ci-ucx: installing libucx-dev ucx-utils"
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libucx-dev ucx-utils >/dev/null
fi

echo "== without UCX: the package builds and says so"
go test -count=1 ./handoff/ucxx/...
CGO_ENABLED=0 go test -count=1 ./handoff/ucxx/...
