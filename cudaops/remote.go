package cudaops

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Remote fill executor: tensor parallelism with one process per rank, as
// vLLM and SGLang run it. The scheduler process owns admission (a pool
// over RemoteRanks); each worker process holds its GPU's shard of every
// region, scrubs it on its own stream ordered after its own kernels, and
// reports. Pages return to the free list only after every rank reported
// its fill complete; a rank that fails, disconnects (a crashed worker) or
// does not report within the deadline fails the fill, so the pool retires
// the pages and faults rather than free them.
//
// # Protocol
//
// One connection per rank (any net.Conn: a Unix socket, TCP), frames of
// [u32 length][u8 kind][payload], little-endian:
//
//	hello  rank → scheduler  u32 version, u32 rank, u32 regions, per region u64 pages, u64 page bytes
//	fill   scheduler → rank  u64 seq, u32 word, u32 salt, u32 clear, u32 n, n × u32 page
//	read   scheduler → rank  u64 seq, u32 region, u32 page
//	write  scheduler → rank  u64 seq, u32 region, u32 page, page bytes
//	done   rank → scheduler  u64 seq, u32 error length, error text, then (read) the page's bytes
//
// A rank answers every fill, read and write with one done of its seq:
// fills once its device's fence has completed (in order of arrival), reads
// and writes at once (they follow the fills already launched). An empty
// error text is success.
const remoteVersion = 1

const (
	frameHello byte = 1 + iota
	frameFill
	frameRead
	frameWrite
	frameDone
)

// maxFrame bounds a frame: a batch of 16 M pages, or a page of 64 MiB.
const maxFrame = 64 << 20

func writeFrame(w io.Writer, kind byte, payload []byte) error {
	hdr := make([]byte, 5, 5+len(payload))
	binary.LittleEndian.PutUint32(hdr, uint32(len(payload)+1))
	hdr[4] = kind
	_, err := w.Write(append(hdr, payload...))
	return err
}

func readFrame(r io.Reader) (byte, []byte, error) {
	var hdr [5]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, nil, err
	}
	n := binary.LittleEndian.Uint32(hdr[:])
	if n == 0 || n > maxFrame {
		return 0, nil, fmt.Errorf("%w: frame of %d bytes", ErrInvalidArgument, n)
	}
	b := make([]byte, n-1)
	if _, err := io.ReadFull(r, b); err != nil {
		return 0, nil, err
	}
	return hdr[4], b, nil
}

// RemoteConfig configures RemoteRanks.
type RemoteConfig struct {
	// Ranks is the tensor-parallel degree: how many workers must connect.
	Ranks int
	// ReportTimeout bounds how long a fill (or a page copy) waits for a
	// rank's report before the rank is declared lost; 0 means 30 s.
	ReportTimeout time.Duration
	// AcceptTimeout bounds the wait for every rank's hello; 0 means 60 s.
	AcceptTimeout time.Duration
}

// RemoteRanks is the scheduler's Device over the ranks of a
// tensor-parallel group, each in its own process (RankWorker). Its
// regions are the group's view, as Group's: region r's page is the ranks'
// shards side by side, rank 0 first; Base is 0. Orderings are the ranks'
// own (each orders its fill after its own kernels when it launches it), so
// Fill ignores after. A lost rank fails every fill in flight and every
// later call: the pool faults, and the group must be rebuilt.
type RemoteRanks struct {
	ranks   []*remoteRank
	regions []Region
	timeout time.Duration
	mu      sync.Mutex
	seq     uint64
	closed  bool

	fillCalls, pagesFilled, bytesFilled uint64 // under mu
}

var _ Device = (*RemoteRanks)(nil)

type remoteRank struct {
	rank    int
	conn    net.Conn
	regions []Region // this rank's shards
	wmu     sync.Mutex
	mu      sync.Mutex
	pending map[uint64]chan remoteReply
	lost    error
}

type remoteReply struct {
	err  error
	data []byte
}

