package handoff_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// noPanic runs f and turns a panic into a test failure, so that one entry
// point that still panics does not hide the others.
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

// TestExportRefusedLease is the incident's path: the admission was
// refused, the engine ignored the error and exported what it got (a nil
// lease), and then used what Export gave back. Each step must fail with an
// error, not crash the prefill node, and nothing may reach the decode pool.
func TestExportRefusedLease(t *testing.T) {
	prefill := pool(t, testkit.PoolConfig{Pages: 64})
	decode := pool(t, testkit.PoolConfig{Pages: 64})
	recv := receiver(t, decode)
	ctx := context.Background()

	lease, err := prefill.Admit(ctx, kvcache.Request{ID: "long", Tenant: "victim", PromptTokens: 64*16 + 1})
	require.ErrorIs(t, err, kvcache.ErrExceedsMaxContext)
	require.Nil(t, lease)

	var exp *handoff.Export
	err = noPanic(t, func() error {
		exp, err = sender(t).Export(lease, 100)
		return err
	})
	assert.ErrorIs(t, err, handoff.ErrInvalidArgument)
	assert.ErrorIs(t, err, kvcache.ErrInvalidArgument, "the handoff sentinel is kvcache's")
	assert.Nil(t, exp)

	inproc := handoff.NewInProcess(recv)
	err = noPanic(t, func() error { return exp.Send(ctx, inproc) })
	assert.ErrorIs(t, err, handoff.ErrInvalidArgument, "Send on the nil export")
	_, err2 := func() (b []byte, err error) {
		err = noPanic(t, func() error { b, err = exp.ManifestBytes(); return err })
		return b, err
	}()
	assert.ErrorIs(t, err2, handoff.ErrInvalidArgument, "ManifestBytes on the nil export")
	inproc.Wait()
	assertNoImport(t, recv, decode, "long")
	assert.Zero(t, recv.Stats().Imported)
	sweep(t, prefill, decode)
}

// TestNilArguments: every entry point of the package answers a nil
// argument (or a nil receiver, which is what a caller holds after
// ignoring an error) with an error wrapping ErrInvalidArgument.
func TestNilArguments(t *testing.T) {
	prefill := pool(t, testkit.PoolConfig{Pages: 64})
	decode := pool(t, testkit.PoolConfig{Pages: 64})
	recv := receiver(t, decode)
	s := sender(t)
	ctx := context.Background()
	var noCtx context.Context // what a caller passes when it "has none"

	l, err := testkit.Prefill(prefill, "req", "victim", 100)
	require.NoError(t, err)
	exp, err := s.Export(l, 10)
	require.NoError(t, err)
	manifest := mustManifest(t, exp)

	var (
		nilSender   *handoff.Sender
		nilExport   *handoff.Export
		nilReceiver *handoff.Receiver
		nilImport   *handoff.Import
		nilInProc   *handoff.InProcess
		nilManifest *handoff.Manifest
	)
	cases := []struct {
		name string
		call func() error
	}{
		{"Sender.Export(nil lease)", func() error { _, err := s.Export(nil, 10); return err }},
		{"Sender.Export(zero lease)", func() error { _, err := s.Export(&kvcache.Lease{}, 10); return err }},
		{"nil Sender.Export", func() error { _, err := nilSender.Export(l, 10); return err }},
		{"Export.Send(nil ctx)", func() error { return exp.Send(noCtx, handoff.NewInProcess(recv)) }},
		{"Export.Send(nil transport)", func() error { return exp.Send(ctx, nil) }},
		{"nil Export.Send", func() error { return nilExport.Send(ctx, handoff.NewInProcess(recv)) }},
		{"nil Export.ManifestBytes", func() error { _, err := nilExport.ManifestBytes(); return err }},
		{"nil Export.Checksum", func() error { _, err := nilExport.Checksum(); return err }},
		{"nil Export.ReadUnits", func() error { return nilExport.ReadUnits(0, make([]byte, 512)) }},
		{"nil Export.Ack", func() error { return nilExport.Ack() }},
		{"nil Export.Abort", func() error { return nilExport.Abort() }},
		{"Receiver.Serve(nil ctx)", func() error { return recv.Serve(noCtx, nopEndpoint{}) }},
		{"Receiver.Serve(nil endpoint)", func() error { return recv.Serve(ctx, nil) }},
		{"nil Receiver.Serve", func() error { return nilReceiver.Serve(ctx, nopEndpoint{}) }},
		{"Receiver.Begin(nil ctx)", func() error { _, err := recv.Begin(noCtx, manifest); return err }},
		{"nil Receiver.Begin", func() error { _, err := nilReceiver.Begin(ctx, manifest); return err }},
		{"nil Import.WriteUnits", func() error { return nilImport.WriteUnits(0, make([]byte, 512)) }},
		{"nil Import.Complete", func() error { _, err := nilImport.Complete(); return err }},
		{"nil Import.Abort", func() error { return nilImport.Abort() }},
		{"NewInProcess(nil).Open", func() error { _, err := handoff.NewInProcess(nil).Open(ctx); return err }},
		{"nil InProcess.Open", func() error { _, err := nilInProc.Open(ctx); return err }},
		{"InProcess.Open(nil ctx)", func() error { _, err := handoff.NewInProcess(recv).Open(noCtx); return err }},
		{"nil Manifest.AppendEncode", func() error { _, err := nilManifest.AppendEncode(nil, testkit.Key()); return err }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := noPanic(t, tc.call)
			assert.ErrorIs(t, err, handoff.ErrInvalidArgument)
		})
	}

	// The methods without an error answer as for nothing.
	assert.NotPanics(t, func() {
		assert.False(t, nilExport.Live())
		assert.Zero(t, nilExport.Manifest())
		assert.Zero(t, nilExport.PageBytes())
		_, ok := nilReceiver.Take("req")
		assert.False(t, ok)
		assert.Zero(t, nilReceiver.Stats())
		assert.True(t, nilImport.Ended())
		assert.Zero(t, nilImport.Units())
		assert.Zero(t, nilImport.PageBytes())
		assert.Zero(t, nilImport.Manifest())
		nilInProc.Wait()
	})

	// An empty manifest is malformed input, not a nil argument.
	_, err = recv.Begin(ctx, nil)
	assert.ErrorIs(t, err, handoff.ErrMalformedManifest)

	// None of this touched the export, which still goes through.
	require.True(t, exp.Live())
	inproc := handoff.NewInProcess(recv)
	require.NoError(t, exp.Send(ctx, inproc))
	inproc.Wait()
	dl, ok := recv.Take("req")
	require.True(t, ok)
	require.NoError(t, testkit.VerifyContent(decode, dl, "req"))
	require.NoError(t, dl.Release())
	// The empty manifest counts as a refused transfer; nil arguments do not.
	want := handoff.ReceiverStats{Imported: 1, Refused: 1}
	want.RefusedBy[1] = 1 // malformed_manifest
	assert.Equal(t, want, recv.Stats())
	sweep(t, prefill, decode)
}

// nopEndpoint is an endpoint that is never reached: the calls it is passed
// to must fail before they read from it.
type nopEndpoint struct{}

func (nopEndpoint) Recv() ([]byte, error) { return nil, fmt.Errorf("nopEndpoint: Recv") }
func (nopEndpoint) Send([]byte) error     { return fmt.Errorf("nopEndpoint: Send") }
