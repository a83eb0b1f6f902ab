package tcpx_test

import (
	"context"
	"crypto/tls"
	"net"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/handoff/tcpx"
)

// Plain TCP is asked for by name: no Security, or TLS without a config,
// is refused on both ends.
func TestRefusesMissingSecurity(t *testing.T) {
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: newPool(t, 16), Key: testkit.Key()})
	require.NoError(t, err)
	for _, sec := range []tcpx.Security{{}, tcpx.TLS(nil)} {
		_, err := tcpx.Dial("127.0.0.1:1", sec, tcpx.Options{})
		assert.ErrorIs(t, err, tcpx.ErrNoSecurity)
		_, err = tcpx.NewServer(recv, sec, tcpx.Options{})
		assert.ErrorIs(t, err, tcpx.ErrNoSecurity)
	}
}

// Options and addresses that cannot work are refused when the transport
// or server is made, not at the first transfer.
func TestRefusesBadOptions(t *testing.T) {
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: newPool(t, 16), Key: testkit.Key()})
	require.NoError(t, err)
	for _, opts := range []tcpx.Options{{MaxMessageBytes: -1}, {HandshakeTimeout: -1}, {MessageTimeout: -1}, {MaxConns: -1}, {MaxMessageBytes: 1 << 32}} {
		_, err := tcpx.Dial("127.0.0.1:1", tcpx.Insecure(), opts)
		assert.ErrorIs(t, err, handoff.ErrInvalidConfig, "%+v", opts)
		_, err = tcpx.NewServer(recv, tcpx.Insecure(), opts)
		assert.ErrorIs(t, err, handoff.ErrInvalidConfig, "%+v", opts)
	}
	_, err = tcpx.NewServer(recv, tcpx.TLS(&tls.Config{}), tcpx.Options{})
	assert.ErrorIs(t, err, handoff.ErrInvalidConfig, "a TLS server without a certificate")
	_, err = tcpx.Dial("no port", tcpx.Insecure(), tcpx.Options{})
	assert.ErrorIs(t, err, handoff.ErrInvalidArgument)
}

// TestNilArguments: as in package handoff, a nil receiver, server,
// listener, transport or context is an error wrapping
// handoff.ErrInvalidArgument, never a panic (for a nil receiver, one on
// the goroutine that serves the first transfer, which would take the
// decode node down).
func TestNilArguments(t *testing.T) {
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: newPool(t, 16), Key: testkit.Key()})
	require.NoError(t, err)
	srv, err := tcpx.NewServer(recv, tcpx.Insecure(), tcpx.Options{})
	require.NoError(t, err)
	defer srv.Close()
	tr := dial(t, "127.0.0.1:1", tcpx.Insecure(), tcpx.Options{}) // never connected: every call fails first
	var (
		nilTransport *tcpx.Transport
		nilServer    *tcpx.Server
		noCtx        context.Context
		noListener   net.Listener
	)
	cases := []struct {
		name string
		call func() error
	}{
		{"NewServer(nil receiver)", func() error { _, err := tcpx.NewServer(nil, tcpx.Insecure(), tcpx.Options{}); return err }},
		{"nil Server.Serve", func() error { return nilServer.Serve(nil) }},
		{"nil Server.Shutdown", func() error { return nilServer.Shutdown(context.Background()) }},
		{"nil Server.Close", func() error { return nilServer.Close() }},
		{"zero Server.Serve", func() error { return (&tcpx.Server{}).Serve(nil) }},
		{"Server.Serve(nil listener)", func() error { return srv.Serve(noListener) }},
		{"Server.Shutdown(nil ctx)", func() error { return srv.Shutdown(noCtx) }},
		{"nil Transport.Open", func() error { _, err := nilTransport.Open(context.Background()); return err }},
		{"nil Transport.Close", func() error { return nilTransport.Close() }},
		{"zero Transport.Open", func() error { _, err := (&tcpx.Transport{}).Open(context.Background()); return err }},
		{"Transport.Open(nil ctx)", func() error { _, err := tr.Open(noCtx); return err }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var err error
			require.NotPanics(t, func() { err = tc.call() })
			assert.ErrorIs(t, err, handoff.ErrInvalidArgument)
		})
	}

	// A nil *Transport in a handoff.Transport is not a nil interface, so
	// Send reaches Open, which refuses it.
	exp := export(t, newSender(t, 0), newPool(t, 16), "req", 40)
	require.NotPanics(t, func() { err = exp.Send(context.Background(), nilTransport) })
	assert.ErrorIs(t, err, handoff.ErrInvalidArgument)
	assert.ErrorIs(t, err, handoff.ErrTransport)
	require.NoError(t, exp.Abort())
}
