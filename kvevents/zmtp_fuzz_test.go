package kvevents

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"net"
	"slices"
	"strings"
	"testing"
	"time"
)

// peerBytes is a connection that reads a peer's bytes and keeps what is
// written to it.
type peerBytes struct {
	net.Conn
	in  *bytes.Reader
	out bytes.Buffer
}

func (c *peerBytes) Read(b []byte) (int, error)       { return c.in.Read(b) }
func (c *peerBytes) Write(b []byte) (int, error)      { return c.out.Write(b) }
func (c *peerBytes) SetDeadline(time.Time) error      { return nil }
func (c *peerBytes) SetWriteDeadline(time.Time) error { return nil }

// refRead is the reference reading of one message from stream: the
// message, the PONGs owed on the way (their frames), the rest of the
// stream, and whether the read ended with a protocol error (refused) or
// with the end of the stream (short).
type refRead struct {
	msg            [][]byte
	pongs          []byte
	rest           []byte
	refused, short bool
}

func refReadMessage(stream []byte, limit int) refRead {
	var r refRead
	for {
		if len(stream) < 2 {
			return refRead{short: true}
		}
		flags := stream[0]
		var size uint64
		if flags&flagLong != 0 {
			if len(stream) < 9 {
				return refRead{short: true}
			}
			size, stream = binary.BigEndian.Uint64(stream[1:]), stream[9:]
		} else {
			size, stream = uint64(stream[1]), stream[2:]
		}
		command := flags&flagCommand != 0
		most := limit
		if command {
			most = min(most, maxCommand)
		}
		if size > uint64(most) {
			return refRead{refused: true}
		}
		if uint64(len(stream)) < size {
			return refRead{short: true}
		}
		body := stream[:size]
		stream = stream[size:]
		if !command {
			r.msg = append(r.msg, body)
			limit -= len(body)
			if flags&flagMore == 0 {
				r.rest = stream
				return r
			}
			if len(r.msg) == maxFrames {
				return refRead{refused: true}
			}
			continue
		}
		if len(body) == 0 || len(body) < 1+int(body[0]) {
			return refRead{refused: true}
		}
		name, arg := string(body[1:1+body[0]]), body[1+body[0]:]
		switch {
		case name == "SUBSCRIBE":
			return refRead{msg: [][]byte{append([]byte{1}, arg...)}, pongs: r.pongs, rest: stream}
		case name == "CANCEL":
			return refRead{msg: [][]byte{append([]byte{0}, arg...)}, pongs: r.pongs, rest: stream}
		case name == "PING" && len(arg) >= 2:
			pong := append([]byte{4}, "PONG"...)
			pong = append(pong, arg[2:]...)
			r.pongs = appendHeader(r.pongs, len(pong), flagCommand)
			r.pongs = append(r.pongs, pong...)
		}
	}
}

