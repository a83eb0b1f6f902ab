package handoff_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

const (
	contextWindow = 1_048_576
	prefillPages  = 42_580 // 681,280 tokens of 16: the incident's prefill pool
	decodePages   = 70_000 // 1,120,000 tokens
)

func pool(t *testing.T, c testkit.PoolConfig) *kvcache.Pool {
	t.Helper()
	if c.Tenants == nil {
		c.Tenants = []kvcache.TenantConfig{{Name: "victim"}, {Name: "other"}}
	}
	p, err := testkit.NewPool(c)
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

func sender(t *testing.T, mod ...func(*handoff.SenderConfig)) *handoff.Sender {
	t.Helper()
	cfg := handoff.SenderConfig{Key: testkit.Key(), FrameBytes: 64 << 10}
	for _, f := range mod {
		f(&cfg)
	}
	s, err := handoff.NewSender(cfg)
	require.NoError(t, err)
	return s
}

func receiver(t *testing.T, p *kvcache.Pool, mod ...func(*handoff.ReceiverConfig)) *handoff.Receiver {
	t.Helper()
	cfg := handoff.ReceiverConfig{Pool: p, Key: testkit.Key()}
	for _, f := range mod {
		f(&cfg)
	}
	r, err := handoff.NewReceiver(cfg)
	require.NoError(t, err)
	return r
}

// hooked wraps a transport's streams so tests can tamper with, drop or cut
// the sender's messages (n counts Sends from 0) and its reads of verdicts.
type hooked struct {
	inner handoff.Transport
	send  func(st handoff.Stream, n int, msg []byte) error
	recv  func(st handoff.Stream, n int) ([]byte, error)
}

func (h *hooked) Open(ctx context.Context) (handoff.Stream, error) {
	st, err := h.inner.Open(ctx)
	if err != nil {
		return nil, err
	}
	return &hookedStream{Stream: st, h: h}, nil
}

type hookedStream struct {
	handoff.Stream
	h            *hooked
	sends, recvs int
}

func (s *hookedStream) Send(msg []byte) error {
	n := s.sends
	s.sends++
	if s.h.send != nil {
		return s.h.send(s.Stream, n, msg)
	}
	return s.Stream.Send(msg)
}

func (s *hookedStream) Recv() ([]byte, error) {
	n := s.recvs
	s.recvs++
	if s.h.recv != nil {
		return s.h.recv(s.Stream, n)
	}
	return s.Stream.Recv()
}

// assertNoImport checks that the decode side holds nothing for id.
func assertNoImport(t *testing.T, r *handoff.Receiver, decode *kvcache.Pool, id string) {
	t.Helper()
	_, ok := r.Take(id)
	assert.False(t, ok, "request %q has a decode lease", id)
	require.NoError(t, decode.Check())
}

// sweep releases nothing: every lease must already have ended.
func sweep(t *testing.T, pools ...*kvcache.Pool) {
	t.Helper()
	for _, p := range pools {
		require.NoError(t, testkit.Sweep(p))
	}
}

// TestIncident replays the incident's setting end to end.
func TestIncident(t *testing.T) {
	prefill := pool(t, testkit.PoolConfig{Pages: prefillPages, MaxContext: contextWindow, Undersized: true})
	decode := pool(t, testkit.PoolConfig{Pages: decodePages, MaxContext: contextWindow})
	require.Equal(t, 681_280, prefill.CapacityTokens())
	ctx := context.Background()

	// The over-long prompt is refused with its numbers; no lease exists,
	// so no manifest can be produced for it.
	_, err := prefill.Admit(ctx, kvcache.Request{ID: "long", Tenant: "victim", PromptTokens: 700_000})
	var ae *kvcache.AdmissionError
	require.ErrorAs(t, err, &ae)
	assert.ErrorIs(t, err, kvcache.ErrExceedsCapacity)
	assert.Equal(t, 700_000, ae.NeedTokens)
	assert.Equal(t, 681_280, ae.LimitTokens)
	require.NoError(t, prefill.Check())

	// The placeholder of the incident: a lease whose prefill wrote one
	// token of many is not prefilled, so it cannot be exported either.
	ph, err := prefill.Admit(ctx, kvcache.Request{ID: "placeholder", Tenant: "victim", PromptTokens: 64})
	require.NoError(t, err)
	require.NoError(t, ph.BeginPrefill())
	require.NoError(t, ph.Commit(1))
	_, err = sender(t).Export(ph, 100)
	assert.ErrorIs(t, err, kvcache.ErrLeasePhase)
	require.NoError(t, ph.Release())

	// Every way a manifest or its pages can be wrong is refused with its
	// own error, and no decode lease becomes usable.
	other := pool(t, testkit.PoolConfig{Pages: 200, Geometry: kvcache.Geometry{TokensPerPage: 16, Layers: 1, KVHeads: 1, HeadDim: 16, DType: kvcache.FP16}})
	// The victim in a shared domain on this prefill pool, in its own on
	// the decode pool.
	shared := pool(t, testkit.PoolConfig{Pages: 200, Tenants: []kvcache.TenantConfig{{Name: "victim", Domain: "org"}, {Name: "other"}}})
	recv := receiver(t, decode)
	inproc := handoff.NewInProcess(recv)
	flipPayload := func(st handoff.Stream, n int, msg []byte) error {
		if n == 2 { // the second data frame
			msg = bytes.Clone(msg)
			msg[len(msg)-7] ^= 0x40
		}
		return st.Send(msg)
	}
	dropLastData := func(st handoff.Stream, n int, msg []byte) error {
		if msg[0] == 'D' && n == 2 { // 130 pages go as 128 + 2: drop the 2
			return nil
		}
		return st.Send(msg)
	}
	var replayed []byte
	cases := []struct {
		name    string
		from    *kvcache.Pool
		sender  *handoff.Sender
		via     handoff.Transport
		prepare func(t *testing.T) func()
		want    error
	}{
		{name: "forged MAC", sender: sender(t, func(c *handoff.SenderConfig) {
			c.Key, _ = handoff.NewKey(bytes.Repeat([]byte("forger"), 6))
		}), want: handoff.ErrBadMAC},
		{name: "other geometry", from: other, want: handoff.ErrGeometryMismatch},
		{name: "truncated transfer", via: &hooked{inner: inproc, send: dropLastData}, want: kvcache.ErrIncompleteTransfer},
		{name: "checksum mismatch", via: &hooked{inner: inproc, send: flipPayload}, want: kvcache.ErrChecksumMismatch},
		{name: "expired", sender: sender(t, func(c *handoff.SenderConfig) {
			c.Now = func() time.Time { return time.Now().Add(-time.Hour) }
			c.ReclaimAfter = 2 * time.Hour
		}), want: handoff.ErrExpired},
		{name: "replay", via: &hooked{inner: inproc, send: func(st handoff.Stream, n int, msg []byte) error {
			if n == 0 {
				msg = replayed
			}
			return st.Send(msg)
		}}, prepare: func(t *testing.T) func() {
			l, err := testkit.Prefill(prefill, "replayed", "victim", 100)
			require.NoError(t, err)
			exp, err := sender(t).Export(l, 10)
			require.NoError(t, err)
			rec := &hooked{inner: inproc, send: func(st handoff.Stream, n int, msg []byte) error {
				if n == 0 {
					replayed = bytes.Clone(msg)
				}
				return st.Send(msg)
			}}
			require.NoError(t, exp.Send(ctx, rec))
			dl, ok := recv.Take("replayed")
			require.True(t, ok)
			return func() { require.NoError(t, dl.Release()) }
		}, want: handoff.ErrReplay},
		{name: "decode pool full", prepare: func(t *testing.T) func() {
			var hogs []*kvcache.Lease
			for left := (decode.Stats().FreePages - 100) * 16; left > 0; left -= contextWindow {
				l, err := decode.Admit(ctx, kvcache.Request{ID: fmt.Sprint("hog", left), Tenant: "other", PromptTokens: min(left, contextWindow)})
				require.NoError(t, err)
				hogs = append(hogs, l)
			}
			return func() {
				for _, l := range hogs {
					require.NoError(t, l.Release())
				}
			}
		}, want: kvcache.ErrPoolExhausted},
		{name: "another sharing domain", from: shared, want: handoff.ErrDomainMismatch},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			from, s, via := tc.from, tc.sender, tc.via
			if from == nil {
				from = prefill
			}
			if s == nil {
				s = sender(t)
			}
			if via == nil {
				via = inproc
			}
			if tc.prepare != nil {
				defer tc.prepare(t)()
			}
			decodeBefore := decode.Stats()
			id := "req-" + tc.name
			l, err := testkit.Prefill(from, id, "victim", 130*16-5) // 130 pages
			require.NoError(t, err)
			exp, err := s.Export(l, 500)
			require.NoError(t, err)
			err = exp.Send(ctx, via)
			inproc.Wait()
			var re *handoff.RefusedError
			require.ErrorAs(t, err, &re, "got %v", err)
			assert.ErrorIs(t, err, tc.want)
			assert.ErrorIs(t, err, handoff.ErrRefused)
			t.Logf("refused: %v", err)

			assertNoImport(t, recv, decode, id)
			after := decode.Stats()
			assert.Equal(t, decodeBefore.InUsePages, after.InUsePages, "decode pages still held")
			assert.Equal(t, decodeBefore.LiveLeases, after.LiveLeases)
			// Refused, the export stays pinned for a retry until aborted.
			assert.True(t, exp.Live())
			require.NoError(t, exp.Abort())
			assert.False(t, exp.Live())
			require.NoError(t, from.Check())
		})
	}
	sweep(t, prefill, decode, other, shared)
}

