package tcpx

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
)

// pipe returns a frame writer and reader on the two ends of an
// in-memory connection.
func pipe(t *testing.T, max int) (*frameWriter, *frameReader, net.Conn) {
	a, b := net.Pipe()
	t.Cleanup(func() { a.Close(); b.Close() })
	fr := newFrameReader(b, max)
	fr.buf = nil // not one another test left in the pool
	return &frameWriter{conn: a, max: max, timeout: time.Minute}, &fr, a
}

// A message goes out as its head and parts and comes back as their
// concatenation; the end of messages comes back as io.EOF, and a
// connection that ends without it as an error that is not io.EOF.
func TestFramesRoundTrip(t *testing.T) {
	w, r, a := pipe(t, 1<<20)
	parts := [][]byte{bytes.Repeat([]byte{1}, 5000), {2, 3}, bytes.Repeat([]byte{4}, 70000)}
	go func() {
		w.write([]byte("head"), parts)
		w.write([]byte("second"), nil)
		w.end()
		w.write([]byte("after the end"), nil)
		a.Close()
	}()
	msg, err := r.next()
	require.NoError(t, err)
	assert.Equal(t, append([]byte("head"), bytes.Join(parts, nil)...), msg)
	msg, err = r.next()
	require.NoError(t, err)
	assert.Equal(t, []byte("second"), msg)
	_, err = r.next()
	assert.Equal(t, io.EOF, err)
	_, err = r.next()
	require.NoError(t, err)
	_, err = r.next()
	assert.ErrorIs(t, err, io.ErrUnexpectedEOF)
	assert.NotErrorIs(t, err, io.EOF)
}

// A length prefix over the limit is refused before the body is read or
// any memory set aside for it; one under the limit costs memory only as
// its bytes arrive, so a peer that announces 60 MiB and sends 1 KiB
// gets a buffer of 64 KiB, not 60 MiB.
func TestLengthPrefixCostsOnlyWhatArrives(t *testing.T) {
	t.Run("over the limit", func(t *testing.T) {
		_, r, a := pipe(t, 1<<20)
		go a.Write(binary.LittleEndian.AppendUint32(nil, 1<<20+1))
		_, err := r.next()
		assert.ErrorIs(t, err, ErrMessageTooLarge)
		assert.ErrorIs(t, err, handoff.ErrTransport)
		assert.Zero(t, cap(r.buf))
	})
	t.Run("under the limit, never sent", func(t *testing.T) {
		_, r, a := pipe(t, 64<<20)
		go func() {
			a.Write(binary.LittleEndian.AppendUint32(nil, 60<<20))
			a.Write(make([]byte, 1024))
			a.Close()
		}()
		_, err := r.next()
		assert.ErrorIs(t, err, io.ErrUnexpectedEOF)
		assert.LessOrEqual(t, cap(r.buf), minReadBuffer)
	})
}

// The writer refuses what the reader could not take: an empty message
// (a zero length is the end of messages) and one over the limit.
func TestWriterRefusesWhatNoReaderTakes(t *testing.T) {
	w, _, _ := pipe(t, 100)
	err := w.write(nil, [][]byte{{}})
	assert.ErrorIs(t, err, handoff.ErrTransport)
	err = w.write([]byte("head"), [][]byte{make([]byte, 97)})
	assert.ErrorIs(t, err, ErrMessageTooLarge)
}

func TestHelloNamesWrongPeers(t *testing.T) {
	for _, tc := range []struct {
		first []byte
		says  string
	}{
		{[]byte("GET / HT"), `"GET / HT"`},
		{[]byte("PRI * HTTP/2.0"[:8]), "gRPC"},
		{[]byte("HTTP/1.1"), "an HTTP server"},
		{[]byte{0x16, 3, 1, 0, 0xf0, 1, 0, 0}, "TLS"},
		{[]byte("KVFTCPX\x07"), "version"},
	} {
		err := checkHello(tc.first, "peer")
		assert.ErrorIs(t, err, ErrHandshake)
		assert.ErrorContains(t, err, tc.says)
	}
	assert.NoError(t, checkHello(hello(), "peer"))
	assert.True(t, errors.Is(checkHello([]byte("KVFTCPX\x02"), "peer"), errVersion))
}