// FuzzReadMessage reads whatever a subscriber or replay client might send
// as its messages and checks each against the reference reading of the
// same bytes: the same frames, the same PONGs answered, a protocol error
// (ErrPeer) where a frame is over the limit, a command is malformed or a
// message has too many frames, and another error where the stream ends
// inside a message. No frame is allocated over the limit.
func FuzzReadMessage(f *testing.F) {
	msg := func(frames ...[]byte) []byte { return appendMessage(nil, frames...) }
	cmd := func(name string, body []byte) []byte {
		c := append([]byte{byte(len(name))}, name...)
		return append(appendHeader(nil, len(c)+len(body), flagCommand), append(c, body...)...)
	}
	f.Add(msg([]byte{1}), uint16(maxSubscription))
	f.Add(msg([]byte{}, binary.BigEndian.AppendUint64(nil, 7)), uint16(maxReplayRequest))
	f.Add(append(cmd("PING", []byte{0, 1, 'x'}), msg([]byte{0, 'k'})...), uint16(maxSubscription))
	f.Add(cmd("SUBSCRIBE", []byte("kv@")), uint16(maxSubscription))
	f.Add(append(cmd("CANCEL", nil), cmd("", nil)...), uint16(maxSubscription))
	f.Add(msg(make([]byte, 300)), uint16(maxSubscription))
	f.Add(bytes.Repeat([]byte{flagMore, 0}, 20), uint16(maxReplayRequest))
	f.Add([]byte{flagLong, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, uint16(maxReplayRequest))
	f.Fuzz(func(t *testing.T, stream []byte, limit uint16) {
		c := &peerBytes{in: bytes.NewReader(stream)}
		z := &zconn{c: c, r: bufio.NewReader(c)}
		rest := stream
		for {
			want := refReadMessage(rest, int(limit))
			c.out.Reset()
			got, err := z.readMessage(int(limit))
			switch {
			case want.refused:
				if !errors.Is(err, ErrPeer) {
					t.Fatalf("refused by the reference, read as %q, %v", got, err)
				}
				return
			case want.short:
				if err == nil || errors.Is(err, ErrPeer) {
					t.Fatalf("a stream that ends inside a message read as %q, %v", got, err)
				}
				return
			}
			if err != nil || !slices.EqualFunc(got, want.msg, bytes.Equal) {
				t.Fatalf("read as %q, %v; want %q", got, err, want.msg)
			}
			if !bytes.Equal(c.out.Bytes(), want.pongs) {
				t.Fatalf("answered % x, want % x", c.out.Bytes(), want.pongs)
			}
			rest = want.rest
		}
	})
}

// refHandshake is the reference reading of a peer's side of the
// handshake: a ZMTP 3 greeting for NULL security, then a READY command
// whose metadata names a socket type; it returns that type, and whether
// the bytes are such a handshake.
func refHandshake(peer []byte) (string, bool) {
	if len(peer) < greetingLen || peer[0] != 0xff || peer[9] != 0x7f || peer[10] < 3 ||
		string(bytes.TrimRight(peer[12:32], "\x00")) != "NULL" {
		return "", false
	}
	frame := peer[greetingLen:]
	if len(frame) < 2 || frame[0]&flagCommand == 0 {
		return "", false
	}
	var size uint64
	if frame[0]&flagLong != 0 {
		if len(frame) < 9 {
			return "", false
		}
		size, frame = binary.BigEndian.Uint64(frame[1:]), frame[9:]
	} else {
		size, frame = uint64(frame[1]), frame[2:]
	}
	if size > maxCommand || uint64(len(frame)) < size {
		return "", false
	}
	body := frame[:size]
	if len(body) < 6 || string(body[:6]) != "\x05READY" {
		return "", false
	}
	meta := map[string]string{}
	for b := body[6:]; len(b) > 0; {
		n := int(b[0])
		if len(b) < 1+n+4 {
			return "", false
		}
		name := strings.ToLower(string(b[1 : 1+n]))
		v := binary.BigEndian.Uint32(b[1+n:])
		b = b[1+n+4:]
		if uint64(v) > uint64(len(b)) {
			return "", false
		}
		meta[name], b = string(b[:v]), b[v:]
	}
	return meta["socket-type"], true
}

// FuzzHandshake runs the publisher's side of the handshake against
// whatever a peer sends and checks it against the reference reading: it
// accepts exactly the ZMTP 3 greetings for NULL security followed by a
// READY that names an allowed socket type, and reads that type.
func FuzzHandshake(f *testing.F) {
	g := greetingFor("NULL", false)
	ready := func(props []byte) []byte {
		c := append([]byte{5}, "READY"...)
		return append(appendHeader(nil, len(c)+len(props), flagCommand), append(c, props...)...)
	}
	f.Add(append(g[:], ready(props("Socket-Type", "SUB"))...))
	f.Add(append(g[:], ready(props("Identity", "", "socket-type", "XSUB"))...))
	f.Add(append(g[:], ready(props("Socket-Type", "PUB"))...))
	f.Add(append(g[:], ready([]byte{11, 'S'})...))
	f.Add(append(g[:], ready([]byte{0, 0xff, 0xff, 0xff, 0xff})...))
	f.Add(g[:30])
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"))
	f.Fuzz(func(t *testing.T, peer []byte) {
		z, err := handshake(&peerBytes{in: bytes.NewReader(peer)}, "PUB", []string{"SUB", "XSUB"}, 0, nil)
		typ, ok := refHandshake(peer)
		ok = ok && (typ == "SUB" || typ == "XSUB")
		switch {
		case err != nil && z != nil:
			t.Fatalf("a connection with its error %v", err)
		case err == nil && !ok:
			t.Fatalf("accepted a %q peer the reference refuses: % x", z.peerType, peer)
		case err != nil && ok:
			t.Fatalf("refused a %q peer the reference accepts (%v): % x", typ, err, peer)
		case err == nil && z.peerType != typ:
			t.Fatalf("read socket type %q, the reference %q", z.peerType, typ)
		case err != nil && !errors.Is(err, ErrPeer):
			t.Fatalf("refused with %v, not ErrPeer", err)
		}
	})
}