// TestSGLang30233Boundary: a limit of 284,928 tokens and prompts of the
// limit, one over, and nine over (284,937, the prompt of that report).
func TestSGLang30233Boundary(t *testing.T) {
	const limit = 284_928 // 17,808 pages of 16
	ctx := context.Background()
	for _, kind := range []string{"pool capacity", "max context"} {
		t.Run(kind, func(t *testing.T) {
			var prefill *kvcache.Pool
			want := kvcache.ErrExceedsCapacity
			if kind == "pool capacity" {
				prefill = pool(t, testkit.PoolConfig{Pages: limit / 16, MaxContext: contextWindow, Undersized: true})
			} else {
				prefill = pool(t, testkit.PoolConfig{Pages: limit/16 + 100, MaxContext: limit})
				want = kvcache.ErrExceedsMaxContext
			}
			decode := pool(t, testkit.PoolConfig{Pages: limit/16 + 1000})
			recv := receiver(t, decode)
			for _, prompt := range []int{limit, limit + 1, limit + 9} {
				id := fmt.Sprint("p", prompt)
				l, err := testkit.Prefill(prefill, id, "victim", prompt)
				if prompt > limit {
					assert.ErrorIs(t, err, want, "prompt of %d tokens", prompt)
					assert.Nil(t, l)
					require.NoError(t, prefill.Check())
					assertNoImport(t, recv, decode, id)
					continue
				}
				require.NoError(t, err)
				exp, err := sender(t).Export(l, 0)
				require.NoError(t, err)
				require.NoError(t, exp.Send(ctx, handoff.NewInProcess(recv)))
				dl, ok := recv.Take(id)
				require.True(t, ok)
				assert.Equal(t, prompt, dl.PromptTokens())
				assert.Equal(t, prompt, dl.Written())
				assert.Equal(t, kvcache.PhasePrefilled, dl.Phase())
				require.NoError(t, testkit.VerifyContent(decode, dl, id))
				assert.False(t, l.Live(), "prefill pages still pinned after the ack")
				require.NoError(t, dl.Release())
			}
			sweep(t, prefill, decode)
		})
	}
}

