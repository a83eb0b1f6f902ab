package handoff

import (
	"bytes"
	"crypto/hmac"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync/atomic"

	"github.com/kvfence/kvfence/kvcache"
)

// This file is the handoff over a transport that writes the units into
// the decode pool's memory itself (remote memory access: RDMA, UCX's
// puts) instead of carrying them in data frames. The protocol around the
// bytes is the same: the manifest, the receiver's admission, the seal
// with the content checksum, the verdicts. What changes is in between:
//
//	receiver → sender  'G' grant: the import's units' memory, as the
//	                   transport exposed it, under the shared key's MAC
//	sender → receiver  'L' landed: units [first, first+n) have been written
//	                   (the transport says so: every write before it has
//	                   completed in the receiver's memory), with their
//	                   generations, as a data frame's head
//	                   … then the seal, as after data frames
//
// The receiver sums each unit where it landed (kvcache.PageLoan.Landed)
// as the landed notes come, or each block of it as soon as it lands
// where the transport writes on this process's own threads
// (LandingWatcher; a unit one of whose blocks was summed before all of
// it had landed is summed again once nothing writes,
// kvcache.PageLoan.Resum), and completes the import against the seal's
// checksum only once the transport has taken the memory back from the
// sender (revoke), so that no write lands after the verdict. A byte is
// summed once, when its unit's note comes or its block lands: a sender
// that wrote it again after that (which breaks the protocol, and takes
// the transfer's key) would leave bytes the seal did not vouch for, in
// its own import's pages and no other's; so would a transport that
// corrupted a byte after it landed. A receiver whose pool or transport
// cannot lend memory (pages on a device that is not host memory,
// ErrNoRemoteMemory) accepts with a plain verdict instead, and the units
// come in data frames.

// MemoryEndpoint is an Endpoint whose transport can let the sender write
// the decode pool's memory directly.
type MemoryEndpoint interface {
	InterruptibleEndpoint
	// ExposeMemory registers mems, host memory of the import's pages, for
	// writes by this transfer's sender alone, and returns the transport's
	// description of them (addresses, remote keys, in mems' order), which
	// the receiver sends inside its grant, signed. revoke must be called
	// exactly once, before the memory is used for anything else: it
	// returns once the sender can no longer write it (the sender has
	// acknowledged, or its connection is gone; after a bound it cuts the
	// connection) and the registration is gone. An error wrapping
	// ErrNoRemoteMemory says the transport cannot expose this memory: the
	// pages then come in data frames.
	ExposeMemory(mems [][]byte) (desc []byte, revoke func(), err error)
}

// LandingWatcher is a MemoryEndpoint whose transport writes the sender's
// bytes into the exposed memory on this process's own threads (UCX's
// emulated puts over shared memory copy them there as the worker
// progresses): the receiver can then sum each block on the thread that
// wrote it, while it is still in that core's cache, instead of reading it
// again from memory when its landed note comes
// (kvcache.PageLoan.Watch).
type LandingWatcher interface {
	MemoryEndpoint
	// LandsHere reports whether the transport writes the memory of its
	// last ExposeMemory on this process's own threads; where a NIC or
	// another process writes it, there is no core's cache to find the
	// bytes in, and the receiver does not watch.
	LandsHere() bool
	// WatchLanding has the transport call scan each time it may have
	// written into the memory of its last ExposeMemory, on the thread
	// that wrote, from one goroutine at a time, until that memory's
	// revoke: once revoke has returned, scan is never called again.
	WatchLanding(scan func())
}

// MemoryStream is a Stream whose transport can write into the receiver's
// memory, as a MemoryEndpoint exposed it.
type MemoryStream interface {
	Stream
	// OpenRemote opens the memory desc describes (the receiver's
	// transport's description, from its grant), whose extents are
	// memBytes long, for writing.
	OpenRemote(desc []byte, memBytes []int64) (RemoteWriter, error)
}

