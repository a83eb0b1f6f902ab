package handoff

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kvfence/kvfence/kvcache"
)

// SenderConfig configures the prefill side.
type SenderConfig struct {
	// Key is the HMAC key shared with the decode pools. Required.
	Key *Key
	// TTL is how long a manifest stays valid; 0 means 30 s.
	TTL time.Duration
	// ReclaimAfter is how long exported pages stay pinned waiting for the
	// receiver's ack before they are released through the scrubber
	// anyway; 0 means 2×TTL.
	ReclaimAfter time.Duration
	// FrameBytes is the target size of one data message; 0 means 1 MiB.
	// A message always holds whole pages, at least one.
	FrameBytes int
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// Logger, if set, gets one record per Send that fails, with the
	// receiver's reason (or the transport's) and the error's numbers.
	Logger *slog.Logger
}

// Sender exports prefilled leases and streams them to decode pools.
type Sender struct {
	cfg SenderConfig
	mu  struct {
		sync.Mutex
		stats SenderStats
	}
}

// SenderStats counts a sender's transfers: every Send that reached the
// transport, by outcome.
type SenderStats struct {
	Sent   uint64 // the receiver holds a verified lease
	Failed uint64 // refused by the receiver, or the transport failed
	// FailedBy counts Failed by reason, indexed like ReasonNames: the
	// receiver's reason for a refusal, "transport" for a broken stream,
	// the prefill pool's for a failure of its own ("reclaimed", "device").
	FailedBy [len(ReasonNames)]uint64
}