// TestFaults breaks the transfer at every point; pages on both sides end
// released and scrubbed.
func TestFaults(t *testing.T) {
	ctx := context.Background()
	type env struct {
		recv *handoff.Receiver
		in   *handoff.InProcess
	}
	cases := []struct {
		name string
		via  func(e env) handoff.Transport
		// imported: whether the decode side legitimately completed.
		imported bool
	}{
		{name: "connection dropped mid-transfer", via: func(e env) handoff.Transport {
			return &hooked{inner: e.in, send: func(st handoff.Stream, n int, msg []byte) error {
				if n == 3 {
					st.Close()
				}
				return st.Send(msg)
			}}
		}},
		{name: "receiver gone", via: func(e env) handoff.Transport {
			return &hooked{inner: e.in, recv: func(st handoff.Stream, n int) ([]byte, error) {
				st.Close() // the receiver vanished before its first verdict
				return st.Recv()
			}}
		}},
		{name: "receiver gone mid-transfer", via: func(e env) handoff.Transport {
			return &hooked{inner: e.in, send: func(st handoff.Stream, n int, msg []byte) error {
				if n == 5 {
					st.Close()
					return fmt.Errorf("%w: peer reset", handoff.ErrTransport)
				}
				return st.Send(msg)
			}}
		}},
		{name: "sender gone before the end", via: func(e env) handoff.Transport {
			return &hooked{inner: e.in, send: func(st handoff.Stream, n int, msg []byte) error {
				if msg[0] == 'S' {
					st.Close() // died after the pages, before sealing them
					return fmt.Errorf("%w: sender died", handoff.ErrTransport)
				}
				return st.Send(msg)
			}}
		}},
		{name: "sender gone before ack", imported: true, via: func(e env) handoff.Transport {
			return &hooked{inner: e.in, recv: func(st handoff.Stream, n int) ([]byte, error) {
				if n == 1 {
					e.in.Wait() // the receiver finishes; the sender never reads the ack
					st.Close()
					return nil, fmt.Errorf("%w: sender died", handoff.ErrTransport)
				}
				return st.Recv()
			}}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			prefill := pool(t, testkit.PoolConfig{Pages: 512})
			decode := pool(t, testkit.PoolConfig{Pages: 1024})
			recv := receiver(t, decode)
			e := env{recv: recv, in: handoff.NewInProcess(recv)}
			s := sender(t, func(c *handoff.SenderConfig) { c.ReclaimAfter = 150 * time.Millisecond; c.FrameBytes = 16 << 10 })
			l, err := testkit.Prefill(prefill, "r", "victim", 300*16)
			require.NoError(t, err)
			exp, err := s.Export(l, 100)
			require.NoError(t, err)
			err = exp.Send(ctx, tc.via(e))
			require.Error(t, err)
			assert.ErrorIs(t, err, handoff.ErrTransport)
			e.in.Wait()
			require.NoError(t, prefill.Check())
			require.NoError(t, decode.Check())

			dl, ok := recv.Take("r")
			assert.Equal(t, tc.imported, ok)
			if ok { // complete and verified: the decode engine may use it
				require.NoError(t, testkit.VerifyContent(decode, dl, "r"))
				require.NoError(t, dl.Release())
			}
			// The sender never got its ack: the pages stay pinned until
			// the reclaim deadline, then go through the scrubber.
			require.Eventually(t, func() bool { return !exp.Live() }, 5*time.Second, 5*time.Millisecond)
			assert.Equal(t, kvcache.PhaseAborted, l.Phase())
			sweep(t, prefill, decode)
		})
	}
}

