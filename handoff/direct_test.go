package handoff_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// moveDirect carries an export to the receiver without a transport,
// chunk pages at a time, letting tamper change a chunk on its way.
func moveDirect(exp *handoff.Export, imp *handoff.Import, chunk int, tamper func(first int, b []byte)) error {
	pb := exp.PageBytes()
	n := exp.Manifest().Units()
	for first := 0; first < n; first += chunk {
		k := min(chunk, n-first)
		buf := make([]byte, k*pb)
		if err := exp.ReadUnits(first, buf); err != nil {
			return err
		}
		if tamper != nil {
			tamper(first, buf)
		}
		if err := imp.WriteUnits(first, buf); err != nil {
			return err
		}
	}
	return nil
}

func TestDirect(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name     string
		prompt   int
		manifest func([]byte) []byte                          // changes the manifest bytes
		move     func(*handoff.Export, *handoff.Import) error // nil: every page, 3 at a time
		wantErr  error                                        // at Begin, while moving, or at Complete
		replay   bool                                         // Begin the same manifest again after success
	}{
		{name: "one page", prompt: 1},
		{name: "several chunks", prompt: 16*7 + 5},
		{name: "replay refused", prompt: 40, replay: true, wantErr: handoff.ErrReplay},
		{name: "forged manifest", prompt: 40, manifest: func(b []byte) []byte { b[40]++; return b }, wantErr: handoff.ErrBadMAC},
		{name: "truncated manifest", prompt: 40, manifest: func(b []byte) []byte { return b[:50] }, wantErr: handoff.ErrMalformedManifest},
		{name: "missing page", prompt: 40, wantErr: kvcache.ErrIncompleteTransfer,
			move: func(e *handoff.Export, in *handoff.Import) error {
				buf := make([]byte, e.PageBytes())
				require.NoError(t, e.ReadUnits(0, buf))
				return in.WriteUnits(0, buf)
			}},
		{name: "corrupted page", prompt: 40, wantErr: kvcache.ErrChecksumMismatch,
			move: func(e *handoff.Export, in *handoff.Import) error {
				return moveDirect(e, in, 3, func(first int, b []byte) { b[len(b)-1] ^= 1 })
			}},
		{name: "page twice", prompt: 40, wantErr: kvcache.ErrDuplicatePage,
			move: func(e *handoff.Export, in *handoff.Import) error {
				buf := make([]byte, e.PageBytes())
				require.NoError(t, e.ReadUnits(0, buf))
				require.NoError(t, in.WriteUnits(0, buf))
				return in.WriteUnits(0, buf)
			}},
		{name: "ragged write", prompt: 40, wantErr: kvcache.ErrInvalidArgument,
			move: func(e *handoff.Export, in *handoff.Import) error {
				return in.WriteUnits(0, make([]byte, e.PageBytes()+1))
			}},
		{name: "aborted by the caller", prompt: 40, wantErr: kvcache.ErrStaleTransfer,
			move: func(e *handoff.Export, in *handoff.Import) error {
				require.NoError(t, in.Abort())
				return moveDirect(e, in, 3, nil)
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefill := pool(t, testkit.PoolConfig{Pages: 64})
			decode := pool(t, testkit.PoolConfig{Pages: 64})
			recv := receiver(t, decode)
			l, err := testkit.Prefill(prefill, "r1", "victim", tt.prompt)
			require.NoError(t, err)
			exp, err := sender(t).Export(l, 16)
			require.NoError(t, err)
			mb := bytes.Clone(mustManifest(t, exp))
			if tt.manifest != nil {
				mb = tt.manifest(mb)
			}
			imp, err := recv.Begin(ctx, mb)
			if err == nil {
				assert.Equal(t, exp.Manifest().Units(), imp.Units())
				move := tt.move
				if move == nil {
					move = func(e *handoff.Export, in *handoff.Import) error { return moveDirect(e, in, 3, nil) }
				}
				err = move(exp, imp)
			}
			var dl *kvcache.Lease
			if err == nil {
				dl, err = imp.Complete()
			}
			if err == nil && tt.replay {
				require.NoError(t, exp.Ack())
				_, err = recv.Begin(ctx, mb)
			}
			if tt.wantErr != nil {
				require.ErrorIs(t, err, tt.wantErr)
				assert.Equal(t, uint64(1), recv.Stats().Refused)
				if !tt.replay {
					assert.True(t, exp.Live(), "a failed import leaves the export pinned for a retry")
					require.NoError(t, exp.Abort())
					require.NoError(t, decode.Check())
					assert.Zero(t, decode.Stats().LiveLeases)
				}
			} else {
				require.NoError(t, err)
				assert.Equal(t, uint64(1), recv.Stats().Imported)
				require.NoError(t, exp.Ack())
				assert.False(t, l.Live())
			}
			if dl != nil {
				assert.Equal(t, kvcache.PhasePrefilled, dl.Phase())
				assert.Equal(t, tt.prompt, dl.Written())
				require.NoError(t, testkit.VerifyContent(decode, dl, "r1"))
				require.NoError(t, dl.Release())
			}
			sweep(t, prefill, decode)
		})
	}
}

