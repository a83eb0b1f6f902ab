//go:build cgo && ucx

package ucxx

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"

	"github.com/kvfence/kvfence/handoff"
)

// The two ends of a transfer meet over a TCP connection: each sends its
// hello, and each then creates a UCX endpoint to the other's worker from
// the address in it (the way UCX's perftest and NIXL connect, and the
// one way in UCX 1.13 to use every transport, shared memory included:
// its sockaddr connection manager picks network devices only).
//
//	hello: "KVFUCX" version u8, connection ID u64, worker address length
//	       u32, worker address
//
// The connection then stays open, silent, until the transfer ends: its
// close tells either end at once that the other is gone, which UCX
// itself learns only from its keepalive, seconds later, on some
// transports.
const (
	helloMagic = "KVFUCX"
	helloFixed = len(helloMagic) + 1 + 8 + 4
	maxAddress = 64 << 10
)

func writeHello(nc net.Conn, id uint64, addr []byte) error {
	b := make([]byte, 0, helloFixed+len(addr))
	b = append(append(b, helloMagic...), version)
	b = binary.LittleEndian.AppendUint64(b, id)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(addr)))
	if _, err := nc.Write(append(b, addr...)); err != nil {
		return fmt.Errorf("%w: ucxx: hello: %w", handoff.ErrTransport, err)
	}
	return nil
}

// readHello reads the peer's hello: ErrHandshake if it is not a ucxx
// peer of this version.
func readHello(nc net.Conn) (id uint64, addr []byte, err error) {
	var h [helloFixed]byte
	if _, err := io.ReadFull(nc, h[:]); err != nil {
		return 0, nil, fmt.Errorf("%w: ucxx: reading the peer's hello: %w", ErrHandshake, err)
	}
	switch {
	case string(h[:len(helloMagic)]) != helloMagic:
		return 0, nil, fmt.Errorf("%w: ucxx: the peer's hello begins %q, not a ucxx peer", ErrHandshake, h[:len(helloMagic)])
	case h[len(helloMagic)] != version:
		return 0, nil, fmt.Errorf("%w: ucxx: the peer speaks version %d, this end %d", ErrHandshake, h[len(helloMagic)], version)
	}
	id = binary.LittleEndian.Uint64(h[len(helloMagic)+1:])
	n := binary.LittleEndian.Uint32(h[len(helloMagic)+9:])
	if n == 0 || n > maxAddress {
		return 0, nil, fmt.Errorf("%w: ucxx: a worker address of %d bytes", ErrHandshake, n)
	}
	addr = make([]byte, n)
	if _, err := io.ReadFull(nc, addr); err != nil {
		return 0, nil, fmt.Errorf("%w: ucxx: reading the peer's worker address: %w", ErrHandshake, err)
	}
	return id, addr, nil
}