// TestConcurrentDuplicate: the same manifest on two streams at once is
// imported once.
func TestConcurrentDuplicate(t *testing.T) {
	prefill := pool(t, testkit.PoolConfig{Pages: 256})
	decode := pool(t, testkit.PoolConfig{Pages: 1024})
	recv := receiver(t, decode)
	inproc := handoff.NewInProcess(recv)
	l, err := testkit.Prefill(prefill, "dup", "victim", 200*16)
	require.NoError(t, err)
	exp, err := sender(t).Export(l, 0)
	require.NoError(t, err)
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range errs {
		wg.Go(func() { errs[i] = exp.Send(context.Background(), inproc) })
	}
	wg.Wait()
	inproc.Wait()
	ok := 0
	for _, err := range errs {
		if err == nil {
			ok++
		} else if !errors.Is(err, handoff.ErrReplay) && !errors.Is(err, kvcache.ErrReclaimed) {
			t.Errorf("second transfer failed with %v, want a replay refusal", err)
		}
	}
	assert.Equal(t, 1, ok)
	dl, found := recv.Take("dup")
	require.True(t, found)
	require.NoError(t, dl.Release())
	sweep(t, prefill, decode)
}

func ExampleExport_Send() {
	ctx := context.Background()
	prefill, _ := testkit.NewPool(testkit.PoolConfig{Pages: 64, Tenants: []kvcache.TenantConfig{{Name: "acme"}}})
	decode, _ := testkit.NewPool(testkit.PoolConfig{Pages: 128, Tenants: []kvcache.TenantConfig{{Name: "acme"}}})
	defer prefill.Close()
	defer decode.Close()
	key, _ := handoff.NewKey(testkit.Secret)
	s, _ := handoff.NewSender(handoff.SenderConfig{Key: key})
	r, _ := handoff.NewReceiver(handoff.ReceiverConfig{Pool: decode, Key: key})

	// Prefill: admit, write the prompt's KV, mark it prefilled.
	lease, _ := testkit.Prefill(prefill, "req-1", "acme", 100)
	exp, err := s.Export(lease, 50)
	fmt.Println("export:", exp.Manifest().Units(), "pages", err)
	fmt.Println("send:", exp.Send(ctx, handoff.NewInProcess(r)))

	dl, _ := r.Take("req-1")
	fmt.Println("decode lease:", dl.Phase(), dl.Written(), "tokens written,", dl.CapacityTokens(), "slots")
	fmt.Println("prefill pages pinned:", lease.Live())

	// A replay of the same request is refused.
	fmt.Println("again:", errors.Is(exp.Send(ctx, handoff.NewInProcess(r)), handoff.ErrReplay))
	// Output:
	// export: 7 pages <nil>
	// send: <nil>
	// decode lease: prefilled 100 tokens written, 160 slots
	// prefill pages pinned: false
	// again: true
}

