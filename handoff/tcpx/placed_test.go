package tcpx

import (
	"bytes"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
)

// The connection kinds placement reads from: plain TCP takes readv(2),
// TLS (no file descriptor to read from) the portable loop.
var placedConns = []struct {
	name string
	pair func(t *testing.T) (w, r net.Conn)
}{{"tcp", tcpPair}, {"tls", tlsPair}}

// tcpPair returns the two ends of a loopback TCP connection: w to write
// frames on, r to read them from.
func tcpPair(t *testing.T) (w, r net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			c = nil
		}
		accepted <- c
	}()
	w, err = net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	r = <-accepted
	require.NotNil(t, r)
	t.Cleanup(func() { w.Close(); r.Close() })
	return w, r
}

// tlsPair is tcpPair over TLS, the handshake done.
func tlsPair(t *testing.T) (w, r net.Conn) {
	t.Helper()
	hs := httptest.NewUnstartedServer(nil)
	hs.StartTLS()
	cert := hs.TLS.Certificates[0]
	hs.Close()
	rawW, rawR := tcpPair(t)
	tw := tls.Client(rawW, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13})
	tr := tls.Server(rawR, &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13})
	done := make(chan error, 1)
	go func() { done <- tr.Handshake() }()
	require.NoError(t, tw.Handshake())
	require.NoError(t, <-done)
	t.Cleanup(func() { tw.Close(); tr.Close() })
	return tw, tr
}

// frame is msg behind its length prefix.
func frame(msg []byte) []byte {
	return append(binary.LittleEndian.AppendUint32(nil, uint32(len(msg))), msg...)
}

// prefixOnly is a length prefix announcing n bytes.
func prefixOnly(n int) []byte { return binary.LittleEndian.AppendUint32(nil, uint32(n)) }

// randomBytes are n bytes no two tests share, so that a byte out of
// place shows.
func randomBytes(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 7))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// placedWait bounds each test's reads, so that a reader that wants more
// bytes than were sent fails the test rather than hangs it.
const placedWait = 10 * time.Second

// placedReader is a frameReader on r with no buffer kept from another
// test.
func placedReader(r net.Conn, max int) *frameReader {
	r.SetReadDeadline(time.Now().Add(placedWait))
	fr := newFrameReader(r, max)
	fr.buf = nil
	return &fr
}

// placedEnd is a server end on r, as Server.handle makes one.
func placedEnd(r net.Conn, timeout time.Duration) *serverEnd {
	e := &serverEnd{conn: r, rd: newFrameReader(r, DefaultMaxMessageBytes), timeout: timeout,
		wr: frameWriter{conn: r, max: DefaultMaxMessageBytes, timeout: timeout}}
	e.rd.buf = nil
	return e
}

// writeInPieces writes b in pieces of piece bytes, pausing between
// them so that the reader finds part of what it asked for; it reports
// the first error, or nil once all is written.
func writeInPieces(w net.Conn, b []byte, piece int) <-chan error {
	done := make(chan error, 1)
	go func() {
		for len(b) > 0 {
			k := min(piece, len(b))
			if _, err := w.Write(b[:k]); err != nil {
				done <- err
				return
			}
			b = b[k:]
			time.Sleep(200 * time.Microsecond)
		}
		done <- nil
	}()
	return done
}

// guarded is buffers of the given lengths cut from one array, each
// followed by guard bytes, so that a write past a buffer's end, or into
// the wrong one, shows.
type guarded struct {
	all  []byte
	bufs [][]byte
}

const guardLen, guardByte = 3, 0xA5

func newGuarded(lens ...int) *guarded {
	n := 0
	for _, l := range lens {
		n += l + guardLen
	}
	g := &guarded{all: bytes.Repeat([]byte{guardByte}, n)}
	at := 0
	for _, l := range lens {
		g.bufs = append(g.bufs, g.all[at:at+l:at+l])
		at += l + guardLen
	}
	return g
}

// check asserts that the buffers hold want, in order, and every guard is
// intact.
func (g *guarded) check(t *testing.T, want []byte) {
	t.Helper()
	at := 0
	for i, b := range g.bufs {
		require.Equal(t, want[:len(b)], b, "buffer %d", i)
		want = want[len(b):]
		at += len(b)
		require.Equal(t, bytes.Repeat([]byte{guardByte}, guardLen), g.all[at:at+guardLen], "guard after buffer %d", i)
		at += guardLen
	}
	require.Empty(t, want, "bytes left over")
}

func (g *guarded) size() int {
	n := 0
	for _, b := range g.bufs {
		n += len(b)
	}
	return n
}