// ListenRanks accepts cfg.Ranks workers on l, checks that every rank in
// [0, Ranks) said hello once with the same region shape, and returns the
// device. It does not close l.
func ListenRanks(l net.Listener, cfg RemoteConfig) (*RemoteRanks, error) {
	if cfg.Ranks <= 0 {
		return nil, fmt.Errorf("%w: %d ranks", ErrInvalidArgument, cfg.Ranks)
	}
	if cfg.ReportTimeout <= 0 {
		cfg.ReportTimeout = 30 * time.Second
	}
	if cfg.AcceptTimeout <= 0 {
		cfg.AcceptTimeout = 60 * time.Second
	}
	d := &RemoteRanks{ranks: make([]*remoteRank, cfg.Ranks), timeout: cfg.ReportTimeout}
	deadline := time.Now().Add(cfg.AcceptTimeout)
	fail := func(err error) (*RemoteRanks, error) {
		for _, r := range d.ranks {
			if r != nil {
				r.conn.Close()
			}
		}
		return nil, err
	}
	for got := 0; got < cfg.Ranks; got++ {
		if dl, ok := l.(interface{ SetDeadline(time.Time) error }); ok {
			_ = dl.SetDeadline(deadline)
		}
		conn, err := l.Accept()
		if err != nil {
			return fail(fmt.Errorf("%w: accepting rank %d of %d: %w", ErrNoDevice, got, cfg.Ranks, err))
		}
		_ = conn.SetReadDeadline(deadline)
		r, err := readHello(conn)
		if err == nil && (r.rank >= cfg.Ranks || d.ranks[r.rank] != nil) {
			err = fmt.Errorf("%w: hello from rank %d, expecting ranks [0, %d) once each", ErrInvalidArgument, r.rank, cfg.Ranks)
		}
		if err != nil {
			conn.Close()
			return fail(err)
		}
		_ = conn.SetReadDeadline(time.Time{})
		d.ranks[r.rank] = r
	}
	for _, r := range d.ranks {
		if len(r.regions) != len(d.ranks[0].regions) {
			return fail(fmt.Errorf("%w: rank %d has %d regions, rank 0 %d", ErrInvalidArgument, r.rank, len(r.regions), len(d.ranks[0].regions)))
		}
	}
	d.regions = make([]Region, len(d.ranks[0].regions))
	for i := range d.regions {
		d.regions[i].Pages = d.ranks[0].regions[i].Pages
		for _, r := range d.ranks {
			d.regions[i].PageBytes += r.regions[i].PageBytes
			d.regions[i].Pages = min(d.regions[i].Pages, r.regions[i].Pages)
		}
		d.regions[i].Stride = d.regions[i].PageBytes
	}
	for _, r := range d.ranks {
		go r.readLoop()
	}
	return d, nil
}

func readHello(conn net.Conn) (*remoteRank, error) {
	kind, b, err := readFrame(conn)
	if err != nil {
		return nil, fmt.Errorf("%w: reading a rank's hello: %w", ErrDriver, err)
	}
	if kind != frameHello || len(b) < 12 {
		return nil, fmt.Errorf("%w: expected a hello, got frame %d of %d bytes", ErrInvalidArgument, kind, len(b))
	}
	if v := binary.LittleEndian.Uint32(b); v != remoteVersion {
		return nil, fmt.Errorf("%w: rank speaks protocol %d, scheduler %d", ErrInvalidArgument, v, remoteVersion)
	}
	r := &remoteRank{rank: int(binary.LittleEndian.Uint32(b[4:])), conn: conn, pending: map[uint64]chan remoteReply{}}
	n := int(binary.LittleEndian.Uint32(b[8:]))
	if len(b) != 12+16*n || n == 0 {
		return nil, fmt.Errorf("%w: hello of rank %d with %d regions in %d bytes", ErrInvalidArgument, r.rank, n, len(b))
	}
	for i := range n {
		e := b[12+16*i:]
		reg := Region{Pages: int(binary.LittleEndian.Uint64(e)), PageBytes: int64(binary.LittleEndian.Uint64(e[8:]))}
		reg.Stride = reg.PageBytes
		if err := reg.Validate(); err != nil {
			return nil, fmt.Errorf("rank %d region %d: %w", r.rank, i, err)
		}
		r.regions = append(r.regions, reg)
	}
	return r, nil
}

