package tcpx

import (
	"context"
	"errors"
	"io"
	"net"
	"time"

	"github.com/kvfence/kvfence/handoff"
)

// NewDrainServer returns a plain-TCP server whose every connection takes
// the sender's messages (RecvParts) and drops them, and answers one byte
// once the sender has closed its side: tcpx's share of a transfer with
// no receiver behind it (BenchmarkTCPXStream).
func NewDrainServer(opts Options) (*Server, error) { return newServer(drain, Insecure(), opts) }

func drain(_ context.Context, ep handoff.Endpoint) error {
	pe := ep.(handoff.PartsEndpoint)
	for {
		if _, err := pe.RecvParts(); err != nil {
			if errors.Is(err, io.EOF) {
				return ep.Send([]byte{'V'})
			}
			return err
		}
	}
}

// RawConn is the connection under a stream Open returned, for tests that
// write what no sender would.
func RawConn(st handoff.Stream) net.Conn { return st.(*clientStream).conn }

// SetRefusalLogWindow sets the window in which the server logs the first
// refusal of each kind and counts the rest, so that a test need not wait
// the default second (or can make it long enough that none ends); 0 logs
// every refusal. Call it before the server's first refusal.
func SetRefusalLogWindow(s *Server, d time.Duration) {
	for _, l := range []*refusalLog{&s.overMaxLog, &s.handshakeLog} {
		l.mu.Lock()
		l.window = d
		l.mu.Unlock()
	}
}
