package handoff_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// remoteOp is one step of a remote transfer as its receiver sees it: a
// message from the sender, or (msg nil) the sender's write of data at off
// of the granted extent mem.
type remoteOp struct {
	msg  []byte
	mem  int
	off  int
	data []byte
}

// encodeRemoteScript and decodeRemoteScript carry a remote transfer's
// steps after the manifest as fuzz input: per step a tag byte, even for a
// message (its length u16, then its bytes), odd for a write (extent u8,
// offset u16, length u16, then its bytes); a length past the end takes
// what is left.
func encodeRemoteScript(ops []remoteOp) []byte {
	var b []byte
	le := binary.LittleEndian
	for _, op := range ops {
		if op.msg != nil {
			b = append(b, 0)
			b = le.AppendUint16(b, uint16(len(op.msg)))
			b = append(b, op.msg...)
			continue
		}
		b = append(b, 1, byte(op.mem))
		b = le.AppendUint16(b, uint16(op.off))
		b = le.AppendUint16(b, uint16(len(op.data)))
		b = append(b, op.data...)
	}
	return b
}

func decodeRemoteScript(b []byte) []remoteOp {
	le := binary.LittleEndian
	var ops []remoteOp
	take := func(n int) []byte {
		n = min(n, len(b))
		v := b[:n]
		b = b[n:]
		return v
	}
	for len(b) > 0 {
		if take(1)[0]%2 == 0 {
			if len(b) < 2 {
				break
			}
			n := int(le.Uint16(take(2)))
			ops = append(ops, remoteOp{msg: bytes.Clone(take(n))})
			continue
		}
		if len(b) < 5 {
			break
		}
		mem, off, n := int(take(1)[0]), int(le.Uint16(take(2))), int(le.Uint16(take(2)))
		ops = append(ops, remoteOp{mem: mem, off: off, data: take(n)})
	}
	return ops
}

// scriptedMemEndpoint is a receiver's end of a remote transfer whose
// sender's steps are given: the manifest, then ops. Writes are carried
// out, as a transport would, when the receiver asks for the next message:
// into the memory it exposed, inside its extents, until it revokes it.
// A write into a unit whose landed note the receiver has already been
// handed is refused too: the protocol's premise (remote.go) is that a
// landed unit no longer changes, which a transport that checks its
// writes keeps (ucxx's receives over TCP), and a one-sided put does not;
// it is left out here so that a delivered lease can be checked exactly.
//
// With watch set the endpoint lands the writes on the receiver's
// threads as ucxx does over shared memory (LandsHere), and runs the
// receiver's scan after each; and it refuses a write to a byte already
// written, for the watch's premise (kvcache's landing.go) is that each
// byte lands once.
type scriptedMemEndpoint struct {
	manifest []byte
	ops      []remoteOp
	key      *handoff.Key
	watch    bool

	mu          sync.Mutex
	next        int
	mems        [][]byte
	unitOf      [][]int  // [extent][byte]: the unit whose piece the byte is; -1 none
	written     [][]bool // [extent][byte], with watch
	scan        func()
	landed      map[int]bool
	exposed     int
	revokes     int
	revoked     bool
	interrupted bool
	verdicts    [][]byte
}

func (e *scriptedMemEndpoint) Recv() ([]byte, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.interrupted {
		return nil, fmt.Errorf("%w: interrupted", handoff.ErrTransport)
	}
	if m := e.manifest; m != nil {
		e.manifest = nil
		return m, nil
	}
	for ; e.next < len(e.ops) && e.ops[e.next].msg == nil; e.next++ {
		e.writeLocked(e.ops[e.next])
	}
	if e.next == len(e.ops) {
		return nil, io.EOF
	}
	msg := e.ops[e.next].msg
	e.next++
	if len(msg) >= 25 && msg[0] == 'L' {
		first, n := int(binary.LittleEndian.Uint32(msg[17:])), int(binary.LittleEndian.Uint32(msg[21:]))
		for u := first; u < first+n && u-first < 1<<16; u++ {
			e.landed[u] = true
		}
	}
	return msg, nil
}

// writeLocked carries out op if it lies inside an extent still exposed
// and touches no landed unit (with watch: no byte already written), then
// runs the receiver's scan, if it set one.
func (e *scriptedMemEndpoint) writeLocked(op remoteOp) {
	if e.mems == nil || e.revoked || op.mem >= len(e.mems) || op.off+len(op.data) > len(e.mems[op.mem]) {
		return
	}
	for _, u := range e.unitOf[op.mem][op.off : op.off+len(op.data)] {
		if u >= 0 && e.landed[u] {
			return
		}
	}
	if e.watch {
		written := e.written[op.mem][op.off : op.off+len(op.data)]
		for _, w := range written {
			if w {
				return
			}
		}
		for i := range written {
			written[i] = true
		}
	}
	copy(e.mems[op.mem][op.off:], op.data)
	if e.scan != nil {
		e.scan()
	}
}

