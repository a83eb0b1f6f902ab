package kvevents

import (
	"bufio"
	"bytes"
	"errors"
	"net"
	"testing"
	"time"
)

// discardConn is a connection whose writes (a PONG) go nowhere.
type discardConn struct{ net.Conn }

func (discardConn) Write(b []byte) (int, error)      { return len(b), nil }
func (discardConn) SetWriteDeadline(time.Time) error { return nil }

// reading returns a zconn that reads stream.
func reading(stream []byte) *zconn {
	return &zconn{c: discardConn{}, r: bufio.NewReader(bytes.NewReader(stream))}
}

// TestMessageOfEndlessEmptyFramesIsRefused: empty frames cost a peer two
// bytes each and nothing against a message's byte limit, so a message that
// never ends (each frame flagged "more") must be refused by its number of
// frames; otherwise each adds a slice header to the message being
// gathered, and the peer grows the publisher's memory without bound.
func TestMessageOfEndlessEmptyFramesIsRefused(t *testing.T) {
	stream := bytes.Repeat([]byte{flagMore, 0}, 100_000)
	stream = append(stream, 0, 0)
	msg, err := reading(stream).readMessage(maxReplayRequest)
	if !errors.Is(err, ErrPeer) {
		t.Fatalf("a message of %d empty frames read with error %v, want ErrPeer", len(msg), err)
	}
}

// TestMessageOfMaxFramesIsRead: the frame bound refuses only what is over
// it.
func TestMessageOfMaxFramesIsRead(t *testing.T) {
	stream := append(bytes.Repeat([]byte{flagMore, 0}, maxFrames-1), 0, 0)
	msg, err := reading(stream).readMessage(maxReplayRequest)
	if err != nil || len(msg) != maxFrames {
		t.Fatalf("a message of %d frames read as %d frames, %v", maxFrames, len(msg), err)
	}
}