// placeAfter returns a place that reads a head of n bytes, checks it
// against want, and places the rest in bufs.
func placeAfter(t *testing.T, n int, want []byte, bufs [][]byte) func(int, func(int) ([]byte, error)) ([][]byte, error) {
	return func(total int, head func(int) ([]byte, error)) ([][]byte, error) {
		assert.Equal(t, len(want), total)
		h, err := head(n)
		if err != nil {
			return nil, err
		}
		assert.Equal(t, want[:n], h)
		return bufs, nil
	}
}

// A placed message's bytes land exactly in many buffers of uneven
// sizes, zero-length ones among them, whatever pieces the sender writes
// them in: nothing past a buffer's end, nothing skipped or read twice
// where a read filled part of a buffer.
func TestPlacedBytesLandExactlyInUnevenBuffers(t *testing.T) {
	for _, kind := range placedConns {
		t.Run(kind.name, func(t *testing.T) {
			w, r := kind.pair(t)
			g := newGuarded(1, 0, 4096, 3, 0, 0, 65536+7, 1, 12345, 0, 999, 2)
			const headLen = 40
			msg := randomBytes(headLen+g.size(), 1)
			sent := writeInPieces(w, frame(msg), 1000)
			fr := placedReader(r, DefaultMaxMessageBytes)
			calls := 0
			place := placeAfter(t, headLen, msg, g.bufs)
			got, placed, err := fr.nextPlaced(func(total int, head func(int) ([]byte, error)) ([][]byte, error) {
				calls++
				return place(total, head)
			})
			require.NoError(t, err)
			require.NoError(t, <-sent)
			assert.True(t, placed)
			assert.Nil(t, got)
			assert.Equal(t, 1, calls)
			g.check(t, msg[headLen:])
		})
	}
}

// readv takes at most IOV_MAX (1024) buffers a call on Linux and refuses
// more with EINVAL: a frame placed into thousands of pages still lands.
func TestPlacedIntoMoreBuffersThanIOVMax(t *testing.T) {
	for _, kind := range placedConns {
		t.Run(kind.name, func(t *testing.T) {
			w, r := kind.pair(t)
			lens := make([]int, 3000)
			for i := range lens {
				lens[i] = i % 4 // zero-length ones among them
			}
			g := newGuarded(lens...)
			msg := randomBytes(1+g.size(), 2)
			sent := writeInPieces(w, frame(msg), 1<<20)
			fr := placedReader(r, DefaultMaxMessageBytes)
			_, placed, err := fr.nextPlaced(placeAfter(t, 1, msg, g.bufs))
			require.NoError(t, err)
			require.NoError(t, <-sent)
			assert.True(t, placed)
			g.check(t, msg[1:])
		})
	}
}

// A place that declines (no buffers) gets the whole message, its head
// bytes included, whatever head it read; and placed or not, every
// message leaves the framing where the next one begins.
func TestPlaceDecliningReadsWholeMessageAndKeepsFraming(t *testing.T) {
	for _, kind := range placedConns {
		t.Run(kind.name, func(t *testing.T) {
			w, r := kind.pair(t)
			big := randomBytes(300<<10, 3) // grows the buffer past its head
			placedMsg := randomBytes(5000, 4)
			g := newGuarded(1000, 0, 3990)
			small := []byte("Dsmall")
			whole := []byte("Dhead is the whole")
			plain := []byte("Sread by next")
			var stream []byte
			for _, m := range [][]byte{big, placedMsg, small, whole, whole, plain} {
				stream = append(stream, frame(m)...)
			}
			stream = append(stream, 0, 0, 0, 0)
			sent := writeInPieces(w, stream, 7000)
			fr := placedReader(r, DefaultMaxMessageBytes)
			decline := func(n int, want []byte) func(int, func(int) ([]byte, error)) ([][]byte, error) {
				return func(total int, head func(int) ([]byte, error)) ([][]byte, error) {
					assert.Equal(t, len(want), total)
					if n > 0 {
						h, err := head(n)
						require.NoError(t, err)
						assert.Equal(t, want[:n], h)
					}
					return nil, nil
				}
			}

			got, placed, err := fr.nextPlaced(decline(9, big))
			require.NoError(t, err)
			assert.False(t, placed)
			assert.Equal(t, big, got, "declined after a head: the whole message")

			got, placed, err = fr.nextPlaced(func(total int, head func(int) ([]byte, error)) ([][]byte, error) {
				for _, n := range []int{3, 10, 2, 10} { // a longer head reads on; a shorter reads nothing
					h, err := head(n)
					require.NoError(t, err)
					assert.Equal(t, placedMsg[:n], h)
				}
				return g.bufs, nil
			})
			require.NoError(t, err)
			assert.True(t, placed)
			assert.Nil(t, got)
			g.check(t, placedMsg[10:])

			got, placed, err = fr.nextPlaced(decline(0, small))
			require.NoError(t, err)
			assert.False(t, placed)
			assert.Equal(t, small, got, "declined without a head")

			got, placed, err = fr.nextPlaced(decline(len(whole), whole))
			require.NoError(t, err)
			assert.False(t, placed)
			assert.Equal(t, whole, got, "declined after a head of it all")

			// A head of it all and nothing left to place: placed, in no
			// bytes.
			_, placed, err = fr.nextPlaced(func(total int, head func(int) ([]byte, error)) ([][]byte, error) {
				h, err := head(total)
				require.NoError(t, err)
				assert.Equal(t, whole, h)
				return [][]byte{{}}, nil
			})
			require.NoError(t, err)
			assert.True(t, placed)

			got, err = fr.next()
			require.NoError(t, err)
			assert.Equal(t, plain, got, "the frame after the placed ones")
			_, err = fr.next()
			assert.Equal(t, io.EOF, err)
			require.NoError(t, <-sent)
		})
	}
}