func (e *scriptedMemEndpoint) Send(msg []byte) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.verdicts = append(e.verdicts, bytes.Clone(msg))
	if len(msg) > 0 && msg[0] == 'G' && e.mems != nil {
		pieces, err := handoff.GrantPiecesForTest(msg, e.key)
		if err != nil {
			return fmt.Errorf("%w: the receiver's own grant does not parse: %w", handoff.ErrProtocol, err)
		}
		for _, p := range pieces {
			if p.Mem < len(e.unitOf) && p.Off+p.Len <= int64(len(e.unitOf[p.Mem])) {
				for i := p.Off; i < p.Off+p.Len; i++ {
					e.unitOf[p.Mem][i] = p.Unit
				}
			}
		}
	}
	return nil
}

func (e *scriptedMemEndpoint) InterruptRecv() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.interrupted = true
}

func (e *scriptedMemEndpoint) ExposeMemory(mems [][]byte) ([]byte, func(), error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.exposed++
	e.mems = mems
	e.unitOf = make([][]int, len(mems))
	e.written = make([][]bool, len(mems))
	for i, m := range mems {
		e.unitOf[i] = make([]int, len(m))
		for j := range e.unitOf[i] {
			e.unitOf[i][j] = -1
		}
		e.written[i] = make([]bool, len(m))
	}
	return []byte("mem"), func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.revokes++
		e.revoked = true
		e.scan = nil
	}, nil
}

func (e *scriptedMemEndpoint) LandsHere() bool { return e.watch }

func (e *scriptedMemEndpoint) WatchLanding(scan func()) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.scan = scan
}

var _ handoff.LandingWatcher = (*scriptedMemEndpoint)(nil)

// FuzzServeRemote is FuzzServe of a transfer whose pages the sender
// writes into the decode pool's memory (remote.go): a genuine signed
// manifest, then any messages (landed notes, seals, anything) and writes
// anywhere in the exposed memory, in any order. Serve never panics; it
// delivers a lease only if that lease holds exactly the prefill's pages;
// it takes back every exposure it made; whatever it refuses leaves no
// lease behind, and the decode pool passes Check with every page free
// and holding its canary. Each input runs on a fresh decode pool, so that
// the import's pages, and so the recorded writes' places, are the same
// every time.
func FuzzServeRemote(f *testing.F) {
	// 40 units of 512 bytes in chunks of 16 KiB (4 frames of 4 KiB): two
	// chunks, two landed notes.
	fuzzServeRemote(f, testkit.PoolConfig{Pages: 64}, 40, false)
}

// FuzzServeRemoteWatched is FuzzServeRemote where the transport lands
// the writes on the receiver's threads and the receiver watches them
// (handoff.LandingWatcher, kvcache.PageLoan.Watch): pages of 6 KiB, whose
// checksum blocks the watch sums as they land, whatever the order and
// the pieces the writes come in; a block summed too soon must never let
// through a page that is not the prefill's.
func FuzzServeRemoteWatched(f *testing.F) {
	// 3 units of 12 KiB (K and V, 6 KiB pages; of each unit's three
	// blocks the middle one straddles the two): a chunk and a landed note
	// a unit.
	g := kvcache.Geometry{TokensPerPage: 16, Layers: 1, KVHeads: 2, HeadDim: 96, DType: kvcache.FP16}
	fuzzServeRemote(f, testkit.PoolConfig{Geometry: g, Pages: 16}, 3, true)
}

