package tcpx

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/kvfence/kvfence/handoff"
)

const (
	// Version is the wire protocol's version, the last byte of the hello.
	Version = 1
	// DefaultMaxMessageBytes is the default bound on one message, either
	// way (Options.MaxMessageBytes).
	DefaultMaxMessageBytes = 64 << 20
	// DefaultMaxConns is the default bound on the connections a Server
	// serves at once (Options.MaxConns): far more transfers than one
	// decode pool runs at a time, and 256 goroutines and read buffers.
	DefaultMaxConns = 256

	helloLen  = 8
	prefixLen = 4
	// minReadBuffer is the least a read buffer grows to at a time.
	minReadBuffer = 64 << 10
)

// helloMagic opens the hello each end sends first, followed by Version.
var helloMagic = []byte("KVFTCPX")

func hello() []byte { return append(append(make([]byte, 0, helloLen), helloMagic...), Version) }

var (
	// ErrMessageTooLarge: a message, or a peer's length prefix, over
	// Options.MaxMessageBytes. It wraps handoff.ErrTransport.
	ErrMessageTooLarge = fmt.Errorf("%w: tcpx: message over the size limit", handoff.ErrTransport)
	// ErrHandshake: the peer is not a tcpx endpoint (an HTTP or gRPC
	// client or server on the port, a TLS client on a plain-TCP server),
	// or speaks another version of the protocol. It wraps
	// handoff.ErrTransport.
	ErrHandshake = fmt.Errorf("%w: tcpx: handshake refused", handoff.ErrTransport)
)

// errClosedEarly is a connection that ended before its peer's end of
// messages: a dropped connection, never the io.EOF a clean end is.
var errClosedEarly = fmt.Errorf("connection closed before the peer's end of messages: %w", io.ErrUnexpectedEOF)

// errVersion: a peer's hello of another version.
var errVersion = errors.New("another version")

// checkHello returns nil if h is a hello of this version, else why not.
func checkHello(h []byte, peer string) error {
	switch {
	case !bytes.HasPrefix(h, helloMagic):
		return fmt.Errorf("%w: the %s is not a kvfence tcpx endpoint: its first bytes are %q%s", ErrHandshake, peer, h, whoSent(h))
	case h[len(helloMagic)] != Version:
		return fmt.Errorf("%w: the %s speaks %w of tcpx, %d (this end: %d)", ErrHandshake, peer, errVersion, h[len(helloMagic)], Version)
	}
	return nil
}

// whoSent guesses, for the log, what kind of peer opens with h.
func whoSent(h []byte) string {
	switch {
	case len(h) > 0 && h[0] == 0x16: // a TLS handshake record
		return " (a TLS client or server: is the other end plain TCP?)"
	case bytes.HasPrefix(h, []byte("PRI * HT")):
		return " (an HTTP/2 or gRPC client)"
	case bytes.HasPrefix(h, []byte("HTTP/")):
		return " (an HTTP server)"
	case len(h) == helloLen && h[3] == 0x4 && bytes.Equal(h[5:], []byte{0, 0, 0}):
		return " (an HTTP/2 or gRPC server: its SETTINGS frame)"
	}
	return ""
}

// readHello reads and checks the peer's hello.
func readHello(c net.Conn, peer string) error {
	var h [helloLen]byte
	n, err := io.ReadFull(c, h[:])
	switch {
	case err == nil:
		return checkHello(h[:], peer)
	case n > 0:
		return fmt.Errorf("%w: the %s is not a kvfence tcpx endpoint: it sent %q%s, then %v", ErrHandshake, peer, h[:n], whoSent(h[:n]), err)
	case errors.Is(err, io.EOF):
		return fmt.Errorf("%w: the %s closed the connection before its hello: it is not a kvfence tcpx endpoint, or it refused this one (see its log)", ErrHandshake, peer)
	case errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Errorf("%w: no hello from the %s within the handshake timeout: it is not a kvfence tcpx endpoint, or it is stalled: %w", ErrHandshake, peer, err)
	}
	return fmt.Errorf("%w: reading the %s's hello: %w", ErrHandshake, peer, err)
}

// frameReader reads a connection's frames, each into the one buffer it
// reuses (a body is valid until the next read).
type frameReader struct {
	conn   net.Conn
	max    int
	prefix [prefixLen]byte
	buf    []byte
}

// readBuffers keeps read buffers between connections (one per
// transfer), so that a transfer's first frame does not allocate.
var readBuffers sync.Pool // of *[]byte