// A head outside 1…total, or buffers that do not add up to what is left
// of the message, is the caller's bug: an error naming the numbers, and
// nothing more read from the connection. An error of place's own comes
// back as it is.
func TestPlaceBadHeadLengthsAndBufferSums(t *testing.T) {
	msg := randomBytes(1000, 5)
	t.Run("head lengths", func(t *testing.T) {
		w, r := tcpPair(t)
		sent := writeInPieces(w, append(frame(msg), frame(msg)...), 1<<20)
		fr := placedReader(r, DefaultMaxMessageBytes)
		var late func(int) ([]byte, error)
		got, placed, err := fr.nextPlaced(func(total int, head func(int) ([]byte, error)) ([][]byte, error) {
			for _, n := range []int{0, -1, total + 1} {
				_, err := head(n)
				assert.ErrorIs(t, err, handoff.ErrTransport, "head(%d)", n)
				assert.ErrorContains(t, err, fmt.Sprint(n))
			}
			late = head
			return nil, nil // the bad heads read nothing: the message is still whole
		})
		require.NoError(t, err)
		assert.False(t, placed)
		assert.Equal(t, msg, got)
		_, err = late(1)
		assert.ErrorIs(t, err, handoff.ErrTransport, "head after place returned")
		got, err = fr.next()
		require.NoError(t, err)
		assert.Equal(t, msg, got, "the head after place returned read nothing")
		require.NoError(t, <-sent)
	})
	for _, tc := range []struct {
		name string
		lens []int
	}{{"too few", []int{500, 489}}, {"too many", []int{500, 492}}, {"too many, one by one", []int{991, 0, 1}}, {"none but empty", []int{0}}} {
		t.Run(tc.name, func(t *testing.T) {
			w, r := tcpPair(t)
			sent := writeInPieces(w, frame(msg), 1<<20)
			fr := placedReader(r, DefaultMaxMessageBytes)
			g := newGuarded(tc.lens...)
			_, placed, err := fr.nextPlaced(placeAfter(t, 9, msg, g.bufs))
			assert.ErrorIs(t, err, handoff.ErrTransport)
			assert.ErrorContains(t, err, fmt.Sprint(g.size()))
			assert.ErrorContains(t, err, "991")
			assert.False(t, placed)
			require.NoError(t, <-sent)
			assertUnread(t, r, msg[9:])
			g.check(t, bytes.Repeat([]byte{guardByte}, g.size())) // untouched
		})
	}
	t.Run("place's error", func(t *testing.T) {
		w, r := tcpPair(t)
		sent := writeInPieces(w, frame(msg), 1<<20)
		fr := placedReader(r, DefaultMaxMessageBytes)
		mine := errors.New("no pages for it")
		_, placed, err := fr.nextPlaced(func(total int, head func(int) ([]byte, error)) ([][]byte, error) {
			if _, err := head(20); err != nil {
				return nil, err
			}
			return [][]byte{make([]byte, total-20)}, mine
		})
		assert.Same(t, mine, err)
		assert.False(t, placed)
		require.NoError(t, <-sent)
		assertUnread(t, r, msg[20:])
	})
}

// assertUnread asserts that the connection still holds want, unread.
func assertUnread(t *testing.T, r net.Conn, want []byte) {
	t.Helper()
	got := make([]byte, len(want))
	r.SetReadDeadline(time.Now().Add(placedWait))
	_, err := io.ReadFull(r, got)
	require.NoError(t, err)
	assert.Equal(t, want, got, "the rest of the message is still unread")
}

