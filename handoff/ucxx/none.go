//go:build !cgo || !ucx

package ucxx

import (
	"context"
	"fmt"

	"github.com/kvfence/kvfence/handoff"
)

// This file is the package without UCX (no cgo, or built without the
// tag ucx): every constructor reports ErrUnavailable, so that callers
// build, and find out at run time, everywhere.

var available = ErrUnavailable

// Transport is a handoff.Transport to one ucxx server; without UCX there
// is none to be had.
type Transport struct{}

var _ handoff.Transport = (*Transport)(nil)

// Dial returns ErrUnavailable: this build has no UCX.
func Dial(addr string, opts Options) (*Transport, error) {
	if _, err := opts.withDefaults(); err != nil {
		return nil, err
	}
	return nil, ErrUnavailable
}

var errNoTransport = fmt.Errorf("%w: ucxx: transport not made by Dial (%w)", handoff.ErrInvalidArgument, ErrUnavailable)

// Open fails: no Transport exists in this build.
func (t *Transport) Open(ctx context.Context) (handoff.Stream, error) { return nil, errNoTransport }

// Close fails: no Transport exists in this build.
func (t *Transport) Close() error { return errNoTransport }

// Server serves handoffs over UCX; without UCX there is none to be had.
type Server struct{}

// NewServer returns ErrUnavailable (after refusing a nil receiver, as
// the UCX build does): this build has no UCX.
func NewServer(r *handoff.Receiver, opts Options) (*Server, error) {
	if r == nil {
		return nil, fmt.Errorf("%w: ucxx: server without a receiver", handoff.ErrInvalidArgument)
	}
	if _, err := opts.withDefaults(); err != nil {
		return nil, err
	}
	return nil, ErrUnavailable
}

var errNoServer = fmt.Errorf("%w: ucxx: server not made by NewServer (%w)", handoff.ErrInvalidArgument, ErrUnavailable)

// Listen fails: no Server exists in this build.
func (s *Server) Listen(addr string) (string, error) { return "", errNoServer }

// Stats are zero.
func (s *Server) Stats() ServerStats { return ServerStats{} }

// Shutdown fails: no Server exists in this build.
func (s *Server) Shutdown(ctx context.Context) error { return errNoServer }

// Close fails: no Server exists in this build.
func (s *Server) Close() error { return errNoServer }