func newFrameReader(c net.Conn, max int) frameReader {
	return frameReader{conn: c, max: max, buf: getReadBuffer()}
}

// getReadBuffer returns a kept read buffer, or nil (a frameReader grows
// one as bytes arrive).
func getReadBuffer() []byte {
	if b, ok := readBuffers.Get().(*[]byte); ok {
		return *b
	}
	return nil
}

// putReadBuffer keeps b for another connection, if it is worth keeping.
func putReadBuffer(b []byte) {
	if cap(b) >= minReadBuffer {
		b = b[:0]
		readBuffers.Put(&b)
	}
}

// release gives the buffer back for another connection.
func (fr *frameReader) release() {
	putReadBuffer(fr.buf)
	fr.buf = nil
}

// next reads one frame: its body, or io.EOF for the peer's end of
// messages. A connection that ends anywhere else is an error, never
// io.EOF.
func (fr *frameReader) next() ([]byte, error) {
	if _, err := io.ReadFull(fr.conn, fr.prefix[:]); err != nil {
		return nil, early(err)
	}
	n := binary.LittleEndian.Uint32(fr.prefix[:])
	switch {
	case n == 0:
		return nil, io.EOF
	case int64(n) > int64(fr.max):
		return nil, fmt.Errorf("%w: the peer announced a message of %d bytes, the limit is %d", ErrMessageTooLarge, n, fr.max)
	}
	return fr.body(int(n))
}

// body reads an n-byte body. A buffer too small grows as the bytes
// arrive, at most doubling each time, so that a length prefix costs no
// more memory than twice the bytes the peer actually sent.
func (fr *frameReader) body(n int) ([]byte, error) {
	if cap(fr.buf) >= n {
		b := fr.buf[:n]
		if _, err := io.ReadFull(fr.conn, b); err != nil {
			return nil, early(err)
		}
		return b, nil
	}
	b := fr.buf[:0]
	for len(b) < n {
		if len(b) == cap(b) {
			grown := make([]byte, len(b), min(n, max(2*cap(b), minReadBuffer)))
			copy(grown, b)
			b, fr.buf = grown, grown
		}
		k, err := fr.conn.Read(b[len(b):min(n, cap(b))])
		b = b[:len(b)+k]
		if err != nil && len(b) < n {
			return nil, early(err)
		}
	}
	return b, nil
}

// early is err, from a read that ended a frame early; io.EOF there
// means the connection dropped.
func early(err error) error {
	if errors.Is(err, io.EOF) {
		return errClosedEarly
	}
	return err
}

// frameWriter writes a connection's frames, each with one vectored write
// (writev on TCP) of its length prefix, head and parts: the parts' bytes
// are not copied in user space.
type frameWriter struct {
	conn    net.Conn
	max     int
	timeout time.Duration
	first   []byte      // length prefix + head, reused
	bufs    net.Buffers // reused
}

// write writes one message: head followed by parts. It keeps neither
// once it returns.
func (fw *frameWriter) write(head []byte, parts [][]byte) error {
	n := len(head)
	for _, p := range parts {
		n += len(p)
	}
	switch {
	case n == 0:
		// A zero length is the end of messages (end), never a message.
		return fmt.Errorf("%w: tcpx: an empty message", handoff.ErrTransport)
	case n > fw.max:
		return fmt.Errorf("%w: a message of %d bytes, the limit is %d", ErrMessageTooLarge, n, fw.max)
	}
	// The head is copied behind the prefix (it is small) so that a TLS
	// connection, which writes each buffer as records of its own, does not
	// send the 4-byte prefix alone.
	fw.first = binary.LittleEndian.AppendUint32(fw.first[:0], uint32(n))
	fw.first = append(fw.first, head...)
	fw.bufs = append(append(fw.bufs[:0], fw.first), parts...)
	err := fw.send(fw.bufs)
	clear(fw.bufs) // keeps no reference to the parts
	return err
}

// end writes the end of messages: a zero length prefix.
func (fw *frameWriter) end() error {
	var zero [prefixLen]byte
	fw.bufs = append(fw.bufs[:0], zero[:])
	return fw.send(fw.bufs)
}

func (fw *frameWriter) send(bufs net.Buffers) error {
	if err := fw.conn.SetWriteDeadline(time.Now().Add(fw.timeout)); err != nil {
		return err
	}
	_, err := bufs.WriteTo(fw.conn) // consumes bufs, a copy of the slice
	return err
}
