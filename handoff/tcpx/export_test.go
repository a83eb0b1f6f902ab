package tcpx

import (
	"context"
	"errors"
	"io"
	"net"

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