// RemoteWriter writes into a receiver's exposed memory.
type RemoteWriter interface {
	// Write posts the writes of puts and returns wait, which returns once
	// every one of them has landed in the receiver's memory and none
	// reads the sender's memory any more, or the first error: then too
	// only once none reads it. A put that does not fit its extent is
	// refused before anything is posted. Write may be called again before
	// an earlier wait has returned; each wait is called once. Write and
	// Close are called from one goroutine.
	Write(puts []RemotePut) (wait func() error, err error)
	// Close ends the writer; it returns once none of its writes reads the
	// sender's memory any more.
	Close() error
}

// PutSizer is a RemoteWriter that says how many bytes a put should carry,
// at least, for its transport to move them at its pace: one that sends
// each put as a message with a round trip of its own (UCX's rendezvous
// over TCP) moves a model's many small pages, a put per region, at a
// fraction of it. The sender then plans chunks large enough that each
// region's put in them carries that many bytes, where the units allow.
type PutSizer interface {
	MinPutBytes() int64
}

// RemotePut writes Src, the concatenation of its parts, at offset Off of
// the receiver's extent Mem (an index into the grant's extents).
type RemotePut struct {
	Mem int
	Off int64
	Src [][]byte
}

// ErrNoRemoteMemory is what ExposeMemory returns when the transport
// cannot expose the memory (no transport of the fabric writes remote
// memory, or not memory of this kind): the receiver falls back to data
// frames.
var ErrNoRemoteMemory = errors.New("handoff: remote memory access unavailable")

const (
	msgGrant  = 'G'
	msgLanded = 'L'

	grantMagic   = "KVFG" // separates grant MACs from manifest and seal MACs
	grantVersion = 1
	grantFixed   = 1 + 16 + 1 + 2 + 4 // kind, transfer ID, version, lanes, extents
	laneFixed    = 4 + 4 + 4 + 4      // unit bytes, first, units, runs
	runLen       = 4 + 4 + 4 + 8      // first unit, units, extent, offset
	maxGrantDesc = 64 << 20
)

// A grant describes where each unit of the transfer goes. A lane is one
// region of the pools (every group's, in the spec's order): it holds the
// units of that region's group, units first … first+units-1 of the
// transfer (numbered across groups as kvcache.HandoffExtents orders
// them), unit bytes each (the region's page); a run maps a lane's units
// first … first+n-1 to consecutive memory of one extent, from an offset
// on. Units of differing sizes from several region sets are thus lanes
// of differing unit sizes, and a unit is its group's lanes' pieces, in
// order.
//
//	'G' transfer ID[16] version u8 lanes u16 extents u32
//	    extents × (bytes u64)
//	    lanes × (unit bytes u32, first u32, units u32, runs u32,
//	             runs × (first u32, units u32, extent u32, offset u64))
//	    desc length u32, desc (the transport's)
//	    MAC[32] = HMAC-SHA256(key, "KVFG" ‖ every byte between 'G' and the MAC)

type grant struct {
	lanes    []grantLane
	extents  []int64
	desc     []byte
	transfer [16]byte
}

type grantLane struct {
	unitBytes int
	first     int // the lane's first unit
	units     int
	runs      []grantRun
}

type grantRun struct {
	first, n, extent int
	off              int64
}

func appendGrant(dst []byte, key *Key, g *grant) []byte {
	start := len(dst)
	le := binary.LittleEndian
	dst = append(dst, msgGrant)
	dst = append(dst, g.transfer[:]...)
	dst = append(dst, grantVersion)
	dst = le.AppendUint16(dst, uint16(len(g.lanes)))
	dst = le.AppendUint32(dst, uint32(len(g.extents)))
	for _, b := range g.extents {
		dst = le.AppendUint64(dst, uint64(b))
	}
	for _, l := range g.lanes {
		dst = le.AppendUint32(dst, uint32(l.unitBytes))
		dst = le.AppendUint32(dst, uint32(l.first))
		dst = le.AppendUint32(dst, uint32(l.units))
		dst = le.AppendUint32(dst, uint32(len(l.runs)))
		for _, r := range l.runs {
			dst = le.AppendUint32(dst, uint32(r.first))
			dst = le.AppendUint32(dst, uint32(r.n))
			dst = le.AppendUint32(dst, uint32(r.extent))
			dst = le.AppendUint64(dst, uint64(r.off))
		}
	}
	dst = le.AppendUint32(dst, uint32(len(g.desc)))
	dst = append(dst, g.desc...)
	return grantMAC(dst, key, dst[start+1:])
}

