package handoff_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// scriptedEndpoint is a receiver's end of a transfer whose sender's
// messages are given: the manifest, then msgs, each cut into parts at its
// cut (a PartsEndpoint hands a message over in the buffers it arrived
// in), then the end of the stream. Verdicts are kept.
type scriptedEndpoint struct {
	manifest []byte
	msgs     [][]byte
	cuts     []int
	next     int
	verdicts [][]byte
}

func (e *scriptedEndpoint) Recv() ([]byte, error) {
	if e.manifest != nil {
		m := e.manifest
		e.manifest = nil
		return m, nil
	}
	if e.next == len(e.msgs) {
		return nil, io.EOF
	}
	e.next++
	return e.msgs[e.next-1], nil
}

func (e *scriptedEndpoint) RecvParts() ([][]byte, error) {
	if e.manifest != nil || e.next == len(e.msgs) {
		m, err := e.Recv()
		return [][]byte{m}, err
	}
	m, cut := e.msgs[e.next], e.cuts[e.next]
	e.next++
	return [][]byte{m[:cut], {}, m[cut:]}, nil
}

func (e *scriptedEndpoint) Send(msg []byte) error {
	e.verdicts = append(e.verdicts, bytes.Clone(msg))
	return nil
}

// plainEndpoint hides RecvParts: the receiver reads whole messages.
type plainEndpoint struct{ *scriptedEndpoint }

// holdingEndpoint is a HoldingEndpoint over a script: each held message
// is a copy of its own, overwritten with 0xAA when released, so that a
// receiver reading a message after its release reads garbage; it counts
// the messages held at once and checks each release comes once.
type holdingEndpoint struct {
	*scriptedEndpoint
	mu                  sync.Mutex
	held, most, badFree int
}

func (e *holdingEndpoint) RecvHeld() ([][]byte, func(), error) {
	parts, err := e.RecvParts()
	if err != nil {
		return nil, nil, err
	}
	msg := bytes.Join(parts, nil)
	e.mu.Lock()
	e.held++
	e.most = max(e.most, e.held)
	e.mu.Unlock()
	var once atomic.Bool
	return [][]byte{msg}, func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		if !once.CompareAndSwap(false, true) {
			e.badFree++
			return
		}
		e.held--
		for i := range msg {
			msg[i] = 0xaa
		}
	}, nil
}

// encodeScript and decodeScript carry a transfer's messages after the
// manifest as fuzz input: per message, its length and where it is cut
// (u16 each), then its bytes; a length past the end takes what is left.
func encodeScript(msgs [][]byte) []byte {
	var b []byte
	for _, m := range msgs {
		b = binary.LittleEndian.AppendUint16(b, uint16(len(m)))
		b = binary.LittleEndian.AppendUint16(b, uint16(len(m)/2))
		b = append(b, m...)
	}
	return b
}

func decodeScript(b []byte) (msgs [][]byte, cuts []int) {
	for len(b) >= 4 {
		n, cut := int(binary.LittleEndian.Uint16(b)), int(binary.LittleEndian.Uint16(b[2:]))
		b = b[4:]
		n = min(n, len(b))
		msgs, cuts = append(msgs, b[:n]), append(cuts, min(cut, n))
		b = b[n:]
	}
	return msgs, cuts
}

// FuzzServe feeds a receiver a genuine signed manifest followed by any
// messages, whole or in parts: Serve never panics; it delivers a lease
// only if that lease holds exactly the prefill's pages; whatever it
// refuses leaves no lease behind, and the decode pool passes Check with
// every page free and holding its canary (no byte of a refused import
// survives), transfer after transfer. mode picks the endpoint: whole
// messages, parts, or held messages (HoldingEndpoint: each data frame is
// written while the next is read), which must all be released, once
// each, with no more than two held at a time.
func FuzzServe(f *testing.F) {
	// One genuine transfer of 3 pages (the last one partly filled), one
	// page per data frame.
	fuzzServe(f, testkit.PoolConfig{Pages: 16}, 3*testkit.Geometry.TokensPerPage-5, 1)
}

// FuzzServeHybrid is FuzzServe of a hybrid model's transfer: every group
// (per-token pages, the window's, the state slot in 4 KiB parts), so
// that part frames, and their order, offsets and generations, are fuzzed
// too.
func FuzzServeHybrid(f *testing.F) {
	fuzzServe(f, testkit.PoolConfig{Spec: testkit.HybridSpec(), Pages: 16, MaxLeases: 2}, 3*16-5, handoff.MinFrameBytes)
}