// readLoop dispatches the rank's reports; when the connection ends, the
// rank is lost and everything waiting on it fails.
func (r *remoteRank) readLoop() {
	br := bufio.NewReader(r.conn)
	for {
		kind, b, err := readFrame(br)
		if err == nil && (kind != frameDone || len(b) < 12) {
			err = fmt.Errorf("%w: unexpected frame %d of %d bytes", ErrInvalidArgument, kind, len(b))
		}
		if err != nil {
			r.lose(fmt.Errorf("%w: rank %d lost: %w", ErrDriver, r.rank, err))
			return
		}
		seq := binary.LittleEndian.Uint64(b)
		n := int(binary.LittleEndian.Uint32(b[8:]))
		if 12+n > len(b) {
			r.lose(fmt.Errorf("%w: rank %d sent a report of %d bytes with %d of error text", ErrDriver, r.rank, len(b), n))
			return
		}
		var rep remoteReply
		if n > 0 {
			rep.err = fmt.Errorf("%w: rank %d: %s", ErrDriver, r.rank, b[12:12+n])
		}
		rep.data = b[12+n:]
		r.mu.Lock()
		ch := r.pending[seq]
		delete(r.pending, seq)
		r.mu.Unlock()
		if ch != nil {
			ch <- rep
		}
	}
}

// lose marks the rank lost with err and fails what waits on it.
func (r *remoteRank) lose(err error) {
	r.mu.Lock()
	if r.lost == nil {
		r.lost = err
	}
	pending := r.pending
	r.pending = map[uint64]chan remoteReply{}
	r.mu.Unlock()
	r.conn.Close()
	for _, ch := range pending {
		ch <- remoteReply{err: err}
	}
}

// send registers seq and writes one frame; the reply arrives on the
// returned channel (buffered: a late reply never blocks the reader).
func (r *remoteRank) send(seq uint64, kind byte, payload []byte) <-chan remoteReply {
	ch := make(chan remoteReply, 1)
	r.mu.Lock()
	if r.lost != nil {
		err := r.lost
		r.mu.Unlock()
		ch <- remoteReply{err: err}
		return ch
	}
	r.pending[seq] = ch
	r.mu.Unlock()
	r.wmu.Lock()
	err := writeFrame(r.conn, kind, payload)
	r.wmu.Unlock()
	if err != nil {
		r.lose(fmt.Errorf("%w: rank %d lost: %w", ErrDriver, r.rank, err))
	}
	return ch
}

// await waits for one reply, declaring the rank lost once expired is
// closed. One deadline covers every rank of a fill, so it is a channel
// that stays closed: a timer's fires once, for the first rank lost only.
func (r *remoteRank) await(ch <-chan remoteReply, expired <-chan struct{}, what string) remoteReply {
	select {
	case rep := <-ch:
		return rep
	case <-expired:
		r.lose(fmt.Errorf("%w: rank %d did not report %s in time", ErrDriver, r.rank, what))
		return <-ch
	}
}

// Name implements Device.
func (d *RemoteRanks) Name() string { return fmt.Sprintf("remote[%d ranks]", len(d.ranks)) }

// AllocRegion implements Device: the ranks own their memory, so it fails.
func (d *RemoteRanks) AllocRegion(int, int64) (int, error) {
	return 0, fmt.Errorf("%w: a remote group's regions are the ranks' own (RankWorker)", ErrInvalidArgument)
}

// Regions implements Device.
func (d *RemoteRanks) Regions() []Region { return append([]Region(nil), d.regions...) }

func (d *RemoteRanks) nextSeq() (uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return 0, ErrClosed
	}
	d.seq++
	return d.seq, nil
}

// Fill implements Device: it hands the batch to every rank and returns a
// fence that completes when all of them have reported it complete. after
// is ignored: each rank orders its fill after its own kernels.
func (d *RemoteRanks) Fill(pages []int32, spec FillSpec, _ Ordering) (Fence, error) {
	if err := CheckPages(d.regions, pages); err != nil {
		return nil, err
	}
	seq, err := d.nextSeq()
	if err != nil {
		return nil, err
	}
	if len(pages) == 0 {
		return Completed(nil), nil
	}
	b := make([]byte, 24+4*len(pages))
	binary.LittleEndian.PutUint64(b, seq)
	binary.LittleEndian.PutUint32(b[8:], spec.Word)
	binary.LittleEndian.PutUint32(b[12:], spec.PageSalt)
	binary.LittleEndian.PutUint32(b[16:], spec.ClearMask)
	binary.LittleEndian.PutUint32(b[20:], uint32(len(pages)))
	for i, p := range pages {
		binary.LittleEndian.PutUint32(b[24+4*i:], uint32(p))
	}
	f := newChanFence()
	replies := make([]<-chan remoteReply, len(d.ranks))
	for i, r := range d.ranks {
		replies[i] = r.send(seq, frameFill, b)
	}
	go func() {
		// One goroutine per fill in flight, parked on channels: no OS
		// thread, no CPU.
		deadline, cancel := context.WithTimeout(context.Background(), d.timeout)
		defer cancel()
		var first error
		for i, r := range d.ranks {
			if rep := r.await(replies[i], deadline.Done(), fmt.Sprintf("fill %d", seq)); rep.err != nil && first == nil {
				first = rep.err
			}
		}
		f.err = first
		close(f.finished)
	}()
	d.mu.Lock()
	d.fillCalls++
	d.pagesFilled += uint64(len(pages))
	for _, r := range d.regions {
		d.bytesFilled += uint64(r.PageBytes) * uint64(len(pages))
	}
	d.mu.Unlock()
	return f, nil
}

