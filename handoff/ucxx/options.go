package ucxx

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/kvfence/kvfence/handoff"
)

const (
	// DefaultMaxMessageBytes is the default bound on one message, either
	// way (Options.MaxMessageBytes): a data frame, or the receiver's
	// grant of a fragmented import (about 20 bytes and a remote key per
	// run of pages).
	DefaultMaxMessageBytes = 64 << 20
	// DefaultMaxConns is the default bound on the connections a Server
	// serves at once (Options.MaxConns).
	DefaultMaxConns = 256
)

var (
	// ErrUnavailable: this build has no UCX. The package is built with
	// UCX only under the build tag ucx, with cgo, and UCX's headers and
	// libraries (Debian's libucx-dev); otherwise every constructor returns
	// it.
	ErrUnavailable = errors.New("ucxx: UCX unavailable: build with cgo and -tags ucx (needs libucx-dev)")
	// ErrMessageTooLarge: a message over Options.MaxMessageBytes. It
	// wraps handoff.ErrTransport.
	ErrMessageTooLarge = fmt.Errorf("%w: ucxx: message over the size limit", handoff.ErrTransport)
	// ErrHandshake: the peer is not a ucxx endpoint of this version. It
	// wraps handoff.ErrTransport.
	ErrHandshake = fmt.Errorf("%w: ucxx: handshake refused", handoff.ErrTransport)
	// ErrServerClosed is what Serve returns once Shutdown or Close has
	// been called.
	ErrServerClosed = errors.New("ucxx: server closed")
)

// DataPath says how the pages travel.
type DataPath int

const (
	// PathAuto writes the pages into the receiver's memory where the
	// decode pool lends it (host memory): as rendezvous messages that the
	// receiver receives into it where every lane of the connection's
	// endpoint is UCX's TCP transport, over which UCX has no put of its
	// own and emulates one (see the package doc: such puts cost more,
	// and one that arrives after its sender's connection failed aborts
	// the receiving process); with UCX's puts (remote memory access)
	// otherwise. It sends them as messages where the pool lends nothing.
	PathAuto DataPath = iota
	// PathMessages always sends the pages as messages (UCX's active
	// messages), as handoff/tcpx sends its frames: the receiver copies
	// them into the decode pool.
	PathMessages
)

func (p DataPath) String() string {
	switch p {
	case PathAuto:
		return "auto"
	case PathMessages:
		return "messages"
	}
	return fmt.Sprintf("DataPath(%d)", int(p))
}

// Options tune a Transport or a Server; the zero Options are the
// defaults. UCX's own configuration (UCX_TLS, UCX_NET_DEVICES and the
// rest) comes from the environment, as for any UCX program.
type Options struct {
	// MaxMessageBytes bounds one message, either way; a peer's message
	// over it is refused before its bytes are fetched
	// (ErrMessageTooLarge). 0 means DefaultMaxMessageBytes.
	MaxMessageBytes int
	// ConnectTimeout bounds connecting; 0 means 10 s.
	ConnectTimeout time.Duration
	// MessageTimeout bounds each message's send, each write of a chunk of
	// pages into the receiver's memory, a server's wait for the sender's
	// next message and a sender's wait for each verdict (which includes
	// the receiver's ReceiverConfig.AdmitWait); 0 means 1 minute.
	MessageTimeout time.Duration
	// RevokeTimeout bounds a receiver's wait, when it takes its memory
	// back, for the sender to confirm that it writes it no more; past it
	// the connection is cut. 0 means 2 s.
	RevokeTimeout time.Duration
	// MaxConns, on a Server, bounds the connections it serves at once; a
	// connection over it is rejected. 0 means DefaultMaxConns; negative
	// is refused. A Transport ignores it.
	MaxConns int
	// DataPath, on a Server, says how the pages travel (PathAuto: into
	// the decode pool's memory where it can). A Transport follows its
	// server.
	DataPath DataPath
	// Logger, on a Server, gets the connections it refused before their
	// transfer began (over MaxConns, a peer that is not ucxx).
	Logger *slog.Logger
}

// withDefaults checks o and fills in its defaults.
func (o Options) withDefaults() (Options, error) {
	switch {
	case o.MaxMessageBytes < 0 || o.ConnectTimeout < 0 || o.MessageTimeout < 0 || o.RevokeTimeout < 0:
		return o, fmt.Errorf("%w: ucxx: negative MaxMessageBytes %d, ConnectTimeout %v, MessageTimeout %v or RevokeTimeout %v",
			handoff.ErrInvalidConfig, o.MaxMessageBytes, o.ConnectTimeout, o.MessageTimeout, o.RevokeTimeout)
	case o.MaxConns < 0:
		return o, fmt.Errorf("%w: ucxx: negative MaxConns %d", handoff.ErrInvalidConfig, o.MaxConns)
	case o.DataPath < PathAuto || o.DataPath > PathMessages:
		return o, fmt.Errorf("%w: ucxx: unknown %v", handoff.ErrInvalidConfig, o.DataPath)
	}
	if o.MaxMessageBytes == 0 {
		o.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if o.ConnectTimeout == 0 {
		o.ConnectTimeout = 10 * time.Second
	}
	if o.MessageTimeout == 0 {
		o.MessageTimeout = time.Minute
	}
	if o.RevokeTimeout == 0 {
		o.RevokeTimeout = 2 * time.Second
	}
	if o.MaxConns == 0 {
		o.MaxConns = DefaultMaxConns
	}
	return o, nil
}

// Available reports whether this build has UCX: nil if so, else
// ErrUnavailable.
func Available() error { return available }

// ServerStats are a server's connection counts.
type ServerStats struct {
	Conns            int    // connections being served now, from their accept
	OverMaxConns     uint64 // connections closed unread because MaxConns were served
	FailedHandshakes uint64 // connections whose hello failed: not a ucxx client, or another version
}
