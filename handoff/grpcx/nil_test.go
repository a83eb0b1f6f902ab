package grpcx_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/grpcx"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
)

// noPanic runs f and turns a panic into a test failure.
func noPanic(t *testing.T, f func() error) (err error) {
	t.Helper()
	defer func() {
		if p := recover(); p != nil {
			t.Errorf("panicked: %v", p)
			err = fmt.Errorf("panicked: %v", p)
		}
	}()
	return f()
}

// TestNilArguments: as in package handoff, a nil receiver, server,
// transport or context is an error wrapping handoff.ErrInvalidArgument,
// never a panic (for a nil receiver, one on the goroutine that serves the
// first transfer, which would take the decode node down).
func TestNilArguments(t *testing.T) {
	creds := insecure.NewCredentials()
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: newPool(t, 16), Key: testkit.Key()})
	require.NoError(t, err)
	tr, err := grpcx.Dial("127.0.0.1:1", creds) // never connected: every call fails first
	require.NoError(t, err)
	defer tr.Close()
	var (
		nilTransport *grpcx.Transport
		noCtx        context.Context
	)
	cases := []struct {
		name string
		call func() error
	}{
		{"NewServer(nil receiver)", func() error { _, err := grpcx.NewServer(nil, creds); return err }},
		{"Register(nil receiver)", func() error { return grpcx.Register(grpc.NewServer(), nil) }},
		{"Register(nil server)", func() error { return grpcx.Register(nil, recv) }},
		{"nil Transport.Open", func() error { _, err := nilTransport.Open(context.Background()); return err }},
		{"nil Transport.Close", func() error { return nilTransport.Close() }},
		{"zero Transport.Open", func() error { _, err := (&grpcx.Transport{}).Open(context.Background()); return err }},
		{"Transport.Open(nil ctx)", func() error { _, err := tr.Open(noCtx); return err }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := noPanic(t, tc.call)
			assert.ErrorIs(t, err, handoff.ErrInvalidArgument)
		})
	}

	// A nil *Transport in a handoff.Transport is not a nil interface, so
	// Send reaches Open, which refuses it.
	l, err := testkit.Prefill(newPool(t, 16), "req", "victim", 40)
	require.NoError(t, err)
	exp, err := newSender(t, 0).Export(l, 0)
	require.NoError(t, err)
	err = noPanic(t, func() error { return exp.Send(context.Background(), nilTransport) })
	assert.ErrorIs(t, err, handoff.ErrInvalidArgument)
	assert.ErrorIs(t, err, handoff.ErrTransport)
	require.NoError(t, exp.Abort())
}