// Stats returns running totals (zero for a nil sender).
func (s *Sender) Stats() SenderStats {
	if s == nil {
		return SenderStats{}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mu.stats
}

// count records the outcome of one Send.
func (s *Sender) count(requestID string, err error) {
	code := failureCode(err)
	s.mu.Lock()
	if err == nil {
		s.mu.stats.Sent++
	} else {
		s.mu.stats.Failed++
		s.mu.stats.FailedBy[code]++
	}
	s.mu.Unlock()
	if err != nil && s.cfg.Logger != nil {
		s.cfg.Logger.LogAttrs(context.Background(), slog.LevelWarn, "handoff: transfer failed",
			slog.String("request_id", requestID), slog.String("reason", ReasonNames[code]), slog.Any("error", err))
	}
}

// NewSender checks cfg and returns a sender.
func NewSender(cfg SenderConfig) (*Sender, error) {
	switch {
	case cfg.Key == nil:
		return nil, fmt.Errorf("%w: sender without a key", ErrInvalidConfig)
	case cfg.TTL < 0 || cfg.ReclaimAfter < 0 || cfg.FrameBytes < 0:
		return nil, fmt.Errorf("%w: negative TTL %v, ReclaimAfter %v or FrameBytes %d", ErrInvalidConfig, cfg.TTL, cfg.ReclaimAfter, cfg.FrameBytes)
	}
	if cfg.TTL == 0 {
		cfg.TTL = 30 * time.Second
	}
	if cfg.ReclaimAfter == 0 {
		cfg.ReclaimAfter = 2 * cfg.TTL
	}
	if cfg.FrameBytes == 0 {
		cfg.FrameBytes = defaultData
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Sender{cfg: cfg}, nil
}

// Export is a prefilled lease pinned for a transfer, with its manifest.
type Export struct {
	s    *Sender
	out  *kvcache.Outgoing
	m    Manifest // as Send sends it: the checksum follows in the seal
	wire []byte   // 'M' + m encoded

	// full is m with the checksum in it, made by ManifestBytes for
	// engines that move the bytes themselves.
	full struct {
		sync.Mutex
		wire []byte
	}
}

// Export pins lease l (which must be prefilled: kvcache.ErrLeasePhase
// otherwise, and nothing changes) and signs its manifest, which names the
// sharing domain the lease was admitted in (kvcache.Lease.Domain), taken
// from the prefill pool's own tenant configuration. maxNewTokens is
// the output budget the decode pool must reserve. The pages stay pinned
// until Send gets the receiver's ack, Abort, or ReclaimAfter passes. Every
// name a lease can have fits a manifest: the pool refuses names that are
// not UTF-8 or too long where they come in.
//
// Export reads no page. Send sums the pages as it reads them to send
// them and seals the sum after the last one (FlagChecksumSealed), so the
// first page leaves at once and each byte leaves the device once;
// ManifestBytes, for engines that move the bytes themselves, reads the
// pages once more to put the checksum in the manifest.
//
// A nil lease, which is all an engine holds after a refused admission, is
// refused with ErrInvalidArgument: the incident's engine exported after a
// refusal, and that must cost the caller an error, not the node a panic.
func (s *Sender) Export(l *kvcache.Lease, maxNewTokens int) (*Export, error) {
	switch {
	case s == nil:
		return nil, fmt.Errorf("%w: Export on a nil Sender (NewSender failed?)", ErrInvalidArgument)
	case l == nil:
		return nil, fmt.Errorf("%w: nil lease: a refused admission has no lease, so nothing to export", ErrInvalidArgument)
	}
	if maxNewTokens < 0 || maxNewTokens > maxTokens {
		return nil, fmt.Errorf("%w: %d max new tokens", kvcache.ErrInvalidRequest, maxNewTokens)
	}
	now := s.cfg.Now()
	out, err := l.Export(now.Add(s.cfg.ReclaimAfter))
	if err != nil {
		return nil, err
	}
	m := Manifest{
		RequestID: out.RequestID(), Tenant: out.Tenant(), Domain: out.Domain(),
		PromptTokens: out.PromptTokens(), MaxNewTokens: maxNewTokens,
		Geometry: PoolFingerprint(out), Expires: now.Add(s.cfg.TTL),
		ChecksumSealed: true, Generations: out.Generations(nil),
	}
	rand.Read(m.TransferID[:])
	wire, err := m.AppendEncode([]byte{msgManifest}, s.cfg.Key)
	if err != nil {
		out.Abort()
		return nil, err
	}
	return &Export{s: s, out: out, m: m, wire: wire}, nil
}

// errNilExport is what the methods of a nil *Export return: the caller
// went on with the result of an Export that failed.
var errNilExport = fmt.Errorf("%w: nil Export (Sender.Export failed?)", ErrInvalidArgument)

// Manifest returns the manifest Send sends: its checksum follows the
// pages, in the transfer's seal (ChecksumSealed). A nil export has the
// zero manifest.
func (e *Export) Manifest() Manifest {
	if e == nil {
		return Manifest{}
	}
	return e.m
}

// Live reports whether the exported pages are still pinned; a nil export
// pins nothing.
func (e *Export) Live() bool { return e != nil && e.out.Live() }

// Abort releases the exported pages through the scrubber now.
func (e *Export) Abort() error {
	if e == nil {
		return errNilExport
	}
	return e.out.Abort()
}

// Send streams the manifest and the pages over t and waits for the
// receiver's verdict. On success the receiver holds a verified, usable
// lease and the exported pages have been released through the scrubber.
// On failure the error says why (a *RefusedError with the receiver's
// reason, ErrTransport, kvcache.ErrReclaimed) and the pages stay pinned
// until Abort or the reclaim deadline, so that the caller may retry.
//
// A nil export, context or transport is ErrInvalidArgument, and nothing is
// sent.
func (e *Export) Send(ctx context.Context, t Transport) error {
	switch {
	case e == nil:
		return errNilExport
	case ctx == nil:
		return fmt.Errorf("%w: Send with a nil context", ErrInvalidArgument)
	case t == nil:
		return fmt.Errorf("%w: Send over a nil transport", ErrInvalidArgument)
	}
	err := e.sendOver(ctx, t)
	e.s.count(e.m.RequestID, err)
	return err
}

func (e *Export) sendOver(ctx context.Context, t Transport) error {
	st, err := t.Open(ctx)
	if err != nil {
		return fmt.Errorf("%w: open: %w", ErrTransport, err)
	}
	defer st.Close()
	if err := e.send(st, e.wire); err != nil {
		return err
	}
	if err := e.verdict(st, stageManifest); err != nil {
		return err
	}
	if err := e.sendPages(st); err != nil {
		return err
	}
	if err := st.CloseSend(); err != nil {
		return fmt.Errorf("%w: close: %w", ErrTransport, err)
	}
	if err := e.verdict(st, stageImport); err != nil {
		return err
	}
	// The receiver holds the KV now. If the deadline reclaimed the pages
	// meanwhile, or the prefill pool closed, they have been scrubbed
	// already: nothing is lost.
	if err := e.out.Ack(); err != nil && !errors.Is(err, kvcache.ErrReclaimed) && !errors.Is(err, kvcache.ErrPoolClosed) {
		return err
	}
	return nil
}

// sendPages sends the pages in data frames, summing each page as it is
// read (while it is in cache), and then the seal with their checksum.
func (e *Export) sendPages(st Stream) error {
	pb := int(e.out.PageBytes())
	n := e.out.Pages()
	per := max(1, min(n, (e.s.cfg.FrameBytes-dataFixed)/(pb+4)))
	sums := make([]uint64, n)
	if vs, ok := st.(ViewStream); ok && e.out.Viewable() {
		if err := e.sendViews(vs, per, sums); err != nil {
			return err
		}
		return e.send(st, appendSeal(nil, e.s.cfg.Key, e.m.TransferID, n, kvcache.ContentChecksum(sums)))
	}
	// Every frame buffer has a full frame's capacity: one size class in
	// the pool per geometry and frame size.
	full := dataFixed + per*(4+pb)
	owning, _ := st.(OwningStream)
	for first := 0; first < n; {
		k := min(per, n-first)
		b := frameBuffers.get(dataFixed+k*(4+pb), full)
		frame := *b
		e.putDataHead(frame, first, k)
		pages := frame[dataFixed+4*k:]
		if err := e.out.ReadPages(first, pages); err != nil {
			frameBuffers.put(b)
			return err
		}
		for i := range k {
			sums[first+i] = kvcache.PageChecksum(pages[i*pb : (i+1)*pb])
		}
		var err error
		if owning != nil {
			err = owning.SendOwned(frame, func() { frameBuffers.put(b) })
		} else {
			err = st.Send(frame)
			frameBuffers.put(b)
		}
		if err := e.check(st, err); err != nil {
			return err
		}
		first += k
	}
	return e.send(st, appendSeal(nil, e.s.cfg.Key, e.m.TransferID, n, kvcache.ContentChecksum(sums)))
}

// putDataHead writes the head of the data frame of pages first …
// first+k-1 (kind, transfer ID, first, k, generations) into frame.
func (e *Export) putDataHead(frame []byte, first, k int) {
	le := binary.LittleEndian
	frame[0] = msgData
	copy(frame[1:17], e.m.TransferID[:])
	le.PutUint32(frame[17:], uint32(first))
	le.PutUint32(frame[21:], uint32(k))
	for i, g := range e.m.Generations[first : first+k] {
		le.PutUint32(frame[dataFixed+4*i:], g)
	}
}

// sendViews sends the data frames of a ViewStream: each frame's pages
// are lent by the pool (PageViews, pinned until the stream is done with
// them) and summed where they lie; nothing is staged.
//
// The sums run one frame ahead of the stream, on a goroutine of their
// own: while the stream writes frame k, frame k+1 is summed. On a
// loopback or a fast NIC the writer is the transfer's critical path (the
// kernel's copy and, on loopback, the receiver's protocol work run in
// its system calls), so summing beside it rather than before it takes
// the checksum off that path; and the stream then reads frame k+1 from
// the cache the sum just filled. A frame's views are not handed to the
// stream until its sum is done, so the stream's done (which unpins the
// pages) always comes after the last read of them.
func (e *Export) sendViews(st ViewStream, per int, sums []uint64) error {
	n := e.out.Pages()
	head := make([]byte, dataFixed+4*per)
	var spare [][]byte // a views slice the stream is done with, for the next frame
	// lend returns the views of the frame of pages first …, in buf.
	lend := func(first int, buf [][]byte) (viewFrame, error) {
		k := min(per, n-first)
		views, done, err := e.out.PageViews(first, k, buf[:0])
		return viewFrame{first: first, k: k, views: views, done: done}, err
	}
	sum := func(f viewFrame) {
		regions := len(f.views) / f.k
		for i := range f.k {
			sums[f.first+i] = kvcache.PageChecksumOf(f.views[i*regions : (i+1)*regions])
		}
	}
	cur, err := lend(0, nil)
	if err != nil {
		return err
	}
	sum(cur)
	summed := make(chan struct{}, 1)
	for {
		var next viewFrame
		if after := cur.first + cur.k; after < n {
			if next, err = lend(after, spare); err != nil {
				cur.done()
				return err
			}
			go func() {
				sum(next)
				summed <- struct{}{}
			}()
		}
		h := head[:dataFixed+4*cur.k]
		e.putDataHead(h, cur.first, cur.k)
		err := e.check(st, st.SendViews(h, cur.views, cur.done))
		if next.k == 0 {
			return err
		}
		<-summed
		if err != nil {
			next.done()
			return err
		}
		// SendViews keeps no views slice: cur's is the next frame's.
		spare, cur = cur.views, next
	}
}

// viewFrame is one data frame's pages as sendViews holds them: pages
// first … first+k-1, their views, and the done that unpins them.
type viewFrame struct {
	first, k int
	views    [][]byte
	done     func()
}

// send transmits msg; if the receiver has already ended the transfer,
// its verdict explains why better than the transport's error.
func (e *Export) send(st Stream, msg []byte) error { return e.check(st, st.Send(msg)) }

// check turns a failed send into the receiver's verdict when there is one.
func (e *Export) check(st Stream, err error) error {
	if err == nil {
		return nil
	}
	if reply, rerr := st.Recv(); rerr == nil {
		if v := parseVerdict(reply, firstStage(reply)); v != nil {
			return v
		}
	}
	return fmt.Errorf("%w: send: %w", ErrTransport, err)
}

func firstStage(msg []byte) uint8 {
	if len(msg) < 2 {
		return 0
	}
	return msg[1]
}

func (e *Export) verdict(st Stream, stage uint8) error {
	reply, err := st.Recv()
	if err != nil {
		return fmt.Errorf("%w: waiting for the receiver's verdict: %w", ErrTransport, err)
	}
	return parseVerdict(reply, stage)
}