// TestDirectRetryAfterAbort: an aborted import frees its request ID, so
// the same manifest can be imported on a second try.
func TestDirectRetryAfterAbort(t *testing.T) {
	ctx := context.Background()
	prefill := pool(t, testkit.PoolConfig{Pages: 64})
	decode := pool(t, testkit.PoolConfig{Pages: 64})
	recv := receiver(t, decode)
	l, err := testkit.Prefill(prefill, "r1", "victim", 50)
	require.NoError(t, err)
	exp, err := sender(t).Export(l, 0)
	require.NoError(t, err)
	imp, err := recv.Begin(ctx, mustManifest(t, exp))
	require.NoError(t, err)
	_, err = recv.Begin(ctx, mustManifest(t, exp))
	require.ErrorIs(t, err, handoff.ErrReplay, "a second Begin while the first is in progress")
	require.NoError(t, imp.Abort())
	require.NoError(t, imp.Abort(), "abort twice")
	_, err = imp.Complete()
	require.ErrorIs(t, err, kvcache.ErrStaleTransfer)

	imp, err = recv.Begin(ctx, mustManifest(t, exp))
	require.NoError(t, err)
	require.NoError(t, moveDirect(exp, imp, 100, nil))
	dl, err := imp.Complete()
	require.NoError(t, err)
	require.NoError(t, imp.Abort(), "abort after complete does nothing")
	assert.True(t, dl.Live())
	require.NoError(t, exp.Ack())
	require.NoError(t, dl.Release())
	sweep(t, prefill, decode)
}

// TestDirectTimeout: an import the caller abandons is aborted at the
// receiver's TransferTimeout, and its pages are scrubbed.
func TestDirectTimeout(t *testing.T) {
	ctx := context.Background()
	prefill := pool(t, testkit.PoolConfig{Pages: 64})
	decode := pool(t, testkit.PoolConfig{Pages: 64})
	recv := receiver(t, decode, func(c *handoff.ReceiverConfig) { c.TransferTimeout = time.Millisecond })
	l, err := testkit.Prefill(prefill, "r1", "victim", 50)
	require.NoError(t, err)
	exp, err := sender(t).Export(l, 0)
	require.NoError(t, err)
	imp, err := recv.Begin(ctx, mustManifest(t, exp))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return decode.Stats().LiveLeases == 0 }, 5*time.Second, time.Millisecond)
	_, err = imp.Complete()
	require.ErrorIs(t, err, kvcache.ErrStaleTransfer)
	require.NoError(t, exp.Abort())
	sweep(t, prefill, decode)
}

// mustManifest is exp's manifest with the checksum in it.
func mustManifest(t testing.TB, exp *handoff.Export) []byte {
	t.Helper()
	b, err := exp.ManifestBytes()
	require.NoError(t, err)
	return b
}

// TestDirectRefusesSealedManifest: the manifest Send sends has its
// checksum sealed after the pages, which a direct import never receives;
// Begin refuses it without claiming the request, and the manifest with
// the checksum (ManifestBytes) then imports. ManifestBytes fails once the
// pages are no longer pinned.
func TestDirectRefusesSealedManifest(t *testing.T) {
	ctx := context.Background()
	prefill := pool(t, testkit.PoolConfig{Pages: 64})
	decode := pool(t, testkit.PoolConfig{Pages: 64})
	recv := receiver(t, decode)
	l, err := testkit.Prefill(prefill, "r1", "victim", 50)
	require.NoError(t, err)
	exp, err := sender(t).Export(l, 0)
	require.NoError(t, err)

	// What Send would put on the wire first, caught on its way.
	var sealed []byte
	cut := &hooked{inner: handoff.NewInProcess(recv), send: func(st handoff.Stream, n int, msg []byte) error {
		sealed = bytes.Clone(msg[1:]) // without the message kind
		st.Close()
		return handoff.ErrTransport
	}}
	require.Error(t, exp.Send(ctx, cut))
	_, err = recv.Begin(ctx, sealed)
	require.ErrorIs(t, err, handoff.ErrProtocol)
	assert.Equal(t, 0, decode.Stats().InUsePages)

	imp, err := recv.Begin(ctx, mustManifest(t, exp))
	require.NoError(t, err, "the refused manifest claimed the request")
	require.NoError(t, moveDirect(exp, imp, 7, nil))
	dl, err := imp.Complete()
	require.NoError(t, err)
	require.NoError(t, testkit.VerifyContent(decode, dl, "r1"))
	require.NoError(t, exp.Ack())
	require.NoError(t, dl.Release())

	l2, err := testkit.Prefill(prefill, "r2", "victim", 50)
	require.NoError(t, err)
	exp2, err := sender(t).Export(l2, 0)
	require.NoError(t, err)
	require.NoError(t, exp2.Abort())
	_, err = exp2.ManifestBytes()
	require.ErrorIs(t, err, kvcache.ErrReclaimed)
	sweep(t, prefill, decode)
}

