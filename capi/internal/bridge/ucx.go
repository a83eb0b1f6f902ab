package bridge

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/ucxx"
	"github.com/kvfence/kvfence/kvcache"
)

// Handoff over UCX through C: a receiver serves imports on an address
// (handoff/ucxx's Server), a transport sends exports to one (its
// Transport). Servers and transports are handles from the same counter
// as pools and leases. The library has UCX only when built with the tag
// ucx (and cgo, and libucx-dev); otherwise every call that would need it
// fails with ucxx.ErrUnavailable.

var (
	ucxServers    sync.Map // Handle → *ucxServerEntry
	ucxTransports sync.Map // Handle → *ucxx.Transport
)

type ucxServerEntry struct {
	srv  *ucxx.Server
	addr string
}

// UCXAvailable reports whether the library was built with UCX.
func UCXAvailable() bool { return ucxx.Available() == nil }

// UCXJSON is the options of a UCX server or transport
// (kvf_ucx_server_create, kvf_ucx_transport_create); every field is
// optional, 0 meaning handoff/ucxx's default.
type UCXJSON struct {
	MaxMessageBytes  int64  `json:"max_message_bytes,omitempty"`
	ConnectTimeoutMS int64  `json:"connect_timeout_ms,omitempty"`
	MessageTimeoutMS int64  `json:"message_timeout_ms,omitempty"`
	RevokeTimeoutMS  int64  `json:"revoke_timeout_ms,omitempty"`
	MaxConns         int64  `json:"max_conns,omitempty"`
	DataPath         string `json:"data_path,omitempty"` // "auto" (default) or "messages"
}

// ParseUCXOptions decodes a UCXJSON; empty data means defaults. Errors
// wrap handoff.ErrInvalidConfig.
func ParseUCXOptions(data []byte) (ucxx.Options, error) {
	var uj UCXJSON
	if len(bytes.TrimSpace(data)) > 0 {
		if len(data) > MaxJSONBytes {
			return ucxx.Options{}, fmt.Errorf("%w: UCX options JSON of %d bytes", handoff.ErrInvalidConfig, len(data))
		}
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&uj); err != nil {
			return ucxx.Options{}, fmt.Errorf("%w: UCX options JSON: %v", handoff.ErrInvalidConfig, err)
		}
		if _, err := dec.Token(); !errors.Is(err, io.EOF) {
			return ucxx.Options{}, fmt.Errorf("%w: UCX options JSON: trailing data after the object", handoff.ErrInvalidConfig)
		}
	}
	o := ucxx.Options{MaxMessageBytes: clampInt(uj.MaxMessageBytes), ConnectTimeout: ms(uj.ConnectTimeoutMS),
		MessageTimeout: ms(uj.MessageTimeoutMS), RevokeTimeout: ms(uj.RevokeTimeoutMS), MaxConns: clampInt(uj.MaxConns)}
	switch uj.DataPath {
	case "", "auto":
		o.DataPath = ucxx.PathAuto
	case "messages":
		o.DataPath = ucxx.PathMessages
	default:
		return ucxx.Options{}, fmt.Errorf("%w: UCX options JSON: data_path %q: want \"auto\" or \"messages\"",
			handoff.ErrInvalidConfig, uj.DataPath)
	}
	return o, nil
}

// CreateUCXServer serves the imports of receiver over UCX on addr
// (host:port; port 0 picks one): UCXServerAddr says where.
func CreateUCXServer(receiver Handle, addr string, optionsJSON []byte) (Handle, error) {
	v, ok := receivers.Load(receiver)
	if !ok {
		return 0, invalid(receiver, "receiver")
	}
	opts, err := ParseUCXOptions(optionsJSON)
	if err != nil {
		return 0, err
	}
	srv, err := ucxx.NewServer(v.(*receiverEntry).r, opts)
	if err != nil {
		return 0, err
	}
	bound, err := srv.Listen(strings.Clone(addr))
	if err != nil {
		srv.Close()
		return 0, err
	}
	h := nextHandle.Add(1)
	ucxServers.Store(h, &ucxServerEntry{srv: srv, addr: bound})
	return h, nil
}

// UCXServerAddr returns the address the server listens on.
func UCXServerAddr(h Handle) (string, error) {
	v, ok := ucxServers.Load(h)
	if !ok {
		return "", invalid(h, "UCX server")
	}
	return v.(*ucxServerEntry).addr, nil
}

// DestroyUCXServer closes the server: the transfers in flight fail (their
// imports are aborted and scrubbed) before it returns.
func DestroyUCXServer(h Handle) error {
	v, ok := ucxServers.LoadAndDelete(h)
	if !ok {
		return invalid(h, "UCX server")
	}
	return v.(*ucxServerEntry).srv.Close()
}

// CreateUCXTransport returns a transport to the UCX server at addr.
func CreateUCXTransport(addr string, optionsJSON []byte) (Handle, error) {
	opts, err := ParseUCXOptions(optionsJSON)
	if err != nil {
		return 0, err
	}
	tr, err := ucxx.Dial(strings.Clone(addr), opts) // addr may alias the caller's memory
	if err != nil {
		return 0, err
	}
	h := nextHandle.Add(1)
	ucxTransports.Store(h, tr)
	return h, nil
}

// DestroyUCXTransport closes the transport: the transfers still going
// on it fail.
func DestroyUCXTransport(h Handle) error {
	v, ok := ucxTransports.LoadAndDelete(h)
	if !ok {
		return invalid(h, "UCX transport")
	}
	return v.(*ucxx.Transport).Close()
}

// ExportSendUCX sends the export over the UCX transport and waits for the
// receiver's verdict, at most timeout (0: no bound but the transport's
// own): on success the decode pool holds the verified lease and the
// export has ended (its pages scrubbed); on failure the pages stay pinned
// for a retry, until abort or the reclaim deadline.
func ExportSendUCX(exp, transport Handle, timeout time.Duration) error {
	e, err := lookupExport(exp)
	if err != nil {
		return err
	}
	v, ok := ucxTransports.Load(transport)
	if !ok {
		return invalid(transport, "UCX transport")
	}
	if timeout < 0 {
		return fmt.Errorf("%w: negative timeout %v", kvcache.ErrInvalidArgument, timeout)
	}
	ctx := context.Background()
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	return e.Send(ctx, v.(*ucxx.Transport))
}

// ReceiverTake returns the lease of request requestID that the receiver
// imported over a transport (a UCX server), as a lease handle, once; 0
// if no such import has completed (yet).
func ReceiverTake(receiver Handle, requestID string) (Handle, error) {
	v, ok := receivers.Load(receiver)
	if !ok {
		return 0, invalid(receiver, "receiver")
	}
	re := v.(*receiverEntry)
	l, ok := re.r.Take(requestID)
	if !ok {
		return 0, nil
	}
	return newLease(re.pool, l, true), nil
}
