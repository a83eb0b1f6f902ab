#!/usr/bin/env bash
# ucx-floor.sh: what UCX's own tool costs to move 256 MiB between two
# processes over the transports UCX_TLS names (tcp by default), in CPU of
# both processes per 256 MiB, with its send buffer as it ships it and with
# the buffer made of real pages.
#
# ucx_perftest never writes its send buffer, so every page of it reads as
# the kernel's zero page, always in cache: its send copies cost a fraction
# of what sending a handoff's prefill pages does. Here an LD_PRELOAD shim
# wraps ucp_mem_map and fills each buffer UCX allocates, and the CPU is read
# from /proc over a window of steady transfer (start-up, which costs 1-5 s
# of CPU and varies, left out), divided by the bytes moved in it.
# bench/results/2026-12-05-ucx-10.txt has the figures and what they bound.
#
#   scripts/ucx-floor.sh [TEST...]     (default: ucp_am_bw; e.g. ucp_tag_bw ucp_put_bw)
#
# Needs ucx_perftest (Debian's ucx-utils), libucx-dev, gcc and python3; takes
# about 25 s a test. Run it on an otherwise idle machine.
set -euo pipefail
tests=("${@:-ucp_am_bw}")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/fill.c" <<'EOF'
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>
#include <ucp/api/ucp.h>

/* ucp_mem_map, then every byte of the memory it allocated written: real
 * pages, as a sender's are, instead of never-touched ones. */
ucs_status_t ucp_mem_map(ucp_context_h ctx, const ucp_mem_map_params_t *params, ucp_mem_h *memh)
{
	static ucs_status_t (*real)(ucp_context_h, const ucp_mem_map_params_t *, ucp_mem_h *);
	if (real == NULL) {
		real = dlsym(RTLD_NEXT, "ucp_mem_map");
	}
	ucs_status_t st = real(ctx, params, memh);
	if (st == UCS_OK && (params->field_mask & UCP_MEM_MAP_PARAM_FIELD_FLAGS) &&
	    (params->flags & UCP_MEM_MAP_ALLOCATE)) {
		ucp_mem_attr_t attr = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH};
		if (ucp_mem_query(*memh, &attr) == UCS_OK) {
			memset(attr.address, 0xa5, attr.length);
		}
	}
	return st;
}
EOF
gcc -O2 -shared -fPIC -o "$dir/fill.so" "$dir/fill.c" -ldl -lucp
cat >"$dir/floor.py" <<'EOF'
import os, random, subprocess, sys, time

test, preload = sys.argv[1], sys.argv[2]
size = 256 << 20
env = dict(os.environ)
env.setdefault('UCX_TLS', 'tcp')
env.setdefault('UCX_TCP_TX_SEG_SIZE', '1M')  # as ucxx configures UCX
env.setdefault('UCX_TCP_RX_SEG_SIZE', '1M')
env.setdefault('UCX_MM_SEG_SIZE', '32K')
env.setdefault('UCX_RNDV_THRESH', '65536')
if preload:
    env['LD_PRELOAD'] = preload
port = str(20000 + random.randrange(10000))
args = ['-p', port, '-t', test, '-s', str(size), '-n', '240', '-w', '1', '-E', 'sleep']
srv = subprocess.Popen(['ucx_perftest'] + args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(1.5)  # for the server to listen (and fill its buffers)
cli = subprocess.Popen(['ucx_perftest', '127.0.0.1'] + args, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

def cpu(p):
    f = open(f'/proc/{p.pid}/stat').read().rsplit(')', 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf('SC_CLK_TCK')

time.sleep(4)
c0, t0 = cpu(srv) + cpu(cli), time.monotonic()
time.sleep(5)
c1, t1 = cpu(srv) + cpu(cli), time.monotonic()
out = cli.communicate()[0]
srv.wait()
for line in out.splitlines():
    f = line.split()
    if f and f[0] == 'Final:':
        bps = float(f[6]) * (1 << 20)  # its MB/s are MiB/s
        ms = (c1 - c0) * 1000 / ((t1 - t0) * bps / size)
        print(f'{test:14} {"real pages" if preload else "zero page ":10}  {bps / 1e9:5.2f} GB/s  {ms:6.1f} cpu-ms per 256 MiB')
        break
else:
    sys.exit(f'ucx_perftest {test} said:\n{out}')
EOF
echo "# ucx_perftest, 256 MiB messages, UCX_TLS=${UCX_TLS:-tcp}, UCX $(ucx_info -v | sed -n -e 's/^# Library version: //p' -e 's/^# Version //p' | head -1)"
for t in "${tests[@]}"; do
	python3 "$dir/floor.py" "$t" ""
	python3 "$dir/floor.py" "$t" "$dir/fill.so"
done