// pageOp runs one read or write of page p of region r on every rank.
func (d *RemoteRanks) pageOp(kind byte, r int, p int32, buf []byte) error {
	if r < 0 || r >= len(d.regions) {
		return fmt.Errorf("%w: region %d of %d", ErrInvalidArgument, r, len(d.regions))
	}
	if p < 0 || int(p) >= d.regions[r].Pages {
		return fmt.Errorf("%w: page %d outside [0, %d)", ErrInvalidArgument, p, d.regions[r].Pages)
	}
	if int64(len(buf)) != d.regions[r].PageBytes {
		return fmt.Errorf("%w: buffer of %d bytes for a page of %d", ErrInvalidArgument, len(buf), d.regions[r].PageBytes)
	}
	seq, err := d.nextSeq()
	if err != nil {
		return err
	}
	deadline, cancel := context.WithTimeout(context.Background(), d.timeout)
	defer cancel()
	off := 0
	for _, rk := range d.ranks {
		n := int(rk.regions[r].PageBytes)
		msg := make([]byte, 16, 16+n)
		binary.LittleEndian.PutUint64(msg, seq)
		binary.LittleEndian.PutUint32(msg[8:], uint32(r))
		binary.LittleEndian.PutUint32(msg[12:], uint32(p))
		if kind == frameWrite {
			msg = append(msg, buf[off:off+n]...)
		}
		rep := rk.await(rk.send(seq, kind, msg), deadline.Done(), fmt.Sprintf("page %d of region %d", p, r))
		if rep.err != nil {
			return rep.err
		}
		if kind == frameRead {
			if len(rep.data) != n {
				return fmt.Errorf("%w: rank %d sent %d bytes of a %d-byte shard", ErrDriver, rk.rank, len(rep.data), n)
			}
			copy(buf[off:], rep.data)
		}
		off += n
	}
	return nil
}

// ReadPage implements Device: every rank's shard, rank order.
func (d *RemoteRanks) ReadPage(r int, p int32, dst []byte) error {
	return d.pageOp(frameRead, r, p, dst)
}

// WritePage implements Device: every rank's shard, rank order.
func (d *RemoteRanks) WritePage(r int, p int32, src []byte) error {
	return d.pageOp(frameWrite, r, p, src)
}

// Counters implements Device; Launches counts one per rank per fill.
func (d *RemoteRanks) Counters() Counters {
	d.mu.Lock()
	defer d.mu.Unlock()
	return Counters{FillCalls: d.fillCalls, Launches: d.fillCalls * uint64(len(d.ranks)),
		PagesFilled: d.pagesFilled, BytesFilled: d.bytesFilled}
}

// Close implements Device: it closes every rank's connection (the workers
// see the end of the stream). Fills in flight fail.
func (d *RemoteRanks) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	d.mu.Unlock()
	for _, r := range d.ranks {
		r.lose(fmt.Errorf("%w: remote group closed", ErrClosed))
	}
	return nil
}

// RankWorker is one rank's side of the remote fill executor: it serves a
// scheduler's RemoteRanks over conn with the rank's own device, which
// holds the rank's shard of every region. Batches the scheduler hands over
// are launched by Step, which the engine calls once per step with the
// ordering of its own kernels (its current stream), so the scrub follows
// the rank's work on the pages; or, with AutoStep, as they arrive, with
// the zero ordering. Each batch is reported once its fence has completed.
type RankWorker struct {
	conn net.Conn
	dev  Device
	rank int
	auto atomic.Bool // launch batches as they arrive (SetAutoStep)

	wmu    sync.Mutex
	mu     sync.Mutex
	queued []rankBatch
	// held[i] is the batches that have waited i steps fewer than the
	// step lag (SetStepLag): held[0] launches at the next Step. Guarded by
	// mu.
	held    [][]rankBatch
	ended   bool // reports is closed; guarded by mu
	reports chan rankReport
	done    chan struct{}
	err     error
}

