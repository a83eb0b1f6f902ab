package handoff

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvfence/kvfence/kvcache"
)

// ReceiverConfig configures the decode side.
type ReceiverConfig struct {
	// Pool is the decode pool imports are admitted into. Required.
	Pool *kvcache.Pool
	// Key is the HMAC key shared with the prefill pools. Required.
	Key *Key
	// MaxTTL refuses manifests that expire further ahead than this (a
	// sender clock far off, or a manifest minted to be replayed for long);
	// 0 means 5 minutes. It also bounds how long imported request IDs are
	// remembered for replay detection.
	MaxTTL time.Duration
	// AdmitWait is how long an import waits for decode pages to free up;
	// 0 refuses at once when the decode pool is full.
	AdmitWait time.Duration
	// TransferTimeout aborts an import whose pages have not all arrived
	// in this time, so a stalled sender cannot hold decode pages (the
	// import fails with kvcache.ErrIncompleteTransfer); 0 means 2 minutes.
	// On an InterruptibleEndpoint (every transport of this module's) Serve
	// then stops waiting for the sender at once, so the sender holds
	// neither its goroutine nor its request ID any longer either.
	TransferTimeout time.Duration
	// Deliver receives each verified, usable lease (prefilled, written =
	// prompt tokens). Nil keeps them for Take.
	Deliver func(*kvcache.Lease)
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// Logger, if set, gets one record per refused or failed import, with
	// its reason and the error's numbers. Imports that succeed are not
	// logged.
	Logger *slog.Logger
}

// Receiver imports transfers into a decode pool. It is safe for
// concurrent use: a transport calls Serve once per transfer.
type Receiver struct {
	cfg ReceiverConfig

	mu struct {
		sync.Mutex
		claims  map[string]claim // request ID → import in progress or done
		pruneAt int
		ready   map[string]*kvcache.Lease // imported, waiting for Take
		stats   ReceiverStats
	}
}

type claim struct {
	done    bool
	expires time.Time
}

// ReceiverStats counts a receiver's transfers.
type ReceiverStats struct {
	Imported uint64
	Refused  uint64 // refused or failed imports, all reasons
	// RefusedBy counts Refused by reason, indexed like ReasonNames.
	RefusedBy [len(ReasonNames)]uint64
	// UnitsResummed counts units summed again from memory before a
	// verdict because a block of theirs was summed before all of it had
	// landed (LandingWatcher; kvcache.PageLoan.Resum). It stays near zero
	// where the transport lands bytes in address order; one that grows
	// says the watch costs a second read instead of saving the first.
	UnitsResummed uint64
}