// mlaSpec is a pool of MLA latents and sparse-attention indexer keys
// (regions of two page sizes, three element types), as the GLM-5 family
// caches, at test size.
func mlaSpec(indexerDim int) kvcache.CacheSpec {
	layers := []int{0, 1}
	return kvcache.CacheSpec{Groups: []kvcache.CacheGroup{{Name: "kv", Kind: kvcache.GroupPerToken, TokensPerPage: 16,
		Regions: append(kvcache.MLALatent(layers, 28, 4, kvcache.BF16, 16), kvcache.IndexerKeys(layers, indexerDim, 16)...)}}}
}

// Pools made from a cache spec hand off as Geometry pools do: every
// region of every page arrives, whatever its size; a decode pool of
// another spec (or a Geometry pool) refuses the manifest before taking a
// page.
func TestDirectCacheSpecPools(t *testing.T) {
	ctx := context.Background()
	prefill := pool(t, testkit.PoolConfig{Spec: mlaSpec(16), Pages: 32})
	decode := pool(t, testkit.PoolConfig{Spec: mlaSpec(16), Pages: 32})
	l, err := testkit.Prefill(prefill, "r1", "victim", 40)
	require.NoError(t, err)
	exp, err := sender(t).Export(l, 16)
	require.NoError(t, err)
	assert.Equal(t, len(mlaSpec(16).Groups[0].Regions), len(exp.Manifest().Spec.Groups[0].Regions))
	assert.Equal(t, int(prefill.PageBytes()), exp.PageBytes())
	mb := mustManifest(t, exp)
	for name, other := range map[string]*kvcache.Pool{
		"another spec":    pool(t, testkit.PoolConfig{Spec: mlaSpec(32), Pages: 32}),
		"a Geometry pool": pool(t, testkit.PoolConfig{Pages: 32}),
	} {
		_, err := receiver(t, other).Begin(ctx, mb)
		require.ErrorIs(t, err, handoff.ErrGeometryMismatch, name)
		assert.Zero(t, other.Stats().InUsePages, name)
	}
	imp, err := receiver(t, decode).Begin(ctx, mb)
	require.NoError(t, err)
	require.NoError(t, moveDirect(exp, imp, 2, nil))
	dl, err := imp.Complete()
	require.NoError(t, err)
	require.NoError(t, testkit.VerifyContent(decode, dl, "r1"))
	require.NoError(t, exp.Ack())
	require.NoError(t, dl.Release())
	sweep(t, prefill, decode)
}

// The streamed transfer (Export.Send) of a cache-spec pool: frames carry
// whole pages of every region, and the receiver's lease holds exactly
// what prefill wrote.
func TestSendCacheSpecPools(t *testing.T) {
	prefill := pool(t, testkit.PoolConfig{Spec: mlaSpec(16), Pages: 64})
	decode := pool(t, testkit.PoolConfig{Spec: mlaSpec(16), Pages: 64})
	recv := receiver(t, decode)
	l, err := testkit.Prefill(prefill, "s1", "victim", 16*9+3)
	require.NoError(t, err)
	exp, err := sender(t).Export(l, 8)
	require.NoError(t, err)
	require.NoError(t, exp.Send(context.Background(), handoff.NewInProcess(recv)))
	dl, ok := recv.Take("s1")
	require.True(t, ok)
	require.NoError(t, testkit.VerifyContent(decode, dl, "s1"))
	require.NoError(t, dl.Release())
	sweep(t, prefill, decode)
}
