package kvevents

import "errors"

// Sentinel errors. Every error this package returns wraps one of them;
// match with errors.Is.
var (
	// ErrInvalidConfig: a Config the publisher cannot run with (a pool
	// without events, an endpoint that is not tcp:// or ipc://, a
	// negative size).
	ErrInvalidConfig = errors.New("kvevents: invalid config")
	// ErrListen: an endpoint could not be bound.
	ErrListen = errors.New("kvevents: cannot listen")
	// ErrPeer: a subscriber or replay client broke the protocol (not
	// ZMTP 3, a socket type that cannot talk to ours, a frame too large)
	// or its connection failed; that peer is dropped, nobody else is.
	ErrPeer = errors.New("kvevents: peer failed")
	// ErrAuth: a peer failed the security handshake: a NULL peer at a
	// CURVE socket or the reverse, a CURVE client with another server key
	// or a key not in Curve.Clients, or a message that does not open. It
	// comes wrapped with ErrPeer.
	ErrAuth = errors.New("kvevents: peer not authenticated")
	// ErrTooLarge: a peer sent a frame over its limit. It comes wrapped
	// with ErrPeer.
	ErrTooLarge = errors.New("kvevents: frame too large")
	// ErrEncoding: a batch could not be encoded. Nothing returns it since
	// the publisher writes msgpack itself, into memory, which cannot fail;
	// it stays for callers that match it.
	ErrEncoding = errors.New("kvevents: cannot encode")
	// ErrClosed: the publisher has been closed.
	ErrClosed = errors.New("kvevents: publisher closed")
)
