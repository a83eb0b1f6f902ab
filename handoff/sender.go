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
	// A message holds whole units (pages, slots) of one cache group, as
	// many as fit and at least one; a unit that does not fit (a state
	// slot) is sent in parts, each the largest multiple of
	// kvcache.UnitRangeAlign that fits, when FrameBytes has room for one
	// (MinFrameBytes), and whole otherwise. A transport bounds its
	// messages (tcpx.Options.MaxMessageBytes): keep FrameBytes below that
	// bound, and parts keep every unit, however large, within it.
	FrameBytes int
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// Logger, if set, gets one record per Send that fails, with the
	// receiver's reason (or the transport's) and the error's numbers.
	Logger *slog.Logger
}

// MinFrameBytes is the least SenderConfig.FrameBytes that sends units
// too large for a message in parts: a part frame's head and one unit
// range of kvcache.UnitRangeAlign bytes.
const MinFrameBytes = partFixed + kvcache.UnitRangeAlign

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
		Spec: wireSpec(out.Spec()), Extents: wireExtents(out.Extents()), Expires: now.Add(s.cfg.TTL),
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
	grant, err := e.accepted(st)
	if err != nil {
		return err
	}
	if grant != nil {
		err = e.sendRemote(st, grant)
	} else {
		err = e.sendUnits(st)
	}
	if err != nil {
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

// wireExtents is es as a manifest carries them: without the groups'
// names, which the receiver takes from its own spec.
func wireExtents(es []kvcache.HandoffExtent) []kvcache.HandoffExtent {
	for i := range es {
		es[i].Group = ""
	}
	return es
}

// frame is one data message of a transfer: n whole units from unit
// first, or (part) bytes [off, off+bytes) of unit first.
type frame struct {
	first, n   int
	part       bool
	off, bytes int64
}

// frames plans the data messages of the export: per group, runs of as
// many whole units as fit in FrameBytes (at least one), or each unit in
// parts of the largest multiple of kvcache.UnitRangeAlign that fits.
func (e *Export) frames() []frame {
	var fs []frame
	u := 0
	fb := int64(e.s.cfg.FrameBytes)
	for _, ext := range e.out.Extents() {
		ub := ext.UnitBytes
		if per := max((fb-dataFixed)/(ub+4), 0); per >= 1 || fb < MinFrameBytes {
			per = max(per, 1)
			for j := 0; j < ext.Units; j += int(per) {
				fs = append(fs, frame{first: u + j, n: min(int(per), ext.Units-j), bytes: int64(min(int(per), ext.Units-j)) * ub})
			}
		} else {
			chunk := (fb - partFixed) / kvcache.UnitRangeAlign * kvcache.UnitRangeAlign
			for j := range ext.Units {
				for off := int64(0); off < ub; off += chunk {
					fs = append(fs, frame{first: u + j, n: 1, part: true, off: off, bytes: min(chunk, ub-off)})
				}
			}
		}
		u += ext.Units
	}
	return fs
}

// sendUnits sends the units in data frames, summing each unit as it is
// read (while it is in cache), and then the seal with their checksum.
func (e *Export) sendUnits(st Stream) error {
	n := e.out.Units()
	sums := make([]uint64, n)
	fs := e.frames()
	if vs, ok := st.(ViewStream); ok && e.out.Viewable() {
		if err := e.sendViews(vs, fs, sums); err != nil {
			return err
		}
		return e.send(st, appendSeal(nil, e.s.cfg.Key, e.m.TransferID, n, kvcache.ContentChecksum(sums)))
	}
	// Every frame buffer has a full frame's capacity: one size class in
	// the pool per geometry and frame size.
	full := 0
	for _, f := range fs {
		full = max(full, f.headLen()+int(f.bytes))
	}
	owning, _ := st.(OwningStream)
	var part kvcache.UnitSummer
	for _, f := range fs {
		h := f.headLen()
		b := frameBuffers.get(h+int(f.bytes), full)
		buf := *b
		e.putHead(buf, f)
		payload := buf[h:]
		var err error
		if f.part {
			err = e.out.ReadUnitRange(f.first, f.off, payload)
		} else {
			err = e.out.ReadUnits(f.first, payload)
		}
		if err != nil {
			frameBuffers.put(b)
			return err
		}
		e.sum(f, sums, &part, func(yield func(u int, b [][]byte)) {
			at := 0
			for u := f.first; u < f.first+f.n; u++ {
				ub := int(f.bytes)
				if !f.part {
					ub = int(e.out.UnitBytes(u))
				}
				yield(u, [][]byte{payload[at : at+ub]})
				at += ub
			}
		})
		if owning != nil {
			err = owning.SendOwned(buf, func() { frameBuffers.put(b) })
		} else {
			err = st.Send(buf)
			frameBuffers.put(b)
		}
		if err := e.check(st, err); err != nil {
			return err
		}
	}
	return e.send(st, appendSeal(nil, e.s.cfg.Key, e.m.TransferID, n, kvcache.ContentChecksum(sums)))
}

// sum records the checksums of frame f's units, whose bytes each(yield)
// hands over unit by unit: a whole unit's checksum, or a part added to
// part, whose checksum is the unit's once its last part is in.
func (e *Export) sum(f frame, sums []uint64, part *kvcache.UnitSummer, each func(yield func(u int, b [][]byte))) {
	each(func(u int, b [][]byte) {
		if !f.part {
			sums[u] = kvcache.PageChecksumOf(b)
			return
		}
		part.AddParts(b)
		if f.off+f.bytes == e.out.UnitBytes(u) {
			sums[u] = part.Sum()
		}
	})
}

// headLen is the length of f's message head.
func (f frame) headLen() int {
	if f.part {
		return partFixed
	}
	return dataFixed + 4*f.n
}

// putHead writes the head of frame f (kind, transfer ID, where its bytes
// go, their generations) into buf.
func (e *Export) putHead(buf []byte, f frame) {
	le := binary.LittleEndian
	copy(buf[1:17], e.m.TransferID[:])
	if f.part {
		buf[0] = msgPart
		le.PutUint32(buf[17:], uint32(f.first))
		le.PutUint64(buf[21:], uint64(f.off))
		le.PutUint32(buf[29:], e.m.Generations[f.first])
		return
	}
	buf[0] = msgData
	le.PutUint32(buf[17:], uint32(f.first))
	le.PutUint32(buf[21:], uint32(f.n))
	for i, g := range e.m.Generations[f.first : f.first+f.n] {
		le.PutUint32(buf[dataFixed+4*i:], g)
	}
}

// sendViews sends the data frames of a ViewStream: each frame's units
// (or part of one) are lent by the pool (UnitViews, UnitRangeViews:
// pinned until the stream is done with them) and summed where they lie;
// nothing is staged.
//
// The sums run one frame ahead of the stream, on a goroutine of their
// own: while the stream writes frame k, frame k+1 is summed. On a
// loopback or a fast NIC the writer is the transfer's critical path (the
// kernel's copy and, on loopback, the receiver's protocol work run in
// its system calls), so summing beside it rather than before it takes
// the checksum off that path; and the stream then reads frame k+1 from
// the cache the sum just filled. A frame's views are not handed to the
// stream until its sum is done, so the stream's done (which unpins the
// units) always comes after the last read of them; and frames are summed
// in order, so a unit's parts are.
func (e *Export) sendViews(st ViewStream, fs []frame, sums []uint64) error {
	head := make([]byte, partFixed+dataFixed+4*maxUnitsPerFrame(fs))
	var spare [][]byte // a views slice the stream is done with, for the next frame
	var part kvcache.UnitSummer
	// lend returns the views of frame i, in buf.
	lend := func(i int, buf [][]byte) (viewFrame, error) {
		f := fs[i]
		var views [][]byte
		var done func()
		var err error
		if f.part {
			views, done, err = e.out.UnitRangeViews(f.first, f.off, f.bytes, buf[:0])
		} else {
			views, done, err = e.out.UnitViews(f.first, f.n, buf[:0])
		}
		return viewFrame{i: i, views: views, done: done}, err
	}
	sum := func(v viewFrame) {
		f := fs[v.i]
		e.sum(f, sums, &part, func(yield func(u int, b [][]byte)) {
			if f.part {
				yield(f.first, v.views)
				return
			}
			regions := len(v.views) / f.n // the frame's units are of one group
			for k := range f.n {
				yield(f.first+k, v.views[k*regions:(k+1)*regions])
			}
		})
	}
	cur, err := lend(0, nil)
	if err != nil {
		return err
	}
	sum(cur)
	summed := make(chan struct{}, 1)
	for {
		var next viewFrame
		more := cur.i+1 < len(fs)
		if more {
			if next, err = lend(cur.i+1, spare); err != nil {
				cur.done()
				return err
			}
			go func() {
				sum(next)
				summed <- struct{}{}
			}()
		}
		f := fs[cur.i]
		h := head[:f.headLen()]
		e.putHead(h, f)
		err := e.check(st, st.SendViews(h, cur.views, cur.done))
		if !more {
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

// maxUnitsPerFrame is the most whole units a frame of fs carries.
func maxUnitsPerFrame(fs []frame) int {
	n := 0
	for _, f := range fs {
		if !f.part {
			n = max(n, f.n)
		}
	}
	return n
}

// viewFrame is one data frame as sendViews holds it: frame i of the
// plan, its views, and the done that unpins them.
type viewFrame struct {
	i     int
	views [][]byte
	done  func()
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