// TestTransferEnds: a transfer's checksum comes either sealed after the
// pages (what Export.Send sends) or in the manifest (ManifestBytes' form,
// which a transport's transfer may carry too, ended by a plain end
// frame). Each must end the way its manifest says, with a seal that
// verifies and belongs to it; anything else is refused and leaves no
// decode lease.
func TestTransferEnds(t *testing.T) {
	ctx := context.Background()
	prefill := pool(t, testkit.PoolConfig{Pages: 512})
	decode := pool(t, testkit.PoolConfig{Pages: 1024})
	recv := receiver(t, decode)
	inproc := handoff.NewInProcess(recv)

	// A seal from another, completed transfer.
	var otherSeal []byte
	l, err := testkit.Prefill(prefill, "other", "victim", 40*16)
	require.NoError(t, err)
	exp, err := sender(t).Export(l, 10)
	require.NoError(t, err)
	require.NoError(t, exp.Send(ctx, &hooked{inner: inproc, send: func(st handoff.Stream, n int, msg []byte) error {
		if msg[0] == 'S' {
			otherSeal = bytes.Clone(msg)
		}
		return st.Send(msg)
	}}))
	dl, ok := recv.Take("other")
	require.True(t, ok)
	require.NoError(t, dl.Release())
	require.Len(t, otherSeal, 1+16+4+4+32)

	endFrame := func(seal []byte) []byte { return append([]byte{'E'}, seal[1:21]...) }
	cases := []struct {
		name string
		// rewrite replaces a message the sender sends; full is the
		// export's manifest with the checksum in it, 'M'-prefixed.
		rewrite func(msg, full []byte) []byte
		want    error // nil: imported
	}{
		{"sealed", nil, nil},
		{"checksum in the manifest, end frame", func(msg, full []byte) []byte {
			switch msg[0] {
			case 'M':
				return full
			case 'S':
				return endFrame(msg)
			}
			return msg
		}, nil},
		{"forged seal", func(msg, _ []byte) []byte {
			if msg[0] == 'S' {
				msg = bytes.Clone(msg)
				msg[len(msg)-1] ^= 1
			}
			return msg
		}, handoff.ErrBadMAC},
		{"sealed checksum changed", func(msg, _ []byte) []byte {
			if msg[0] == 'S' {
				msg = bytes.Clone(msg)
				msg[21] ^= 1 // the checksum, under the MAC
			}
			return msg
		}, handoff.ErrBadMAC},
		{"seal of another transfer", func(msg, _ []byte) []byte {
			if msg[0] == 'S' {
				return otherSeal
			}
			return msg
		}, handoff.ErrProtocol},
		{"end frame instead of a seal", func(msg, _ []byte) []byte {
			if msg[0] == 'S' {
				return endFrame(msg)
			}
			return msg
		}, handoff.ErrProtocol},
		{"seal after a manifest with the checksum", func(msg, full []byte) []byte {
			if msg[0] == 'M' {
				return full
			}
			return msg
		}, handoff.ErrProtocol},
		{"seal cut short", func(msg, _ []byte) []byte {
			if msg[0] == 'S' {
				return msg[:len(msg)-1]
			}
			return msg
		}, handoff.ErrProtocol},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			id := "req-" + tc.name
			l, err := testkit.Prefill(prefill, id, "victim", 50*16-3)
			require.NoError(t, err)
			exp, err := sender(t).Export(l, 10)
			require.NoError(t, err)
			assert.True(t, exp.Manifest().ChecksumSealed)
			full, err := exp.ManifestBytes()
			require.NoError(t, err)
			full = append([]byte{'M'}, full...)
			via := handoff.Transport(inproc)
			if tc.rewrite != nil {
				via = &hooked{inner: inproc, send: func(st handoff.Stream, n int, msg []byte) error {
					return st.Send(tc.rewrite(msg, full))
				}}
			}
			err = exp.Send(ctx, via)
			inproc.Wait()
			if tc.want == nil {
				require.NoError(t, err)
				dl, ok := recv.Take(id)
				require.True(t, ok)
				require.NoError(t, testkit.VerifyContent(decode, dl, id))
				require.NoError(t, dl.Release())
				assert.False(t, exp.Live(), "acked pages still pinned")
			} else {
				var re *handoff.RefusedError
				require.ErrorAs(t, err, &re, "got %v", err)
				assert.ErrorIs(t, err, tc.want)
				t.Logf("refused: %v", err)
				assertNoImport(t, recv, decode, id)
				require.NoError(t, exp.Abort())
			}
			require.NoError(t, prefill.Check())
			require.NoError(t, decode.Check())
		})
	}
	sweep(t, prefill, decode)
}
