//go:build linux

package tcpx

import (
	"net"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// readInto fills bufs, in order, from c: with readv(2) where c has a
// file descriptor (plain TCP), so that the bytes go from the socket into
// bufs with no copy in between and one system call for many of them (a
// data frame's pages), else with the portable loop (TLS).
func readInto(c net.Conn, bufs [][]byte) error {
	if sc, ok := c.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil {
			return readvInto(rc, bufs)
		}
	}
	return readFullInto(c, bufs)
}

// maxIovecs is Linux's IOV_MAX: readv refuses more buffers (EINVAL).
const maxIovecs = 1024

// readvHook, set by tests, sees each readv's count.
var readvHook func(n int)

// readvInto fills bufs with readv on rc's descriptor, through its
// poller, so that the connection's read deadline (MessageTimeout,
// InterruptRecv's past one) ends a wait for bytes as it ends a Read.
func readvInto(rc syscall.RawConn, bufs [][]byte) error {
	var iovs [][]byte
	off := 0 // into bufs[0]: what a readv that ended there filled
	for {
		for len(bufs) > 0 && off == len(bufs[0]) {
			bufs, off = bufs[1:], 0
		}
		if len(bufs) == 0 {
			return nil
		}
		iovs = append(iovs[:0], bufs[0][off:])
		for _, b := range bufs[1:] {
			if len(iovs) == maxIovecs {
				break
			}
			if len(b) > 0 {
				iovs = append(iovs, b)
			}
		}
		var n int
		var rerr error
		err := rc.Read(func(fd uintptr) bool {
			for {
				n, rerr = unix.Readv(int(fd), iovs)
				if rerr != unix.EINTR {
					return rerr != unix.EAGAIN // EAGAIN: wait in the poller
				}
			}
		})
		switch {
		case err != nil:
			return err
		case rerr != nil:
			return os.NewSyscallError("readv", rerr)
		case n == 0:
			return errClosedEarly
		}
		if readvHook != nil {
			readvHook(n)
		}
		for n > 0 {
			k := min(n, len(bufs[0])-off)
			n, off = n-k, off+k
			if off == len(bufs[0]) {
				bufs, off = bufs[1:], 0
			}
		}
	}
}
