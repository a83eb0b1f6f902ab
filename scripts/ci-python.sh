#!/usr/bin/env bash
# CI for the Python package (python/): installs Debian's python3-torch,
# python3-numpy and python3-pytest when /usr/bin/python3 lacks them (CI
# runs as root), installs the package with pip into a virtual environment
# over Debian's Python (--system-site-packages, so torch is there; no
# index is reached: --no-index --no-build-isolation), which builds
# libkvfence.so with Go, runs the pytest suite against the installed
# package, and checks that it imports with the standard library alone
# (pyenv's or any python3 without torch). Build outputs go to a temporary
# directory; the source tree is not written.
#
# Debian's packages go to /usr/bin/python3, whatever `python3` on PATH is
# (on developer machines pyenv's): every Python here is named by path.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py=/usr/bin/python3
out="$(mktemp -d "${TMPDIR:-/tmp}/kvfence-ci-python.XXXXXX")"
trap 'rm -rf "$out"' EXIT
step() { printf '\n== %s (%ds)\n' "$*" "$SECONDS"; }

step "Debian's python3 with torch, numpy, pytest, venv"
if [[ ! -x $py ]]; then
	echo "ci-python: $py not found (Debian's python3)" >&2
	exit 1
fi
if ! $py -c 'import torch, numpy, pytest, venv, ensurepip' 2>/dev/null; then
	echo "ci-python: installing python3-torch python3-numpy python3-pytest python3-venv"
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-torch python3-numpy python3-pytest python3-venv >/dev/null
fi
$py -c 'import torch, numpy, pytest; print("torch", torch.__version__, "numpy", numpy.__version__, "pytest", pytest.__version__)'

step "pip install ./python (builds libkvfence.so with Go, offline)"
# A copy of python/, so that setuptools' build/ and egg-info stay out of
# the tree; KVFENCE_GO_SRC names the checkout the library is built from.
cp -r python "$out/src"
rm -rf "$out/src/build" "$out/src"/*.egg-info "$out/src/kvfence/libkvfence.so"
$py -m venv --system-site-packages "$out/venv"
PATH="$(dirname "$(go env GOROOT)/bin/go"):$PATH" KVFENCE_GO_SRC="$root" \
	"$out/venv/bin/pip" install -q --no-index --no-build-isolation "$out/src"
(cd "$out" && venv/bin/python -c '
import kvfence, os
lib = kvfence.library_path()
assert lib.endswith("site-packages/kvfence/libkvfence.so"), lib
print("kvfence", kvfence.__version__, "libkvfence", kvfence.version(), "ABI", kvfence.abi_version(), "at", lib)')

step "pytest against the installed package (torch, CPU)"
# From a directory outside the tree: `import kvfence` finds the installed one.
cp -r python/tests "$out/tests"
(cd "$out/tests" && env -u KVFENCE_LIB PYTHONDONTWRITEBYTECODE=1 "$out/venv/bin/python" -m pytest -q -p no:cacheprovider .)

step "the package imports with the standard library alone"
site="$(cd "$out" && venv/bin/python -c 'import kvfence, os; print(os.path.dirname(os.path.dirname(kvfence.__file__)))')"
for other in python3 "$py"; do
	(cd "$out" && PYTHONPATH="$site" "$other" -S -c '
import sys
import kvfence
import kvfence.vllm
assert "torch" not in sys.modules and "numpy" not in sys.modules, "kvfence imported torch or numpy"
with kvfence.Pool({"geometry": {"tokens_per_page": 16, "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "fp16"},
                   "pages": 4, "max_context_tokens": 64, "tenants": [{"name": "a"}]}) as pool:
    with pool.admit_tokens("r", "a", list(range(20))) as lease:
        assert len(lease.block_table()) == 2
    mv = pool.region(0).memoryview()
    assert len(mv) == 4 * 16 * 8 * 2
    del mv
print(sys.executable, "ok without torch")')
done

step "ci-python: all passed"
