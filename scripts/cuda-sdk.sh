#!/usr/bin/env bash
# cuda-sdk.sh: fetch the CUDA 11.8 headers and the driver stub library that
# CI needs to compile kvfence's gorgonia.org/cu adapter, without a GPU and
# without installing anything.
#
# It downloads Debian bookworm's nvidia-cuda-dev package (non-free, about
# 774 MB) with `apt-get download`, using a private apt configuration under
# the cache directory so that neither /etc/apt nor the system's package lists
# change, and extracts only usr/include and the stub libraries
# (usr/lib/x86_64-linux-gnu/stubs/) from it, plus, from nvidia-cuda-toolkit
# (84 MB), ptxas to assemble the fill kernel and compute-sanitizer (its
# binary and the libraries it loads from its own directory, flat in
# compute-sanitizer/) for scripts/gpu-check.sh to carry. The .debs are
# deleted afterwards; the extracted tree (about 56 MB) is the cache. A
# second run finds the marker file and only prints the exports.
#
# Usage:
#   eval "$(scripts/cuda-sdk.sh)"      # sets CGO_CFLAGS, CGO_LDFLAGS,
#                                      # KVFENCE_CUDA_SDK, KVFENCE_CUDA_STUB_LIB,
#                                      # KVFENCE_PTXAS, KVFENCE_SANITIZER
#   CUDA_SDK_DIR=/elsewhere scripts/cuda-sdk.sh
#
# Progress goes to stderr; stdout carries only the export lines.
#
# KVFENCE_CUDA_STUB_LIB is a directory holding the stubs as libcuda.so.1 and
# libnvidia-ml.so.1 (the names the driver's libraries have on a real machine,
# and the names kvfence and go-nvml dlopen). Put it
# on LD_LIBRARY_PATH to exercise the "driver present, cuInit fails with
# CUDA_ERROR_STUB_LIBRARY (34)" path. Never put it on LD_LIBRARY_PATH of a GPU
# machine: it would hide the real driver.
#
# The gorgonia adapter (build tag `gorgonia`) can be compiled and vetted with
# these flags but its tests cannot be *run* without a GPU: gorgonia.org/cu
# calls cuInit in its package init and os.Exit(1)s when that fails, before
# any test can skip. Compile them with `go test -c` / `go vet` only.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dir=${CUDA_SDK_DIR:-$root/.cache/cuda-sdk}
pkg=nvidia-cuda-dev
toolkit=nvidia-cuda-toolkit
marker=$dir/.complete

log() { printf 'cuda-sdk: %s\n' "$*" >&2; }

# A cache from before compute-sanitizer was kept is fetched again.
if [ ! -f "$marker" ] || [ ! -x "$dir/compute-sanitizer/compute-sanitizer" ]; then
	arch=$(dpkg --print-architecture)
	if [ "$arch" != amd64 ]; then
		log "only amd64 is supported (this is $arch)"
		exit 1
	fi
	# shellcheck disable=SC1091
	codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
	if [ "$codename" != bookworm ]; then
		# Other releases carry other CUDA versions; gorgonia.org/cu v0.9.6
		# does not compile against CUDA 13 headers. Pin bookworm (11.8).
		log "this is '$codename'; fetching from bookworm anyway (CUDA 11.8)"
	fi
	keyring=/usr/share/keyrings/debian-archive-keyring.gpg
	if [ ! -r "$keyring" ]; then
		log "missing $keyring (apt-get install debian-archive-keyring)"
		exit 1
	fi

	rm -rf "$dir"
	apt=$dir/.apt
	mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/dl"
	cat >"$apt/sources.list" <<SRC
deb [signed-by=$keyring] http://deb.debian.org/debian bookworm non-free
deb [signed-by=$keyring] http://deb.debian.org/debian bookworm-updates non-free
SRC
	opts=(
		-o "Dir::Etc::SourceList=$apt/sources.list"
		-o "Dir::Etc::SourceParts=/dev/null"
		-o "Dir::State::Lists=$apt/lists"
		-o "Dir::Cache=$apt/cache"
		-o "APT::Sandbox::User=$(id -un)"
		-o "Debug::NoLocking=1"
	)
	log "updating a private package list (bookworm non-free)"
	apt-get "${opts[@]}" -qq update >&2
	log "downloading $pkg (about 774 MB) and $toolkit (84 MB, for ptxas)"
	(cd "$apt/dl" && apt-get "${opts[@]}" -qq download "$pkg" "$toolkit" >&2)
	deb=$(ls "$apt"/dl/"$pkg"_*.deb)
	version=$(dpkg-deb -f "$deb" Version)

	# dpkg-deb -x would unpack all 2.8 GB; stream the data archive instead
	# and let tar keep only the two trees we need.
	log "extracting usr/include and stubs from $(basename "$deb")"
	dpkg-deb --fsys-tarfile "$deb" |
		tar -x -C "$dir" --wildcards './usr/include/*' './usr/lib/x86_64-linux-gnu/stubs/*'
	stub=$dir/usr/lib/x86_64-linux-gnu/stubs/libcuda.so
	if [ ! -f "$dir/usr/include/cuda.h" ] || [ ! -e "$stub" ]; then
		log "the package did not contain usr/include/cuda.h and stubs/libcuda.so"
		exit 1
	fi
	# The driver's runtime names, for LD_LIBRARY_PATH: cuInit then fails
	# with CUDA_ERROR_STUB_LIBRARY and nvmlInit with DRIVER_NOT_LOADED.
	# ptxas assembles fill.ptx in CI, so a PTX error shows up without a GPU.
	tk=$(ls "$apt"/dl/"$toolkit"_*.deb)
	dpkg-deb --fsys-tarfile "$tk" | tar -x -C "$dir" ./usr/bin/ptxas
	# compute-sanitizer finds its injection libraries beside itself.
	mkdir -p "$dir/compute-sanitizer" "$apt/cs"
	dpkg-deb --fsys-tarfile "$tk" |
		tar -x -C "$apt/cs" ./usr/bin/compute-sanitizer --wildcards './usr/lib/nvidia-cuda-toolkit/compute-sanitizer/*.so'
	mv "$apt/cs/usr/bin/compute-sanitizer" "$apt"/cs/usr/lib/nvidia-cuda-toolkit/compute-sanitizer/*.so "$dir/compute-sanitizer/"
	if [ ! -x "$dir/compute-sanitizer/compute-sanitizer" ] || [ ! -f "$dir/compute-sanitizer/libsanitizer-collection.so" ]; then
		log "$toolkit did not contain compute-sanitizer and its libraries"
		exit 1
	fi
	mkdir -p "$dir/stub-libs"
	cp -L "$stub" "$dir/stub-libs/libcuda.so.1"
	cp -L "${stub%/*}/libnvidia-ml.so" "$dir/stub-libs/libnvidia-ml.so.1"
	rm -rf "$apt"
	echo "$pkg $version" >"$marker"
	log "cached $pkg $version in $dir"
fi

inc=$dir/usr/include
lib=$dir/usr/lib/x86_64-linux-gnu/stubs
printf 'export KVFENCE_CUDA_SDK=%q\n' "$dir"
printf 'export KVFENCE_CUDA_STUB_LIB=%q\n' "$dir/stub-libs"
printf 'export KVFENCE_PTXAS=%q\n' "$dir/usr/bin/ptxas"
printf 'export KVFENCE_SANITIZER=%q\n' "$dir/compute-sanitizer"
printf 'export CGO_CFLAGS=%q\n' "-O2 -g -I$inc"
printf 'export CGO_LDFLAGS=%q\n' "-L$lib"