// fuzzServeRemote is FuzzServeRemote over pools c of a prompt of units
// pages, the endpoint watched or not.
func fuzzServeRemote(f *testing.F, c testkit.PoolConfig, units int, watch bool) {
	const id = "fuzz"
	c.Tenants = []kvcache.TenantConfig{{Name: "victim"}}
	prefill, err := testkit.NewPool(c)
	if err != nil {
		f.Fatal(err)
	}
	defer prefill.Close()
	newDecode := func() (*kvcache.Pool, *handoff.Receiver) {
		decode, err := testkit.NewPool(c)
		if err != nil {
			f.Fatal(err)
		}
		r, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: decode, Key: testkit.Key(), MaxTTL: 2 * time.Hour})
		if err != nil {
			f.Fatal(err)
		}
		return decode, r
	}
	s, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key(), TTL: time.Hour, FrameBytes: 4 << 10})
	if err != nil {
		f.Fatal(err)
	}
	l, err := testkit.Prefill(prefill, id, "victim", (units-1)*16+5)
	if err != nil {
		f.Fatal(err)
	}
	exp, err := s.Export(l, 8)
	if err != nil {
		f.Fatal(err)
	}

	// Record the genuine transfer: its messages and writes, in order.
	decode, r := newDecode()
	tr := newMemTransport(r)
	var ops []remoteOp
	var mu sync.Mutex
	tr.put = func(p handoff.RemotePut) bool {
		mu.Lock()
		defer mu.Unlock()
		ops = append(ops, remoteOp{mem: p.Mem, off: int(p.Off), data: bytes.Join(p.Src, nil)})
		return true
	}
	tr.toReceiver = func(msg []byte) []byte {
		mu.Lock()
		defer mu.Unlock()
		ops = append(ops, remoteOp{msg: bytes.Clone(msg)})
		return msg
	}
	if err := exp.Send(context.Background(), tr); err != nil {
		f.Fatal(err)
	}
	tr.serves.Wait()
	if dl, ok := r.Take(id); !ok {
		f.Fatal("the recorded transfer delivered no lease")
	} else if err := dl.Release(); err != nil {
		f.Fatal(err)
	}
	decode.Close()
	manifest, rest := ops[0].msg, ops[1:]
	var notes, writes []int // indexes in rest
	for i, op := range rest {
		switch {
		case op.msg == nil:
			writes = append(writes, i)
		case op.msg[0] == 'L':
			notes = append(notes, i)
		}
	}
	last := len(rest) - 1
	if manifest == nil || manifest[0] != 'M' || len(notes) < 2 || rest[last].msg == nil || rest[last].msg[0] != 'S' {
		f.Fatalf("the recorded transfer is not manifest, writes and 2 or more landed notes, seal: %d steps", len(ops))
	}
	for _, op := range rest {
		if len(op.msg) > 1<<16-1 || len(op.data) > 1<<16-1 || op.off > 1<<16-1 || op.mem > 255 {
			f.Fatalf("a recorded step too large for the script: %d-byte message, %d bytes at %d of extent %d",
				len(op.msg), len(op.data), op.off, op.mem)
		}
	}
	genuine := encodeRemoteScript(rest)
	without := func(i int) []remoteOp { return append(append([]remoteOp{}, rest[:i]...), rest[i+1:]...) }
	f.Add(genuine)
	f.Add(encodeRemoteScript(rest[:last]))        // no seal
	f.Add(encodeRemoteScript(without(writes[0]))) // a write lost
	f.Add(encodeRemoteScript(without(notes[0])))  // a landed note lost
	swapped := append([]remoteOp{}, rest...)
	swapped[notes[0]], swapped[notes[1]] = swapped[notes[1]], swapped[notes[0]]
	f.Add(encodeRemoteScript(swapped)) // notes out of order
	rewrite := remoteOp{mem: rest[writes[0]].mem, off: rest[writes[0]].off, data: bytes.Repeat([]byte{0xa5}, 64)}
	f.Add(encodeRemoteScript(append(append(append([]remoteOp{}, rest[:last]...), rewrite), rest[last]))) // a landed unit written again
	f.Add(encodeRemoteScript(append([]remoteOp{{mem: 9, off: 0, data: []byte{1}}}, rest...)))            // a write outside the extents
	if watch {
		// Each page's whole block gets its last 8 bytes first (at 4 KiB
		// of a K page, at the end of a V page): blocks summed too soon,
		// to be summed again before the verdict.
		var tailFirst []remoteOp
		for _, op := range rest {
			if op.msg != nil || len(op.data) != 6<<10 || op.mem > 1 {
				tailFirst = append(tailFirst, op)
				continue
			}
			end := []int{4 << 10, 6 << 10}[op.mem]
			tailFirst = append(tailFirst,
				remoteOp{mem: op.mem, off: op.off + end - 8, data: op.data[end-8 : end]},
				remoteOp{mem: op.mem, off: op.off, data: op.data[:end-8]},
				remoteOp{mem: op.mem, off: op.off + end, data: op.data[end:]})
		}
		f.Add(encodeRemoteScript(tailFirst))
	}
	early := append([]remoteOp{}, rest[:writes[0]]...) // bytes that are not the prefill's, landed before the genuine ones
	early = append(early, remoteOp{mem: rest[writes[0]].mem, off: rest[writes[0]].off, data: bytes.Repeat([]byte{0x5a}, 100)})
	f.Add(encodeRemoteScript(append(early, rest[writes[0]:]...)))
	f.Add([]byte{})

	f.Fuzz(func(t *testing.T, script []byte) {
		decode, r := newDecode()
		defer decode.Close()
		ep := &scriptedMemEndpoint{manifest: manifest, ops: decodeRemoteScript(script), key: testkit.Key(), watch: watch, landed: map[int]bool{}}
		err := r.Serve(context.Background(), ep)
		ep.mu.Lock()
		exposed, revokes, verdicts := ep.exposed, ep.revokes, ep.verdicts
		ep.mu.Unlock()
		if exposed > 1 || revokes != exposed {
			t.Fatalf("memory exposed %d times and taken back %d (Serve: %v)", exposed, revokes, err)
		}
		checkServed(t, r, decode, id, err, bytes.Equal(script, genuine), verdicts)
	})
}