type rankBatch struct {
	seq   uint64
	spec  FillSpec
	pages []int32
}

type rankReport struct {
	seq   uint64
	fence Fence
	err   error
}

// ServeRank says hello as rank with dev's regions and serves the
// scheduler until the connection ends (Wait). With autoStep, batches are
// launched as they arrive, after all prior work of the device.
func ServeRank(conn net.Conn, rank int, dev Device, autoStep bool) (*RankWorker, error) {
	regs := dev.Regions()
	if len(regs) == 0 {
		return nil, fmt.Errorf("%w: rank %d's device has no regions", ErrInvalidArgument, rank)
	}
	b := make([]byte, 12+16*len(regs))
	binary.LittleEndian.PutUint32(b, remoteVersion)
	binary.LittleEndian.PutUint32(b[4:], uint32(rank))
	binary.LittleEndian.PutUint32(b[8:], uint32(len(regs)))
	for i, r := range regs {
		binary.LittleEndian.PutUint64(b[12+16*i:], uint64(r.Pages))
		binary.LittleEndian.PutUint64(b[20+16*i:], uint64(r.PageBytes))
	}
	if err := writeFrame(conn, frameHello, b); err != nil {
		return nil, fmt.Errorf("%w: rank %d hello: %w", ErrDriver, rank, err)
	}
	w := &RankWorker{conn: conn, dev: dev, rank: rank, reports: make(chan rankReport, 1024), done: make(chan struct{})}
	w.auto.Store(autoStep)
	go w.reportLoop()
	go w.readLoop()
	return w, nil
}

// Step launches every batch handed over since the last Step, ordered
// after after (the engine's stream or event on this rank's device), and
// returns how many it launched; with a step lag of n (SetStepLag), it
// launches instead the batches handed over before the nth Step before
// this one, and the others wait for their turn. A batch that fails to
// launch is reported failed: the scheduler faults the pool.
func (w *RankWorker) Step(after Ordering) (int, error) {
	w.mu.Lock()
	queued, held := w.queued, slices.Clone(w.held)
	batches := w.advanceLocked()
	w.mu.Unlock()
	if c, ok := w.dev.(OrderingChecker); ok {
		if err := c.CheckOrdering(after); err != nil {
			// Keep the batches where they were, for a Step with a usable
			// ordering.
			w.mu.Lock()
			w.queued, w.held = append(queued, w.queued...), held
			w.mu.Unlock()
			return 0, err
		}
	}
	for _, b := range batches {
		f, err := w.dev.Fill(b.pages, b.spec, after)
		w.mu.Lock()
		if !w.ended {
			w.reports <- rankReport{seq: b.seq, fence: f, err: err}
		}
		w.mu.Unlock()
	}
	return len(batches), nil
}

// advanceLocked moves the batches one step on and returns those to launch
// now: with a step lag (and not launching on arrival) the ones that have
// waited it out, oldest first; otherwise all of them.
func (w *RankWorker) advanceLocked() []rankBatch {
	n := len(w.held)
	if n == 0 || w.auto.Load() {
		var out []rankBatch
		for _, h := range w.held {
			out = append(out, h...)
		}
		clear(w.held)
		out = append(out, w.queued...)
		w.queued = nil
		return out
	}
	out := w.held[0]
	copy(w.held, w.held[1:])
	w.held[n-1], w.queued = w.queued, nil
	return out
}

// SetStepLag makes each batch wait n Steps after the one it arrived before
// (0: none), so that it launches after what the engine queues in those
// steps too. An engine that frees pages while a step that writes them may
// still be on its way to this rank (scheduling one step ahead of the
// results it has processed) sets it to that depth. Batches that wait now
// launch at the next Step.
func (w *RankWorker) SetStepLag(n int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var waiting []rankBatch
	for _, h := range w.held {
		waiting = append(waiting, h...)
	}
	w.held = make([][]rankBatch, n)
	if n > 0 {
		w.held[0] = waiting
	} else {
		w.queued = append(waiting, w.queued...)
	}
}

