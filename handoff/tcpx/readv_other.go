//go:build !linux

package tcpx

import "net"

// readInto fills bufs, in order, from c. Only Linux's takes readv.
func readInto(c net.Conn, bufs [][]byte) error { return readFullInto(c, bufs) }