// After the sender's end of messages, RecvPlaced answers io.EOF without
// calling place, and again, reading nothing more.
func TestPlacedEndOfMessagesIsEOFAndStaysEOF(t *testing.T) {
	for _, kind := range placedConns {
		t.Run(kind.name, func(t *testing.T) {
			w, r := kind.pair(t)
			sent := writeInPieces(w, append([]byte{0, 0, 0, 0}, frame([]byte("after the end"))...), 1<<20)
			e := placedEnd(r, placedWait)
			place := func(int, func(int) ([]byte, error)) ([][]byte, error) {
				t.Error("place called after the end of messages")
				return nil, nil
			}
			for range 2 {
				msg, placed, err := e.RecvPlaced(place)
				assert.Equal(t, io.EOF, err)
				assert.False(t, placed)
				assert.Nil(t, msg)
			}
			require.NoError(t, <-sent)
			assertUnread(t, r, frame([]byte("after the end")))
		})
	}
}

// A connection that closes in the middle of a message, in its head or
// in its placed bytes, is an error, never the io.EOF of a clean end.
func TestPlacedPeerClosingMidwayIsNotEOF(t *testing.T) {
	msg := randomBytes(10000, 6)
	for _, kind := range placedConns {
		for _, tc := range []struct {
			name      string
			sent, hdr int
		}{{"in the placed bytes", 5000, 100}, {"before the placed bytes", 100, 100}, {"in the head", 50, 100}, {"before the head", 0, 100}} {
			t.Run(kind.name+"/"+tc.name, func(t *testing.T) {
				w, r := kind.pair(t)
				go func() {
					w.Write(frame(msg)[:prefixLen+tc.sent])
					w.Close()
				}()
				e := placedEnd(r, placedWait)
				_, placed, err := e.RecvPlaced(placeAfter(t, tc.hdr, msg, [][]byte{make([]byte, len(msg)-tc.hdr)}))
				require.Error(t, err)
				assert.NotErrorIs(t, err, io.EOF)
				assert.ErrorIs(t, err, io.ErrUnexpectedEOF)
				assert.False(t, placed)
			})
		}
	}
}

// InterruptRecv from another goroutine ends a RecvPlaced that waits for
// the rest of its placed bytes, promptly (the past read deadline), and
// every later one at once; MessageTimeout ends one whose sender stalls
// there.
func TestInterruptRecvEndsAPlacedReadMidway(t *testing.T) {
	msg := randomBytes(100000, 7)
	for _, kind := range placedConns {
		t.Run(kind.name, func(t *testing.T) {
			w, r := kind.pair(t)
			_, err := w.Write(frame(msg)[:prefixLen+30000]) // and the rest never
			require.NoError(t, err)
			e := placedEnd(r, time.Hour)
			returned := make(chan struct{})
			go func() {
				<-returned
				time.Sleep(10 * time.Millisecond) // most likely in the wait; either way it must end
				e.InterruptRecv()
			}()
			got := make(chan error, 1)
			go func() {
				_, _, err := e.RecvPlaced(func(total int, head func(int) ([]byte, error)) ([][]byte, error) {
					defer close(returned)
					return placeAfter(t, 8, msg, [][]byte{make([]byte, total-8)})(total, head)
				})
				got <- err
			}()
			select {
			case err := <-got:
				assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
			case <-time.After(10 * time.Second):
				t.Fatal("RecvPlaced still waits 10 s after InterruptRecv")
			}
			_, _, err = e.RecvPlaced(func(int, func(int) ([]byte, error)) ([][]byte, error) {
				t.Error("place called after InterruptRecv")
				return nil, nil
			})
			assert.ErrorIs(t, err, errInterrupted)
		})
		t.Run(kind.name+"/MessageTimeout", func(t *testing.T) {
			w, r := kind.pair(t)
			_, err := w.Write(frame(msg)[:prefixLen+30000])
			require.NoError(t, err)
			e := placedEnd(r, 50*time.Millisecond)
			_, _, err = e.RecvPlaced(placeAfter(t, 8, msg, [][]byte{make([]byte, len(msg)-8)}))
			assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
		})
	}
}

