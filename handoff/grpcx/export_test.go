package grpcx

import (
	"errors"
	"io"

	"google.golang.org/grpc"
)

// LentCollected reads how many messages' views came back only through
// their cleanup (SendViews).
func LentCollected() uint64 { return lentCollected.Load() }

// RegisterDrain adds to s, a server built with ServerOptions, a service on
// the handoff method that takes each message in the buffers gRPC received
// it in (RecvParts, no copy) and drops it, and answers one byte once the
// client has closed its side: gRPC's share of a transfer with no receiver
// behind it (BenchmarkGRPCStream).
func RegisterDrain(s *grpc.Server) { s.RegisterService(&serviceDesc, drain{}) }

type drain struct{}

func (drain) transfer(stream grpc.ServerStream) error {
	e := newServerEnd(stream)
	defer e.close()
	for {
		if _, err := e.RecvParts(); err != nil {
			if errors.Is(err, io.EOF) {
				return e.Send([]byte{'V'})
			}
			return err
		}
	}
}