// NewReceiver checks cfg and returns a receiver.
func NewReceiver(cfg ReceiverConfig) (*Receiver, error) {
	switch {
	case cfg.Pool == nil:
		return nil, fmt.Errorf("%w: receiver without a pool", ErrInvalidConfig)
	case cfg.Key == nil:
		return nil, fmt.Errorf("%w: receiver without a key", ErrInvalidConfig)
	case cfg.MaxTTL < 0 || cfg.AdmitWait < 0 || cfg.TransferTimeout < 0:
		return nil, fmt.Errorf("%w: negative duration", ErrInvalidConfig)
	}
	if cfg.MaxTTL == 0 {
		cfg.MaxTTL = 5 * time.Minute
	}
	if cfg.TransferTimeout == 0 {
		cfg.TransferTimeout = 2 * time.Minute
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	r := &Receiver{cfg: cfg}
	r.mu.claims = make(map[string]claim)
	r.mu.ready = make(map[string]*kvcache.Lease)
	r.mu.pruneAt = 64
	return r, nil
}

// errNilReceiver is what the methods of a nil *Receiver return: the
// caller went on with the result of a NewReceiver that failed.
var errNilReceiver = fmt.Errorf("%w: nil Receiver (NewReceiver failed?)", ErrInvalidArgument)

// Take returns the imported lease of a request, once, if Deliver is nil.
// A nil receiver holds none.
func (r *Receiver) Take(requestID string) (*kvcache.Lease, bool) {
	if r == nil {
		return nil, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	l, ok := r.mu.ready[requestID]
	delete(r.mu.ready, requestID)
	return l, ok
}

// Stats returns running totals (zero for a nil receiver).
func (r *Receiver) Stats() ReceiverStats {
	if r == nil {
		return ReceiverStats{}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.mu.stats
}

// Serve runs one transfer on ep: verify the manifest, admit the import
// fail-closed, receive and write the pages, verify them, and only then
// deliver the lease. Every failure aborts the import through the
// scrubber, is reported to the sender when the transport still works,
// and is returned. A nil receiver, context or endpoint is
// ErrInvalidArgument before anything is read: no transfer was refused.
func (r *Receiver) Serve(ctx context.Context, ep Endpoint) error {
	switch {
	case r == nil:
		return errNilReceiver
	case ctx == nil:
		return fmt.Errorf("%w: Serve with a nil context", ErrInvalidArgument)
	case ep == nil:
		return fmt.Errorf("%w: Serve on a nil endpoint", ErrInvalidArgument)
	}
	err := r.serve(ctx, ep)
	if err != nil {
		r.refused(err)
	}
	return err
}

// refused counts and logs an import that did not become a lease.
func (r *Receiver) refused(err error) {
	code := failureCode(err)
	r.mu.Lock()
	r.mu.stats.Refused++
	r.mu.stats.RefusedBy[code]++
	r.mu.Unlock()
	if r.cfg.Logger != nil {
		r.cfg.Logger.LogAttrs(context.Background(), slog.LevelWarn, "handoff: import refused",
			slog.String("reason", ReasonNames[code]), slog.Any("error", err))
	}
}

func (r *Receiver) serve(ctx context.Context, ep Endpoint) error {
	msg, err := ep.Recv()
	if err != nil {
		return fmt.Errorf("%w: before the manifest: %w", ErrTransport, err)
	}
	m, err := r.check(msg)
	if err != nil {
		r.reply(ep, stageManifest, err)
		return err
	}
	in, err := r.admit(ctx, &m)
	if err != nil {
		r.unclaim(m.RequestID)
		r.reply(ep, stageManifest, err)
		return err
	}
	var timedOut atomic.Bool
	fired := make(chan struct{})
	watchdog := time.AfterFunc(r.cfg.TransferTimeout, func() {
		defer close(fired)
		timedOut.Store(true)
		// A sender that sends nothing more would otherwise keep this
		// goroutine, its connection and the request ID's claim until the
		// transport's own deadline, if it has one. The wait ends before
		// the abort: an import whose units are lent to the transport
		// (MemoryEndpoint) is pinned until the receive returns the loan,
		// and the abort waits for its pins.
		if ie, ok := ep.(InterruptibleEndpoint); ok {
			ie.InterruptRecv()
		}
		in.Abort()
	})
	lease, err := r.receive(ep, &m, in, &timedOut)
	if !watchdog.Stop() {
		<-fired // the endpoint is the transport's again once Serve returns
	}
	if err != nil {
		if timedOut.Load() {
			// What failed found the import ended (ErrStaleTransfer), or
			// the wait for the next frame ended: say why.
			err = fmt.Errorf("%w: request %q: its pages did not all arrive within the transfer timeout of %v: %w",
				kvcache.ErrIncompleteTransfer, m.RequestID, r.cfg.TransferTimeout, err)
		}
		in.Abort()
		r.unclaim(m.RequestID)
		r.reply(ep, stageImport, err)
		return err
	}
	r.deliver(&m, lease)
	// The import is complete whether or not this verdict arrives: a sender
	// that misses it reclaims its pages at its deadline.
	r.reply(ep, stageImport, nil)
	return nil
}

// check authenticates and vets a manifest, then claims its request ID.
func (r *Receiver) check(msg []byte) (Manifest, error) {
	if len(msg) == 0 || msg[0] != msgManifest {
		return Manifest{}, fmt.Errorf("%w: first message is kind %q, want a manifest", ErrProtocol, firstByte(msg))
	}
	return r.vet(msg[1:])
}

// vet authenticates and vets an encoded manifest (no message kind byte),
// then claims its request ID.
func (r *Receiver) vet(b []byte) (Manifest, error) {
	m, err := Decode(b, r.cfg.Key)
	if err != nil {
		return Manifest{}, err
	}
	now := r.cfg.Now()
	switch {
	case !now.Before(m.Expires):
		return Manifest{}, fmt.Errorf("%w: request %q expired %v ago", ErrExpired, m.RequestID, now.Sub(m.Expires))
	case m.Expires.Sub(now) > r.cfg.MaxTTL:
		return Manifest{}, fmt.Errorf("%w: request %q expires in %v, more than the %v accepted",
			ErrExpired, m.RequestID, m.Expires.Sub(now), r.cfg.MaxTTL)
	}
	here := r.cfg.Pool.Spec()
	if d := SpecDifference(m.Spec, here); d != "" {
		return Manifest{}, fmt.Errorf("%w: request %q: %s", ErrGeometryMismatch, m.RequestID, d)
	}
	if d := ShardDifference(m.Spec, here); d != "" {
		return Manifest{}, fmt.Errorf("%w: request %q: %s", ErrShardMismatch, m.RequestID, d)
	}
	return m, r.claim(m.RequestID, m.Expires, now)
}

func (r *Receiver) claim(id string, expires, now time.Time) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c, ok := r.mu.claims[id]; ok {
		if c.done {
			return fmt.Errorf("%w: request %q has been imported", ErrReplay, id)
		}
		return fmt.Errorf("%w: request %q", ErrInProgress, id)
	}
	if len(r.mu.claims) >= r.mu.pruneAt {
		// An expired manifest is refused before its ID is looked up, so
		// IDs whose manifests have expired need not be remembered.
		for k, c := range r.mu.claims {
			if c.done && now.After(c.expires) {
				delete(r.mu.claims, k)
			}
		}
		r.mu.pruneAt = 2*len(r.mu.claims) + 64
	}
	r.mu.claims[id] = claim{expires: expires}
	return nil
}

func (r *Receiver) unclaim(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.mu.claims[id].done {
		delete(r.mu.claims, id)
	}
}

func (r *Receiver) admit(ctx context.Context, m *Manifest) (*kvcache.Incoming, error) {
	req := kvcache.Request{ID: m.RequestID, Tenant: m.Tenant, PromptTokens: m.PromptTokens, MaxNewTokens: m.MaxNewTokens}
	// The pool refuses the import unless the tenant is in the manifest's
	// domain here when the admission is decided (ErrDomainMismatch).
	if r.cfg.AdmitWait == 0 {
		return r.cfg.Pool.TryBeginImport(req, m.Domain, m.Checksum)
	}
	admitCtx, cancel := context.WithTimeout(ctx, r.cfg.AdmitWait)
	defer cancel()
	return r.cfg.Pool.BeginImport(admitCtx, req, m.Domain, m.Checksum)
}

// receive runs the transfer of m into in once the manifest is admitted.
// timedOut is set when the watchdog has aborted in and interrupted ep.
//
// Units arrive in order: whole ones in data frames, a unit larger than a
// message in part frames, one after the other from offset 0. next is the
// next unit expected and nextOff, while a unit arrives in parts, the
// next part's offset in it.
func (r *Receiver) receive(ep Endpoint, m *Manifest, in *kvcache.Incoming, timedOut *atomic.Bool) (*kvcache.Lease, error) {
	if me, ok := ep.(MemoryEndpoint); ok {
		if lease, remote, err := r.receiveRemote(me, m, in, timedOut); remote {
			return lease, err
		}
	}
	if err := r.reply(ep, stageManifest, nil); err != nil {
		return nil, err
	}
	units := m.Units()
	split, _ := ep.(PartsEndpoint)
	held, _ := ep.(HoldingEndpoint)
	var (
		msg       messageParts
		one       [1][]byte
		unitParts [2][][]byte // a write in flight holds one; the next frame parses into the other
		turn      int
		wantGens  []byte
		// On a HoldingEndpoint each data frame is written on a goroutine
		// while the next one is read: the write in flight, whose error
		// comes back at the next wait, and cur, the release of the held
		// message being parsed until it is handed to a write. Neither
		// outlives the receive.
		write overlappedWrite
		cur   func()
	)
	defer func() {
		write.wait()
		if cur != nil {
			cur()
		}
	}()
	// start writes a frame's bytes, on the overlapped goroutine when the
	// endpoint holds messages.
	start := func(w func() error) error {
		if err := write.wait(); err != nil {
			return err
		}
		if cur == nil {
			return w()
		}
		release := cur
		cur = nil
		write.start(func() error {
			defer release()
			return w()
		})
		turn ^= 1
		return nil
	}
	next, nextOff := 0, int64(0)
	for {
		if cur != nil {
			cur()
			cur = nil
		}
		var err error
		switch {
		case held != nil:
			var parts [][]byte
			parts, cur, err = held.RecvHeld()
			msg.reset(parts)
		case split != nil:
			var parts [][]byte
			parts, err = split.RecvParts()
			msg.reset(parts)
		default:
			one[0], err = ep.Recv()
			msg.reset(one[:])
		}
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%w: request %q: stream ended after %d of %d units without an end frame",
				kvcache.ErrIncompleteTransfer, m.RequestID, next, units)
		}
		if err != nil && timedOut.Load() {
			// The watchdog ended the wait (InterruptRecv), or the
			// transport's own deadline came after it: the transport did
			// not fail, the sender was too slow. Its error is only text
			// here: a wrapped ErrTransport would take the reason code.
			return nil, fmt.Errorf("%w: request %q: no frame awaited any more after %d of %d units (%v)",
				kvcache.ErrIncompleteTransfer, m.RequestID, next, units, err)
		}
		if err != nil {
			return nil, fmt.Errorf("%w: request %q after %d of %d units: %w", ErrTransport, m.RequestID, next, units, err)
		}
		switch msg.kind() {
		case msgData:
			f, err := parseData(&msg, unitParts[turn])
			if err != nil {
				return nil, err
			}
			unitParts[turn] = f.units
			switch {
			case f.id != m.TransferID:
				return nil, fmt.Errorf("%w: data frame of transfer %x in transfer %x", ErrProtocol, f.id, m.TransferID)
			case nextOff != 0 || f.first != next || f.n > units-next:
				return nil, fmt.Errorf("%w: units [%d, %d) after %d of %d (%d bytes into unit %d)", ErrProtocol, f.first, f.first+f.n, next, units, nextOff, next)
			}
			var want int64
			for u := f.first; u < f.first+f.n; u++ {
				want += in.UnitBytes(u)
			}
			if int64(msg.len-dataFixed-4*f.n) != want {
				return nil, fmt.Errorf("%w: %d bytes for units [%d, %d), which are %d", ErrProtocol, msg.len-dataFixed-4*f.n, f.first, f.first+f.n, want)
			}
			wantGens = wantGens[:0]
			for _, g := range m.Generations[f.first : f.first+f.n] {
				wantGens = binary.LittleEndian.AppendUint32(wantGens, g)
			}
			if !bytes.Equal(f.gens, wantGens) {
				return nil, fmt.Errorf("%w: units [%d, %d) carry generations the manifest does not name", ErrProtocol, f.first, f.first+f.n)
			}
			if err := start(func() error { return in.WriteUnitsFrom(f.first, f.units) }); err != nil {
				return nil, err
			}
			next += f.n
		case msgPart:
			f, err := parsePart(&msg, unitParts[turn])
			if err != nil {
				return nil, err
			}
			unitParts[turn] = f.bytes
			ub := in.UnitBytes(f.unit)
			switch {
			case f.id != m.TransferID:
				return nil, fmt.Errorf("%w: part frame of transfer %x in transfer %x", ErrProtocol, f.id, m.TransferID)
			case f.unit != next || next >= units || f.off != nextOff || f.n > ub-f.off:
				return nil, fmt.Errorf("%w: %d bytes at offset %d of unit %d after %d of %d units (%d bytes into unit %d)",
					ErrProtocol, f.n, f.off, f.unit, next, units, nextOff, next)
			case f.off+f.n < ub && f.n%kvcache.UnitRangeAlign != 0:
				return nil, fmt.Errorf("%w: a part of %d bytes of unit %d, not its last: parts are multiples of %d bytes",
					ErrProtocol, f.n, f.unit, kvcache.UnitRangeAlign)
			case f.gen != m.Generations[f.unit]:
				return nil, fmt.Errorf("%w: a part of unit %d carries generation %d, the manifest names %d", ErrProtocol, f.unit, f.gen, m.Generations[f.unit])
			}
			if err := start(func() error { return in.WriteUnitRangeFrom(f.unit, f.off, f.bytes) }); err != nil {
				return nil, err
			}
			if nextOff += f.n; nextOff == ub {
				next, nextOff = next+1, 0
			}
		case msgEnd:
			if err := write.wait(); err != nil {
				return nil, err
			}
			if m.ChecksumSealed {
				return nil, fmt.Errorf("%w: end frame in transfer %x, whose checksum must follow in a seal", ErrProtocol, m.TransferID)
			}
			if msg.len != endLen || !bytes.Equal(msg.head(endLen)[1:17], m.TransferID[:]) {
				return nil, fmt.Errorf("%w: end frame of %d bytes for another transfer", ErrProtocol, msg.len)
			}
			return in.Complete()
		case msgSeal:
			if err := write.wait(); err != nil {
				return nil, err
			}
			if !m.ChecksumSealed {
				return nil, fmt.Errorf("%w: seal in transfer %x, whose manifest carries its checksum", ErrProtocol, m.TransferID)
			}
			if msg.len != sealLen {
				return nil, fmt.Errorf("%w: seal of %d bytes", ErrProtocol, msg.len)
			}
			sum, err := parseSeal(msg.head(sealLen), r.cfg.Key, m.TransferID, units)
			if err != nil {
				return nil, err
			}
			return in.CompleteWithChecksum(sum)
		default:
			return nil, fmt.Errorf("%w: message kind %q during a transfer", ErrProtocol, msg.kind())
		}
	}
}