func grantMAC(dst []byte, key *Key, signed []byte) []byte {
	msg := make([]byte, 0, len(grantMagic)+len(signed))
	return key.sum(dst, append(append(msg, grantMagic...), signed...))
}

// grantReader reads a grant's fields, failing once past its end.
type grantReader struct {
	b   []byte
	err error
}

func (r *grantReader) take(n int) []byte {
	if r.err != nil || len(r.b) < n {
		r.err = io.ErrUnexpectedEOF
		return make([]byte, n)
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

func (r *grantReader) u16() int { return int(binary.LittleEndian.Uint16(r.take(2))) }
func (r *grantReader) u32() int { return int(binary.LittleEndian.Uint32(r.take(4))) }
func (r *grantReader) u64() uint64 {
	return binary.LittleEndian.Uint64(r.take(8))
}

// parseGrant verifies a grant's MAC under key before it reads a byte of
// it, and that it is for transfer id; its shape is checkGrant's.
func parseGrant(msg []byte, key *Key, id [16]byte) (*grant, error) {
	if len(msg) < grantFixed+4+macLen || msg[0] != msgGrant {
		return nil, fmt.Errorf("%w: grant of %d bytes (kind %q)", ErrProtocol, len(msg), firstByte(msg))
	}
	signed, mac := msg[1:len(msg)-macLen], msg[len(msg)-macLen:]
	var want [macLen]byte
	if !hmac.Equal(mac, grantMAC(want[:0], key, signed)) {
		return nil, fmt.Errorf("%w: the memory grant of transfer %x", ErrBadMAC, id)
	}
	g := &grant{}
	copy(g.transfer[:], signed[:16])
	if g.transfer != id {
		return nil, fmt.Errorf("%w: grant of transfer %x in transfer %x", ErrProtocol, g.transfer, id)
	}
	if signed[16] != grantVersion {
		return nil, fmt.Errorf("%w: grant version %d, want %d", ErrProtocol, signed[16], grantVersion)
	}
	r := grantReader{b: signed[17:]}
	lanes, extents := r.u16(), r.u32()
	if extents > len(r.b)/8 {
		return nil, fmt.Errorf("%w: grant of %d extents in %d bytes", ErrProtocol, extents, len(r.b))
	}
	g.extents = make([]int64, extents)
	for i := range g.extents {
		g.extents[i] = int64(r.u64())
	}
	for range lanes {
		l := grantLane{unitBytes: r.u32(), first: r.u32(), units: r.u32()}
		runs := r.u32()
		if r.err != nil || runs > len(r.b)/runLen {
			return nil, fmt.Errorf("%w: grant lane of %d runs in %d bytes", ErrProtocol, runs, len(r.b))
		}
		l.runs = make([]grantRun, runs)
		for i := range l.runs {
			l.runs[i] = grantRun{first: r.u32(), n: r.u32(), extent: r.u32(), off: int64(r.u64())}
		}
		g.lanes = append(g.lanes, l)
	}
	n := r.u32()
	if r.err != nil || n != len(r.b) || n > maxGrantDesc {
		return nil, fmt.Errorf("%w: grant with a description of %d bytes, %d left", ErrProtocol, n, len(r.b))
	}
	g.desc = r.b
	return g, nil
}

// laneShape is what a lane of a grant must be: the export's region's
// page size, and its group's units.
type laneShape struct{ unitBytes, first, units int }

// exportLanes are the lanes of a transfer of out: one per region of every
// group, in the spec's order.
func exportLanes(spec kvcache.CacheSpec, extents []kvcache.HandoffExtent) []laneShape {
	var lanes []laneShape
	first := 0
	for gi, e := range extents {
		for _, r := range spec.Groups[gi].Regions {
			lanes = append(lanes, laneShape{unitBytes: int(r.PageBytes), first: first, units: e.Units})
		}
		first += e.Units
	}
	return lanes
}

// checkGrant checks that g places every unit the sender has, in every
// lane, exactly once, inside the extents it names, and no two on the
// same bytes. Nothing of a grant that fails it is written.
func checkGrant(g *grant, want []laneShape) error {
	if len(g.lanes) != len(want) {
		return fmt.Errorf("%w: grant of %d lanes for %d regions", ErrProtocol, len(g.lanes), len(want))
	}
	for i, b := range g.extents {
		if b <= 0 {
			return fmt.Errorf("%w: grant extent %d of %d bytes", ErrProtocol, i, b)
		}
	}
	type span struct{ extent, off, end int64 }
	var spans []span
	for k, l := range g.lanes {
		w := want[k]
		if l.unitBytes != w.unitBytes || l.first != w.first || l.units != w.units {
			return fmt.Errorf("%w: grant lane %d of units [%d, %d) of %d bytes, the export's region has [%d, %d) of %d",
				ErrProtocol, k, l.first, l.first+l.units, l.unitBytes, w.first, w.first+w.units, w.unitBytes)
		}
		covered := 0
		runs := slices.Clone(l.runs)
		slices.SortFunc(runs, func(a, b grantRun) int { return a.first - b.first })
		for _, r := range runs {
			if r.first != l.first+covered || r.n <= 0 || r.n > l.units-covered {
				return fmt.Errorf("%w: grant lane %d places units [%d, %d) after %d of its %d", ErrProtocol, k, r.first, r.first+r.n, covered, l.units)
			}
			covered += r.n
			if r.extent < 0 || r.extent >= len(g.extents) {
				return fmt.Errorf("%w: grant lane %d names extent %d of %d", ErrProtocol, k, r.extent, len(g.extents))
			}
			size := int64(r.n) * int64(l.unitBytes)
			if r.off < 0 || r.off > g.extents[r.extent] || size > g.extents[r.extent]-r.off {
				return fmt.Errorf("%w: grant lane %d places %d bytes at %d of extent %d, which has %d", ErrProtocol, k, size, r.off, r.extent, g.extents[r.extent])
			}
			spans = append(spans, span{int64(r.extent), r.off, r.off + size})
		}
		if covered != l.units {
			return fmt.Errorf("%w: grant lane %d places %d of %d units", ErrProtocol, k, covered, l.units)
		}
	}
	slices.SortFunc(spans, func(a, b span) int {
		if a.extent != b.extent {
			return int(a.extent - b.extent)
		}
		return int(a.off - b.off)
	})
	for i := 1; i < len(spans); i++ {
		if spans[i].extent == spans[i-1].extent && spans[i].off < spans[i-1].end {
			return fmt.Errorf("%w: grant places two runs on the same bytes of extent %d", ErrProtocol, spans[i].extent)
		}
	}
	return nil
}

// placement is where each unit of each lane goes: extent and offset,
// from a checked grant, indexed by the unit's place in its lane.
type placement struct {
	lanes  []grantLane
	extent [][]int32 // [lane][unit - lane's first]
	off    [][]int64
}

func placeGrant(g *grant) placement {
	p := placement{lanes: g.lanes}
	for _, l := range g.lanes {
		ext, off := make([]int32, l.units), make([]int64, l.units)
		for _, r := range l.runs {
			for i := range r.n {
				j := r.first - l.first + i
				ext[j], off[j] = int32(r.extent), r.off+int64(i)*int64(l.unitBytes)
			}
		}
		p.extent, p.off = append(p.extent, ext), append(p.off, off)
	}
	return p
}

// accepted reads the receiver's answer to the manifest: nil for a plain
// accept (pages go in data frames), the grant message for an accept that
// lends memory, or the refusal.
func (e *Export) accepted(st Stream) ([]byte, error) {
	reply, err := st.Recv()
	if err != nil {
		return nil, fmt.Errorf("%w: waiting for the receiver's verdict: %w", ErrTransport, err)
	}
	if len(reply) > 0 && reply[0] == msgGrant {
		return slices.Clone(reply), nil
	}
	return nil, parseVerdict(reply, stageManifest)
}

// remoteChunkBytes is about how much one remote write carries: a few
// data frames' worth (a frame's worth is little for a put, and each write
// ends in a round trip, the flush, before its landed note goes out), and
// at least one unit; more where the writer asks for puts of minPut bytes
// at least (PutSizer): minPut for each of the group's regions, whose
// pages a chunk's puts write region by region, up to stagedChunkFrames
// where the units are staged.
func (e *Export) remoteChunkBytes(regions int, minPut int64) int64 {
	b := max(4*int64(e.s.cfg.FrameBytes), int64(regions)*minPut)
	if !e.out.Viewable() {
		b = min(b, stagedChunkFrames*int64(e.s.cfg.FrameBytes))
	}
	return b
}

// stagedChunkFrames bounds, in frames, a chunk whose units are not host
// memory (a GPU's): each is copied into memory of the sender's own before
// it is written, two at a time, and a PutSizer's wish over a model's many
// regions (1 MiB each of glm-5's 156) would otherwise stage hundreds of
// MiB a transfer.
const stagedChunkFrames = 32

// remoteChunk is a chunk of units of one group: units first … first+n-1,
// whose views are regions views per unit, and the done that gives them
// back.
type remoteChunk struct {
	first, n int
	regions  int
	lane     int // the group's first lane
	views    [][]byte
	done     func()
	wait     func() error // the chunk's writes, once posted
}

// maxMinPut bounds what a PutSizer may ask for.
const maxMinPut = 1 << 30

// remoteChunks plans the chunks of the export for a writer that asks for
// puts of minPut bytes at least: per group, runs of as many whole units
// as fit in remoteChunkBytes, at least one (a state slot of hundreds of
// MiB is one chunk: a put has no size limit).
func (e *Export) remoteChunks(minPut int64) []remoteChunk {
	var cs []remoteChunk
	spec := e.out.Spec()
	first, lane := 0, 0
	for gi, ext := range e.out.Extents() {
		regions := len(spec.Groups[gi].Regions)
		per := max(1, int(e.remoteChunkBytes(regions, minPut)/max(ext.UnitBytes, 1)))
		for j := 0; j < ext.Units; j += per {
			cs = append(cs, remoteChunk{first: first + j, n: min(per, ext.Units-j), regions: regions, lane: lane})
		}
		first += ext.Units
		lane += regions
	}
	return cs
}

// sendRemote writes the units into the memory the receiver granted,
// chunk by chunk: each chunk's units are lent by the pool (UnitViews;
// staged through ReadUnits where they are not host memory), summed one
// chunk ahead on goroutines of their own (sumChunk), and written
// with one put per run of units adjacent in the receiver's memory; once a
// chunk's writes have landed, its landed note goes out. Two chunks are in
// flight at a time. Then the seal.
func (e *Export) sendRemote(st Stream, msg []byte) error {
	ms, ok := st.(MemoryStream)
	if !ok {
		return fmt.Errorf("%w: the receiver granted memory on a stream that cannot write it", ErrProtocol)
	}
	g, err := parseGrant(msg, e.s.cfg.Key, e.m.TransferID)
	if err != nil {
		return err
	}
	if err := checkGrant(g, exportLanes(e.out.Spec(), e.out.Extents())); err != nil {
		return err
	}
	place := placeGrant(g)
	w, err := ms.OpenRemote(g.desc, g.extents)
	if err != nil {
		return err
	}
	n := e.out.Units()
	sums := make([]uint64, n)
	var minPut int64
	if ps, ok := w.(PutSizer); ok {
		minPut = min(max(ps.MinPutBytes(), 0), maxMinPut)
	}
	chunks := e.remoteChunks(minPut)
	var inFlight []*remoteChunk
	// settle waits for the oldest chunk's writes and sends its landed note.
	settle := func() error {
		c := inFlight[0]
		inFlight = inFlight[1:]
		err := c.wait()
		c.done()
		if err != nil {
			return err
		}
		return e.send(st, e.appendLanded(nil, c.first, c.n))
	}
	fail := func(err error) error {
		w.Close() // no write reads the units any more…
		for _, c := range inFlight {
			c.done() // …so they may go
		}
		if errors.Is(err, ErrTransport) {
			// The receiver may have ended the transfer (and revoked its
			// memory): its verdict says why.
			return e.check(st, err)
		}
		return err // this side's: the stream's close tells the receiver
	}
	if err := e.lendChunk(&chunks[0]); err != nil {
		w.Close()
		return err
	}
	sumChunk(&chunks[0], sums)
	summed := make(chan struct{}, 1)
	var puts []RemotePut
	for i := range chunks {
		cur := &chunks[i]
		var next *remoteChunk
		if i+1 < len(chunks) {
			next = &chunks[i+1]
			if err := e.lendChunk(next); err != nil {
				cur.done()
				return fail(err)
			}
			go func() {
				sumChunk(next, sums)
				summed <- struct{}{}
			}()
		}
		puts = place.puts(puts[:0], cur)
		cur.wait, err = w.Write(puts)
		if err == nil {
			inFlight = append(inFlight, cur)
			if len(inFlight) > 1 {
				err = settle()
			}
		} else {
			cur.done()
		}
		if next == nil {
			for err == nil && len(inFlight) > 0 {
				err = settle()
			}
			if err != nil {
				return fail(err)
			}
			break
		}
		<-summed
		if err != nil {
			next.done()
			return fail(err)
		}
	}
	if err := w.Close(); err != nil {
		return fail(err)
	}
	return e.send(st, appendSeal(nil, e.s.cfg.Key, e.m.TransferID, n, kvcache.ContentChecksum(sums)))
}

// lendChunk fills in c's views: the pool's memory where it is host
// memory (pinned until c.done), else a copy.
func (e *Export) lendChunk(c *remoteChunk) error {
	if e.out.Viewable() {
		var err error
		c.views, c.done, err = e.out.UnitViews(c.first, c.n, nil)
		return err
	}
	ub := int(e.out.UnitBytes(c.first))
	buf := make([]byte, c.n*ub)
	if err := e.out.ReadUnits(c.first, buf); err != nil {
		return err
	}
	gi := 0
	for u, exts := 0, e.out.Extents(); u+exts[gi].Units <= c.first; gi++ {
		u += exts[gi].Units
	}
	regions := e.out.Spec().Groups[gi].Regions
	c.views = c.views[:0]
	for i := range c.n {
		unit := buf[i*ub : (i+1)*ub]
		for _, r := range regions {
			c.views = append(c.views, unit[:r.PageBytes:r.PageBytes])
			unit = unit[r.PageBytes:]
		}
	}
	c.done = func() {}
	return nil
}

// sumChunk sets the sums of c's units (inSpans: on several goroutines
// where the machine has the cores).
func sumChunk(c *remoteChunk, sums []uint64) {
	var bytes int64
	for _, v := range c.views {
		bytes += int64(len(v))
	}
	inSpans(c.n, bytes, func(lo, hi int) error {
		for i := lo; i < hi; i++ {
			sums[c.first+i] = kvcache.PageChecksumOf(c.views[i*c.regions : (i+1)*c.regions])
		}
		return nil
	})
}

// landedInSpans has loan sum units [first, first+k) of m, which landed,
// in spans (inSpans).
func landedInSpans(loan *kvcache.PageLoan, m *Manifest, first, k int) error {
	var bytes int64
	u := 0
	for _, e := range m.Extents {
		lo, hi := max(first, u), min(first+k, u+e.Units)
		bytes += int64(max(hi-lo, 0)) * e.UnitBytes
		u += e.Units
	}
	return inSpans(k, bytes, func(lo, hi int) error { return loan.Landed(first+lo, hi-lo) })
}

// puts appends to dst the writes of chunk c's units: per lane (region),
// one put per run of units that lie one after the other in the
// receiver's memory.
func (p *placement) puts(dst []RemotePut, c *remoteChunk) []RemotePut {
	for k := range c.regions {
		lane := c.lane + k
		first := p.lanes[lane].first
		ext, off := p.extent[lane], p.off[lane]
		for i := range c.n {
			j := c.first + i - first
			v := c.views[i*c.regions+k]
			if n := len(dst); n > 0 && i > 0 && ext[j] == ext[j-1] && off[j] == off[j-1]+int64(len(v)) {
				dst[n-1].Src = append(dst[n-1].Src, v)
				continue
			}
			dst = append(dst, RemotePut{Mem: int(ext[j]), Off: off[j], Src: [][]byte{v}})
		}
	}
	return dst
}

// appendLanded appends the landed note of units first … first+k-1.
func (e *Export) appendLanded(dst []byte, first, k int) []byte {
	le := binary.LittleEndian
	dst = append(dst, msgLanded)
	dst = append(dst, e.m.TransferID[:]...)
	dst = le.AppendUint32(dst, uint32(first))
	dst = le.AppendUint32(dst, uint32(k))
	for _, g := range e.m.Generations[first : first+k] {
		dst = le.AppendUint32(dst, g)
	}
	return dst
}

// receiveRemote runs the transfer of m into in over a transport that
// writes the pages itself, if the pool can lend its pages and the
// transport can expose them; remote is false when it did neither, and
// nothing was sent: the pages then come in data frames.
func (r *Receiver) receiveRemote(ep MemoryEndpoint, m *Manifest, in *kvcache.Incoming, timedOut *atomic.Bool) (lease *kvcache.Lease, remote bool, err error) {
	if !in.Lendable() {
		return nil, false, nil
	}
	loan, err := in.LendPages()
	if err != nil {
		return nil, true, err
	}
	runs := loan.Runs()
	mems := make([][]byte, len(runs))
	g := grant{transfer: m.TransferID, extents: make([]int64, len(runs))}
	for _, l := range exportLanes(r.cfg.Pool.Spec(), in.Extents()) {
		g.lanes = append(g.lanes, grantLane{unitBytes: l.unitBytes, first: l.first, units: l.units})
	}
	for i, run := range runs {
		mems[i], g.extents[i] = run.Mem, int64(len(run.Mem))
		g.lanes[run.Region].runs = append(g.lanes[run.Region].runs, grantRun{first: run.First, n: run.Units, extent: i})
	}
	desc, revoke, err := ep.ExposeMemory(mems)
	if errors.Is(err, ErrNoRemoteMemory) {
		loan.Return()
		return nil, false, nil
	}
	if err != nil {
		loan.Return()
		return nil, true, fmt.Errorf("%w: exposing the import's memory: %w", ErrTransport, err)
	}
	g.desc = desc
	// The loan's watch marks the memory: before the grant, so before
	// the sender can write it.
	if watcher, ok := ep.(LandingWatcher); ok && watcher.LandsHere() {
		if scan := loan.Watch(); scan != nil {
			watcher.WatchLanding(scan)
		}
	}
	var write overlappedWrite
	// end takes the memory back from the sender before the pages are
	// vouched for or scrubbed: the sums in flight end, the transport
	// revokes, the units summed too soon (if the sums fall short of the
	// seal's, seal) are summed again, the loan goes back.
	end := func(err error, seal *uint32) error {
		if werr := write.wait(); err == nil {
			err = werr
		}
		revoke()
		if err == nil && seal != nil {
			if n := loan.Resum(*seal); n > 0 {
				r.mu.Lock()
				r.mu.stats.UnitsResummed += uint64(n)
				r.mu.Unlock()
			}
		}
		loan.Return()
		return err
	}
	if err := ep.Send(appendGrant(nil, r.cfg.Key, &g)); err != nil {
		return nil, true, end(fmt.Errorf("%w: grant: %w", ErrTransport, err), nil)
	}
	units := m.Units()
	var wantGens []byte
	next := 0
	for {
		msg, err := ep.Recv()
		switch {
		case errors.Is(err, io.EOF):
			return nil, true, end(fmt.Errorf("%w: request %q: stream ended after %d of %d units without a seal",
				kvcache.ErrIncompleteTransfer, m.RequestID, next, units), nil)
		case err != nil && timedOut.Load():
			return nil, true, end(fmt.Errorf("%w: request %q: no message awaited any more after %d of %d units (%v)",
				kvcache.ErrIncompleteTransfer, m.RequestID, next, units, err), nil)
		case err != nil:
			return nil, true, end(fmt.Errorf("%w: request %q after %d of %d units: %w", ErrTransport, m.RequestID, next, units, err), nil)
		}
		switch firstByte(msg) {
		case msgLanded:
			first, k, err := parseLanded(msg, m, next, &wantGens)
			if err != nil {
				return nil, true, end(err, nil)
			}
			if err := write.wait(); err != nil {
				return nil, true, end(err, nil)
			}
			write.start(func() error { return landedInSpans(loan, m, first, k) })
			next += k
		case msgSeal:
			if len(msg) != sealLen {
				return nil, true, end(fmt.Errorf("%w: seal of %d bytes", ErrProtocol, len(msg)), nil)
			}
			sum, err := parseSeal(msg, r.cfg.Key, m.TransferID, units)
			if err == nil && next != units {
				err = fmt.Errorf("%w: request %q sealed after %d of %d units landed", kvcache.ErrIncompleteTransfer, m.RequestID, next, units)
			}
			if err := end(err, &sum); err != nil {
				return nil, true, err
			}
			lease, err := in.CompleteWithChecksum(sum)
			return lease, true, err
		default:
			return nil, true, end(fmt.Errorf("%w: message kind %q in a transfer whose units are written remotely", ErrProtocol, firstByte(msg)), nil)
		}
	}
}

// parseLanded checks a landed note against the manifest of its transfer,
// next units in, and returns its units; wantGens is scratch.
func parseLanded(msg []byte, m *Manifest, next int, wantGens *[]byte) (first, k int, err error) {
	if len(msg) < dataFixed {
		return 0, 0, fmt.Errorf("%w: landed note of %d bytes", ErrProtocol, len(msg))
	}
	le := binary.LittleEndian
	first, n := int(le.Uint32(msg[17:])), int64(le.Uint32(msg[21:]))
	units := m.Units()
	switch {
	case [16]byte(msg[1:17]) != m.TransferID:
		return 0, 0, fmt.Errorf("%w: landed note of transfer %x in transfer %x", ErrProtocol, msg[1:17], m.TransferID)
	case n == 0 || int64(len(msg)-dataFixed) != 4*n:
		return 0, 0, fmt.Errorf("%w: landed note of %d bytes for %d units", ErrProtocol, len(msg), n)
	case first != next || n > int64(units-next):
		return 0, 0, fmt.Errorf("%w: units [%d, %d) landed after %d of %d", ErrProtocol, first, int64(first)+n, next, units)
	}
	k = int(n)
	*wantGens = (*wantGens)[:0]
	for _, g := range m.Generations[first : first+k] {
		*wantGens = le.AppendUint32(*wantGens, g)
	}
	if !bytes.Equal(msg[dataFixed:], *wantGens) {
		return 0, 0, fmt.Errorf("%w: units [%d, %d) carry generations the manifest does not name", ErrProtocol, first, first+k)
	}
	return first, k, nil
}