// fuzzServe is FuzzServe of the transfer of a prompt of prompt tokens
// between pools of c, in frames of frameBytes, recorded.
func fuzzServe(f *testing.F, c testkit.PoolConfig, prompt, frameBytes int) {
	const id = "fuzz"
	c.Tenants = []kvcache.TenantConfig{{Name: "victim"}}
	prefill, err := testkit.NewPool(c)
	if err != nil {
		f.Fatal(err)
	}
	defer prefill.Close()
	decode, err := testkit.NewPool(c)
	if err != nil {
		f.Fatal(err)
	}
	defer decode.Close()
	s, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key(), TTL: time.Hour, FrameBytes: frameBytes})
	if err != nil {
		f.Fatal(err)
	}
	newReceiver := func() *handoff.Receiver {
		r, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: decode, Key: testkit.Key(), MaxTTL: 2 * time.Hour})
		if err != nil {
			f.Fatal(err)
		}
		return r
	}

	l, err := testkit.Prefill(prefill, id, "victim", prompt)
	if err != nil {
		f.Fatal(err)
	}
	exp, err := s.Export(l, 8)
	if err != nil {
		f.Fatal(err)
	}
	var sent [][]byte
	r := newReceiver()
	inproc := handoff.NewInProcess(r)
	if err := exp.Send(context.Background(), &hooked{inner: inproc, send: func(st handoff.Stream, n int, msg []byte) error {
		sent = append(sent, bytes.Clone(msg))
		return st.Send(msg)
	}}); err != nil {
		f.Fatal(err)
	}
	inproc.Wait()
	dl, ok := r.Take(id)
	if !ok {
		f.Fatal("the recorded transfer delivered no lease")
	}
	if err := dl.Release(); err != nil {
		f.Fatal(err)
	}
	manifest, rest := sent[0], sent[1:]
	last := len(rest) - 1
	if manifest[0] != 'M' || last < 3 || rest[last][0] != 'S' {
		f.Fatalf("recorded transfer is not manifest, 3 or more data frames, seal: %d messages", len(sent))
	}
	for _, m := range rest {
		if len(m) > 1<<16-1 {
			f.Fatalf("a recorded message of %d bytes: the script encodes at most 64 KiB", len(m))
		}
	}
	genuine := encodeScript(rest)
	with := func(msgs ...[]byte) []byte { return encodeScript(msgs) }
	for mode := range uint8(3) {
		f.Add(genuine, mode)
		f.Add(encodeScript(rest[:last]), mode) // no seal
		swapped := append([][]byte{}, rest...)
		swapped[1], swapped[2] = swapped[2], swapped[1]
		f.Add(encodeScript(swapped), mode)                                                                         // out of order
		f.Add(encodeScript(append([][]byte{rest[0]}, rest...)), mode)                                              // the first frame twice
		f.Add(with(append(append([][]byte{}, rest[:last]...), append([]byte{'E'}, rest[last][1:21]...))...), mode) // an end frame
		f.Add([]byte{}, mode)
	}

	f.Fuzz(func(t *testing.T, script []byte, mode uint8) {
		msgs, cuts := decodeScript(script)
		se := &scriptedEndpoint{manifest: manifest, msgs: msgs, cuts: cuts}
		var ep handoff.Endpoint
		var holding *holdingEndpoint
		switch mode % 3 {
		case 0:
			ep = plainEndpoint{se}
		case 1:
			ep = se
		case 2:
			holding = &holdingEndpoint{scriptedEndpoint: se}
			ep = holding
		}
		r := newReceiver()
		err := r.Serve(context.Background(), ep)
		if holding != nil {
			holding.mu.Lock()
			held, most, badFree := holding.held, holding.most, holding.badFree
			holding.mu.Unlock()
			if held != 0 || most > 2 || badFree != 0 {
				t.Fatalf("Serve returned (%v) holding %d messages; it held %d at once, released %d twice", err, held, most, badFree)
			}
		}
		checkServed(t, r, decode, id, err, bytes.Equal(script, genuine), se.verdicts)
	})
}

// checkServed checks what a fuzzed Serve of request id, which returned
// err after sending verdicts, left: the genuine transfer imported; a
// lease if and only if Serve succeeded, holding exactly the prefill's
// pages; no yes as the last verdict of a failure; every free page of the
// decode pool holding its canary once the lease is released.
func checkServed(t *testing.T, r *handoff.Receiver, decode *kvcache.Pool, id string, err error, genuine bool, verdicts [][]byte) {
	t.Helper()
	dl, delivered := r.Take(id)
	last := []byte(nil)
	if len(verdicts) > 0 {
		last = verdicts[len(verdicts)-1]
	}
	switch {
	case err != nil && genuine:
		t.Fatalf("Serve refused the recorded transfer: %v", err)
	case err == nil && !delivered:
		t.Fatal("Serve succeeded and delivered nothing")
	case err != nil && delivered:
		t.Fatalf("Serve failed (%v) and delivered a lease", err)
	case err != nil && len(last) > 2 && last[0] == 'V' && last[2] == 0:
		t.Fatalf("Serve failed (%v) with a yes as its last verdict", err)
	}
	if delivered {
		if err := testkit.VerifyContent(decode, dl, id); err != nil {
			t.Fatalf("delivered lease: %v", err)
		}
		if err := dl.Release(); err != nil {
			t.Fatal(err)
		}
	}
	if err := testkit.Sweep(decode); err != nil {
		t.Fatal(err)
	}
}