// overlappedWrite is the one data frame write a receive has in flight on
// a goroutine of its own (HoldingEndpoint).
type overlappedWrite struct {
	done chan error
	busy bool
}

// start runs write on a goroutine; the caller has waited for the last.
func (w *overlappedWrite) start(write func() error) {
	if w.done == nil {
		w.done = make(chan error, 1)
	}
	w.busy = true
	go func() { w.done <- write() }()
}

// wait returns the error of the write in flight, once it has ended; nil
// if there is none.
func (w *overlappedWrite) wait() error {
	if !w.busy {
		return nil
	}
	w.busy = false
	return <-w.done
}

func (r *Receiver) deliver(m *Manifest, l *kvcache.Lease) {
	r.mu.Lock()
	r.mu.claims[m.RequestID] = claim{done: true, expires: m.Expires}
	r.mu.stats.Imported++
	if r.cfg.Deliver == nil {
		r.mu.ready[m.RequestID] = l
	}
	r.mu.Unlock()
	if r.cfg.Deliver != nil {
		r.cfg.Deliver(l)
	}
}

func (r *Receiver) reply(ep Endpoint, stage uint8, err error) error {
	var buf [3 + maxVerdict]byte
	if serr := ep.Send(appendVerdict(buf[:0], stage, err)); serr != nil {
		return fmt.Errorf("%w: verdict: %w", ErrTransport, serr)
	}
	return nil
}
