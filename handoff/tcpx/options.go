package tcpx

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/kvfence/kvfence/handoff"
)

// ErrNoSecurity: Dial or NewServer without a Security (TLS, or Insecure
// for a trusted network), or with TLS and a nil config.
var ErrNoSecurity = errors.New("tcpx: security required (TLS, or Insecure for a trusted network)")

// Security is how a transport's connections are protected. The zero
// Security is refused (ErrNoSecurity): plain TCP is something a caller
// asks for by name (Insecure), never what it gets by leaving a field out.
type Security struct {
	tls      *tls.Config
	insecure bool
}

// TLS protects every connection with cfg: on a Transport, the server's
// certificate is verified against cfg (cfg.ServerName defaults to the
// dialed host); on a Server, cfg must hold a certificate. A nil cfg is
// refused with ErrNoSecurity.
func TLS(cfg *tls.Config) Security { return Security{tls: cfg} }

// Insecure sends everything in the clear, the page bytes included, with
// no authentication of either end beyond the manifest's and the seal's
// MACs: for loopback or a trusted fabric only (see the package doc).
func Insecure() Security { return Security{insecure: true} }

func (s Security) check() error {
	if s.tls == nil && !s.insecure {
		return ErrNoSecurity
	}
	return nil
}

// Options tune a Transport or a Server; the zero Options are the
// defaults.
type Options struct {
	// MaxMessageBytes bounds one message, either way: a data frame holds
	// at least one whole page, so a page (over all its regions) must fit.
	// A peer's length prefix over it is refused before anything is
	// allocated (ErrMessageTooLarge). 0 means DefaultMaxMessageBytes.
	MaxMessageBytes int
	// HandshakeTimeout bounds connecting, the TLS handshake and the
	// hellos; 0 means 10 s.
	HandshakeTimeout time.Duration
	// MessageTimeout bounds the write of each message, a server's wait
	// for the sender's next message, and a sender's wait for each verdict
	// (which includes the receiver's ReceiverConfig.AdmitWait), so that a
	// stalled peer holds neither pinned prefill pages nor a server's
	// goroutine for longer. 0 means 1 minute.
	MessageTimeout time.Duration
	// MaxConns, on a Server, bounds the connections it serves at once,
	// over all its listeners, each counted from its accept (TLS and the
	// hellos included) to its end: every one holds a goroutine, TLS state
	// and, from its hello on, a read buffer, all before the manifest's MAC
	// is checked, so without a bound a client that is no sender could open
	// connections until the server runs out of memory. A connection over
	// it is closed at once, nothing read from it, and counted
	// (ServerStats.OverMaxConns) and logged (see Logger); its sender's
	// transfer fails with handoff.ErrTransport, as against a server that
	// is down. 0 means DefaultMaxConns; negative is refused. A Transport
	// ignores it.
	MaxConns int
	// Logger, on a Server, gets the connections refused before their
	// transfer began: a TLS or tcpx handshake that failed (a wrong peer on
	// the port; reason "handshake"), or one over MaxConns ("max_conns").
	// Those are what a flood of connections brings by the thousand a
	// second, so the log does not take one record each: the first
	// refusal of each reason in a second is logged at once, with its
	// remote and error, the rest of that second's only counted, and one
	// summary record when the second ends (or at Close or Shutdown) says
	// how many were not logged ("suppressed") and names the last one's
	// remote and error. ServerStats counts every one. The transfers' own
	// refusals are the receiver's to log (handoff.ReceiverConfig.Logger).
	Logger *slog.Logger
}

// lingerTimeout is how long a server reads and drops what a sender still
// sends after the receiver has ended the transfer early, so that the
// verdict reaches the sender before the connection is reset.
const lingerTimeout = 2 * time.Second

// readGrace is how long a sender whose write the network failed waits for
// its reader to read what arrived before the failure (see broke).
const readGrace = 100 * time.Millisecond

// withDefaults checks o and fills in its defaults.
func (o Options) withDefaults() (Options, error) {
	switch {
	case o.MaxMessageBytes < 0 || o.HandshakeTimeout < 0 || o.MessageTimeout < 0:
		return o, fmt.Errorf("%w: tcpx: negative MaxMessageBytes %d, HandshakeTimeout %v or MessageTimeout %v",
			handoff.ErrInvalidConfig, o.MaxMessageBytes, o.HandshakeTimeout, o.MessageTimeout)
	case o.MaxConns < 0:
		return o, fmt.Errorf("%w: tcpx: negative MaxConns %d", handoff.ErrInvalidConfig, o.MaxConns)
	case int64(o.MaxMessageBytes) > math.MaxUint32:
		return o, fmt.Errorf("%w: tcpx: MaxMessageBytes %d does not fit the 32-bit length prefix", handoff.ErrInvalidConfig, o.MaxMessageBytes)
	}
	if o.MaxMessageBytes == 0 {
		o.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if o.HandshakeTimeout == 0 {
		o.HandshakeTimeout = 10 * time.Second
	}
	if o.MessageTimeout == 0 {
		o.MessageTimeout = time.Minute
	}
	if o.MaxConns == 0 {
		o.MaxConns = DefaultMaxConns
	}
	return o, nil
}