// Waiting is how many batches have arrived and not been launched yet.
func (w *RankWorker) Waiting() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := len(w.queued)
	for _, h := range w.held {
		n += len(h)
	}
	return n
}

// SetAutoStep switches between launching batches as they arrive, with the
// zero ordering (after all prior work of the device), and leaving them for
// Step. Switched on, it launches what is queued at once. A worker that
// starts with AutoStep and switches it off at its first Step serves the
// batches sent before its engine runs any kernel (the pool's initial
// scrub, which the scheduler waits for) without a Step of its own.
func (w *RankWorker) SetAutoStep(on bool) {
	w.auto.Store(on)
	if on {
		_, _ = w.Step(Ordering{})
	}
}

// Wait blocks until the scheduler closed the connection (or it failed)
// and returns why, nil for an orderly close.
func (w *RankWorker) Wait() error {
	<-w.done
	return w.err
}

func (w *RankWorker) readLoop() {
	defer close(w.done)
	br := bufio.NewReader(w.conn)
	for {
		kind, b, err := readFrame(br)
		if err != nil {
			if !errors.Is(err, io.EOF) {
				w.err = fmt.Errorf("%w: rank %d: %w", ErrDriver, w.rank, err)
			}
			w.endReports()
			return
		}
		switch {
		case kind == frameFill && len(b) >= 24:
			n := int(binary.LittleEndian.Uint32(b[20:]))
			if len(b) != 24+4*n {
				w.reply(binary.LittleEndian.Uint64(b), fmt.Errorf("%w: fill frame of %d bytes for %d pages", ErrInvalidArgument, len(b), n), nil)
				continue
			}
			batch := rankBatch{seq: binary.LittleEndian.Uint64(b), spec: FillSpec{
				Word: binary.LittleEndian.Uint32(b[8:]), PageSalt: binary.LittleEndian.Uint32(b[12:]), ClearMask: binary.LittleEndian.Uint32(b[16:])}}
			for i := range n {
				batch.pages = append(batch.pages, int32(binary.LittleEndian.Uint32(b[24+4*i:])))
			}
			w.mu.Lock()
			w.queued = append(w.queued, batch)
			w.mu.Unlock()
			if w.auto.Load() {
				_, _ = w.Step(Ordering{})
			}
		case (kind == frameRead || kind == frameWrite) && len(b) >= 16:
			seq := binary.LittleEndian.Uint64(b)
			r, p := int(binary.LittleEndian.Uint32(b[8:])), int32(binary.LittleEndian.Uint32(b[12:]))
			if kind == frameWrite {
				w.reply(seq, w.dev.WritePage(r, p, b[16:]), nil)
				continue
			}
			regs := w.dev.Regions()
			if r < 0 || r >= len(regs) {
				w.reply(seq, fmt.Errorf("%w: region %d of %d", ErrInvalidArgument, r, len(regs)), nil)
				continue
			}
			buf := make([]byte, regs[r].PageBytes)
			if err := w.dev.ReadPage(r, p, buf); err != nil {
				w.reply(seq, err, nil)
			} else {
				w.reply(seq, nil, buf)
			}
		default:
			w.err = fmt.Errorf("%w: rank %d got frame %d of %d bytes", ErrInvalidArgument, w.rank, kind, len(b))
			w.endReports()
			w.conn.Close()
			return
		}
	}
}

func (w *RankWorker) endReports() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.ended {
		w.ended = true
		close(w.reports)
	}
}

// reportLoop reports launched batches in order, each once its fence has
// completed.
func (w *RankWorker) reportLoop() {
	for rep := range w.reports {
		err := rep.err
		if err == nil {
			err = rep.fence.Wait()
		}
		w.reply(rep.seq, err, nil)
	}
}

func (w *RankWorker) reply(seq uint64, err error, data []byte) {
	msg := ""
	if err != nil {
		msg = err.Error()
		if msg == "" {
			msg = "error"
		}
	}
	b := make([]byte, 12, 12+len(msg)+len(data))
	binary.LittleEndian.PutUint64(b, seq)
	binary.LittleEndian.PutUint32(b[8:], uint32(len(msg)))
	b = append(append(b, msg...), data...)
	w.wmu.Lock()
	_ = writeFrame(w.conn, frameDone, b)
	w.wmu.Unlock()
}