// A length prefix costs no memory beyond what arrives: one over the limit
// is refused before place is called or anything allocated, and a small
// head of a message that announces 60 MiB grows the read buffer to that
// head, not to 60 MiB; declined, it grows only as the bytes come.
func TestPlacedPrefixCostsOnlyWhatArrives(t *testing.T) {
	noPlace := func(int, func(int) ([]byte, error)) ([][]byte, error) {
		t.Error("place called for a message over the limit")
		return nil, nil
	}
	t.Run("over the limit", func(t *testing.T) {
		w, r := tcpPair(t)
		_, err := w.Write(prefixOnly(1<<20 + 1))
		require.NoError(t, err)
		fr := placedReader(r, 1<<20)
		_, placed, err := fr.nextPlaced(noPlace)
		assert.ErrorIs(t, err, ErrMessageTooLarge)
		assert.ErrorIs(t, err, handoff.ErrTransport)
		assert.False(t, placed)
		assert.Zero(t, cap(fr.buf))
	})
	t.Run("under the limit, never sent", func(t *testing.T) {
		w, r := tcpPair(t)
		go func() {
			w.Write(append(prefixOnly(60<<20), make([]byte, 1024)...))
			w.Close()
		}()
		fr := placedReader(r, 64<<20)
		_, _, err := fr.nextPlaced(func(total int, head func(int) ([]byte, error)) ([][]byte, error) {
			assert.Equal(t, 60<<20, total)
			_, err := head(16)
			require.NoError(t, err)
			assert.LessOrEqual(t, cap(fr.buf), 16, "a 16-byte head")
			return nil, nil
		})
		assert.ErrorIs(t, err, io.ErrUnexpectedEOF)
		assert.LessOrEqual(t, cap(fr.buf), minReadBuffer)
	})
}

// After a placement failed part way through its frame (place's error,
// buffers that do not add up), the frame's unread rest is where the next
// receive would look for a length prefix: every receive then fails,
// instead of taking page bytes for a frame.
func TestReceiveAfterAFailedPlacementIsRefused(t *testing.T) {
	msg := randomBytes(1000, 10)
	copy(msg[20:], prefixOnly(5)) // what a misframed read would take for a 5-byte frame
	for _, kind := range placedConns {
		for _, tc := range []struct {
			name string
			bufs [][]byte
			err  error
		}{{"place's error", nil, errors.New("no pages for it")}, {"buffers that do not add up", [][]byte{make([]byte, 10)}, nil}} {
			t.Run(kind.name+"/"+tc.name, func(t *testing.T) {
				w, r := kind.pair(t)
				sent := writeInPieces(w, append(frame(msg), frame([]byte("Vnext"))...), 1<<20)
				e := placedEnd(r, placedWait)
				_, _, err := e.RecvPlaced(func(total int, head func(int) ([]byte, error)) ([][]byte, error) {
					_, err := head(20)
					require.NoError(t, err)
					return tc.bufs, tc.err
				})
				require.Error(t, err)
				require.NoError(t, <-sent)
				got, err := e.Recv()
				assert.ErrorIs(t, err, errFramingLost, "Recv got %q", got)
				assert.ErrorIs(t, err, handoff.ErrTransport)
				_, _, err = e.RecvPlaced(func(int, func(int) ([]byte, error)) ([][]byte, error) {
					t.Error("place called after a failed placement")
					return nil, nil
				})
				assert.ErrorIs(t, err, errFramingLost)
			})
		}
	}
}

// finish, after a placement failed, cannot tell the sender's frames
// apart any more, but must still read and drop what it sends until it
// closes (as after a prefix over the limit), so that the connection is
// not reset under the verdict with the sender's bytes unread.
func TestFinishDrainsAfterAFailedPlacement(t *testing.T) {
	w, r := tcpPair(t)
	msg := randomBytes(4<<20, 11) // more than the socket buffers hold
	sent := make(chan error, 1)
	go func() {
		_, err := w.Write(frame(msg))
		if err == nil {
			err = w.(*net.TCPConn).CloseWrite()
		}
		sent <- err
	}()
	e := placedEnd(r, placedWait)
	mine := errors.New("no pages for it")
	_, _, err := e.RecvPlaced(func(int, func(int) ([]byte, error)) ([][]byte, error) { return nil, mine })
	require.Same(t, mine, err)
	e.finish()
	select {
	case err := <-sent:
		require.NoError(t, err, "the sender wrote it all: finish read it")
	case <-time.After(placedWait):
		t.Fatal("the sender's write still waits for a reader")
	}
	r.SetReadDeadline(time.Now().Add(placedWait))
	n, err := r.Read(make([]byte, 1))
	assert.Equal(t, io.EOF, err, "finish left %d bytes of the sender's unread", n)
	end := make([]byte, prefixLen)
	w.SetReadDeadline(time.Now().Add(placedWait))
	_, err = io.ReadFull(w, end)
	require.NoError(t, err)
	assert.Equal(t, make([]byte, prefixLen), end, "the receiver's end of messages")
}
