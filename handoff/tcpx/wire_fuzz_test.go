package tcpx

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
)

// FuzzFrameReader feeds a server's frame reader whatever a peer might
// send and checks it against a reference reading of the same bytes:
// every frame it returns is exactly the next length-prefixed body of the
// stream, a zero length is the end of messages, a length over the limit is
// ErrMessageTooLarge before its body is read, and a stream that ends
// inside a frame is an error other than io.EOF. It never returns more
// than the peer sent, and its buffer never grows past twice what arrived.
func FuzzFrameReader(f *testing.F) {
	frame := func(body ...byte) []byte {
		return append(binary.LittleEndian.AppendUint32(nil, uint32(len(body))), body...)
	}
	f.Add([]byte{}, uint16(64))
	f.Add(append(frame('M', 1, 2), frame('D')...), uint16(64))
	f.Add(append(frame('x'), 0, 0, 0, 0), uint16(64))               // end of messages
	f.Add(binary.LittleEndian.AppendUint32(nil, 1<<30), uint16(64)) // over the limit
	f.Add(frame(bytes.Repeat([]byte{7}, 100)...)[:50], uint16(200)) // cut inside its body
	f.Fuzz(func(t *testing.T, stream []byte, limit uint16) {
		limitBytes := int(limit) + 1
		a, b := net.Pipe()
		defer b.Close()
		go func() {
			a.Write(stream)
			a.Close()
		}()
		fr := newFrameReader(b, limitBytes)
		fr.buf = nil
		rest := stream
		for {
			body, err := fr.next()
			if len(rest) < prefixLen {
				// The connection ended: between frames or inside a
				// prefix, it is dropped, never a clean io.EOF.
				if err == nil || errors.Is(err, io.EOF) {
					t.Fatalf("%d bytes left, less than a prefix: frame %q, error %v", len(rest), body, err)
				}
				return
			}
			n := int(binary.LittleEndian.Uint32(rest))
			rest = rest[prefixLen:]
			switch {
			case n == 0:
				if err != io.EOF {
					t.Fatalf("a zero length read as %q, %v; want io.EOF", body, err)
				}
				// The reader goes on after the end, as the server's
				// finish does when it drains a refused transfer.
				continue
			case n > limitBytes:
				if !errors.Is(err, ErrMessageTooLarge) {
					t.Fatalf("a length of %d over the limit %d read as %d bytes, %v", n, limitBytes, len(body), err)
				}
				return
			case n > len(rest):
				if err == nil || errors.Is(err, io.EOF) {
					t.Fatalf("a frame of %d bytes cut after %d read as %d bytes, %v", n, len(rest), len(body), err)
				}
				if cap(fr.buf) > 2*max(len(rest), minReadBuffer) {
					t.Fatalf("a frame cut after %d bytes grew the buffer to %d", len(rest), cap(fr.buf))
				}
				return
			}
			if err != nil || !bytes.Equal(body, rest[:n]) {
				t.Fatalf("frame of %d bytes read as %d bytes (%v)", n, len(body), err)
			}
			rest = rest[n:]
		}
	})
}

// FuzzHello reads whatever a peer sends first as its hello and checks it
// against what the hello is: exactly "KVFTCPX" and Version is accepted,
// "KVFTCPX" and another version is errVersion, anything else (fewer than
// 8 bytes included) is ErrHandshake; nothing else, and no panic.
func FuzzHello(f *testing.F) {
	f.Add(hello())
	f.Add([]byte("KVFTCPX\x02rest"))
	f.Add([]byte("KVFTCPX"))
	f.Add([]byte("PRI * HTTP/2.0\r\n"))
	f.Add([]byte{0x16, 3, 1, 0, 0xf0, 1, 0, 0})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, first []byte) {
		a, b := net.Pipe()
		defer b.Close()
		go func() {
			a.Write(first)
			a.Close()
		}()
		err := readHello(b, "peer")
		switch {
		case len(first) >= helloLen && bytes.Equal(first[:helloLen], hello()):
			if err != nil {
				t.Fatalf("the hello % x refused: %v", first[:helloLen], err)
			}
		case len(first) >= helloLen && bytes.HasPrefix(first, helloMagic):
			if !errors.Is(err, errVersion) || !errors.Is(err, ErrHandshake) {
				t.Fatalf("a hello of version %d read as %v", first[len(helloMagic)], err)
			}
		default:
			if !errors.Is(err, ErrHandshake) || errors.Is(err, errVersion) {
				t.Fatalf("% x read as %v", first, err)
			}
		}
	})
}
