package handoff_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// memTransport connects a sender to a receiver in the same process the
// way an RDMA transport does: messages go over a pair of channels, and
// the receiver's exposed memory is written by the sender's RemoteWriter
// directly (copies into the decode pool's pages). Hooks let a test
// tamper with what either side sends and with the writes.
type memTransport struct {
	r      *handoff.Receiver
	serves sync.WaitGroup
	// refuse, if set, is what ExposeMemory returns instead of exposing.
	refuse error
	// toSender and toReceiver, if set, see (and may change or drop: nil)
	// each message before it is delivered.
	toSender, toReceiver func(msg []byte) []byte
	// put, if set, sees each put before it is written; false skips it.
	put func(p handoff.RemotePut) bool
	// minPut is what the writers ask for as puts' least size (PutSizer).
	minPut int64
	// tailFirst has each put's last 8 bytes land, and the receiver's
	// watch scan, before the rest: a writer whose bytes do not land in
	// address order (a NIC's).
	tailFirst bool
	// noWatch has the server say that its memory is not written on the
	// receiver's threads (LandsHere): the receiver then does not watch.
	noWatch bool

	mu                     sync.Mutex
	exposed, revoked       int
	watched, scans         int // WatchLanding calls; the scans they set up, run
	writes, writesRefused  int
	batchBytes             []int64 // the bytes of each Write's puts, in order
	lateWrites             int     // writes attempted after their memory was revoked
	lastPipe               *memPipe
	kinds                  map[byte]int // messages the receiver got, by kind
	revokeWaitedForStopped bool
}

func newMemTransport(r *handoff.Receiver) *memTransport {
	return &memTransport{r: r, kinds: map[byte]int{}}
}

func (t *memTransport) Open(ctx context.Context) (handoff.Stream, error) {
	p := &memPipe{t: t, toS: make(chan []byte, 1024), toC: make(chan []byte, 16),
		closed: make(chan struct{}), interrupted: make(chan struct{}), served: make(chan struct{})}
	t.mu.Lock()
	t.lastPipe = p
	t.mu.Unlock()
	t.serves.Add(1)
	go func() {
		defer t.serves.Done()
		t.r.Serve(ctx, &memServerEnd{p: p})
		close(p.served)
	}()
	return &memClient{p: p}, nil
}

func (t *memTransport) counts() (writes, late, exposed, revoked int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.writes, t.lateWrites, t.exposed, t.revoked
}

type memPipe struct {
	t           *memTransport
	toS, toC    chan []byte
	closed      chan struct{} // the sender's Close: a dropped connection
	interrupted chan struct{}
	served      chan struct{}
	closeOnce   sync.Once
	intOnce     sync.Once
	sendClosed  bool

	mu      sync.Mutex
	mems    [][]byte
	revoked bool
	scan    func() // WatchLanding's: run after each put lands, under mu
}

var errPipeGone = fmt.Errorf("%w: memPipe closed", handoff.ErrTransport)

type memClient struct{ p *memPipe }

func (c *memClient) Send(msg []byte) error {
	p := c.p
	if f := p.t.toReceiver; f != nil {
		if msg = f(append([]byte(nil), msg...)); msg == nil {
			return nil
		}
	}
	select {
	case <-p.closed:
		return errPipeGone
	case <-p.served:
		return fmt.Errorf("%w: the receiver has ended the transfer", handoff.ErrTransport)
	default:
	}
	select {
	case p.toS <- append([]byte(nil), msg...):
		return nil
	case <-p.closed:
		return errPipeGone
	case <-p.served:
		return fmt.Errorf("%w: the receiver has ended the transfer", handoff.ErrTransport)
	}
}

func (c *memClient) CloseSend() error {
	if !c.p.sendClosed {
		c.p.sendClosed = true
		close(c.p.toS)
	}
	return nil
}

func (c *memClient) Recv() ([]byte, error) {
	p := c.p
	select {
	case msg := <-p.toC:
		return msg, nil
	default:
	}
	select {
	case msg := <-p.toC:
		return msg, nil
	case <-p.served:
		select {
		case msg := <-p.toC:
			return msg, nil
		default:
			return nil, io.EOF
		}
	case <-p.closed:
		return nil, errPipeGone
	}
}

func (c *memClient) Close() error {
	c.p.closeOnce.Do(func() { close(c.p.closed) })
	return nil
}

func (c *memClient) OpenRemote(desc []byte, memBytes []int64) (handoff.RemoteWriter, error) {
	p := c.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if string(desc) != "mem" || len(memBytes) != len(p.mems) {
		return nil, fmt.Errorf("%w: memPipe: a description of other memory", handoff.ErrTransport)
	}
	for i, b := range memBytes {
		if int(b) != len(p.mems[i]) {
			return nil, fmt.Errorf("%w: memPipe: extent %d is %d bytes, not %d", handoff.ErrTransport, i, len(p.mems[i]), b)
		}
	}
	return &memWriter{p: p}, nil
}

type memWriter struct{ p *memPipe }

func (w *memWriter) Write(puts []handoff.RemotePut) (func() error, error) {
	p, t := w.p, w.p.t
	skip := make([]bool, len(puts))
	if t.put != nil {
		for i, put := range puts {
			skip[i] = !t.put(put)
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.revoked {
		t.mu.Lock()
		t.lateWrites++
		t.mu.Unlock()
		return nil, fmt.Errorf("%w: memPipe: the receiver revoked its memory", handoff.ErrTransport)
	}
	for _, put := range puts {
		n := putLen(put)
		if put.Mem < 0 || put.Mem >= len(p.mems) || put.Off < 0 || put.Off+int64(n) > int64(len(p.mems[put.Mem])) {
			return nil, fmt.Errorf("%w: memPipe: a put of %d bytes at %d of extent %d: outside the granted memory", handoff.ErrProtocol, n, put.Off, put.Mem)
		}
	}
	var batch int64
	for i, put := range puts {
		t.mu.Lock()
		t.writes++
		t.mu.Unlock()
		batch += int64(putLen(put))
		if skip[i] {
			continue
		}
		mem := p.mems[put.Mem]
		if t.tailFirst {
			last := put.Src[len(put.Src)-1]
			end := put.Off + int64(putLen(put))
			if len(last) >= 8 {
				copy(mem[end-8:end], last[len(last)-8:])
				p.scanLocked()
			}
		}
		off := put.Off
		for _, s := range put.Src {
			off += int64(copy(mem[off:], s))
		}
		p.scanLocked()
	}
	t.mu.Lock()
	t.batchBytes = append(t.batchBytes, batch)
	t.mu.Unlock()
	return func() error { return nil }, nil
}

// putLen is a put's bytes.
func putLen(put handoff.RemotePut) (n int) {
	for _, s := range put.Src {
		n += len(s)
	}
	return n
}

// scanLocked runs the receiver's watch, if it set one, as a transport
// that lands the bytes on its own thread does after each move.
func (p *memPipe) scanLocked() {
	if p.scan == nil {
		return
	}
	p.scan()
	p.t.mu.Lock()
	p.t.scans++
	p.t.mu.Unlock()
}

func (w *memWriter) Close() error { return nil }

func (w *memWriter) MinPutBytes() int64 { return w.p.t.minPut }

type memServerEnd struct{ p *memPipe }

func (e *memServerEnd) Recv() ([]byte, error) {
	p := e.p
	select {
	case <-p.interrupted:
		return nil, fmt.Errorf("%w: interrupted", handoff.ErrTransport)
	default:
	}
	select {
	case msg, ok := <-p.toS:
		if !ok {
			return nil, io.EOF
		}
		p.t.mu.Lock()
		p.t.kinds[msg[0]]++
		p.t.mu.Unlock()
		return msg, nil
	case <-p.closed:
		return nil, errPipeGone
	case <-p.interrupted:
		return nil, fmt.Errorf("%w: interrupted", handoff.ErrTransport)
	}
}

func (e *memServerEnd) Send(msg []byte) error {
	p := e.p
	if f := p.t.toSender; f != nil {
		if msg = f(append([]byte(nil), msg...)); msg == nil {
			return nil
		}
	}
	select {
	case p.toC <- append([]byte(nil), msg...):
		return nil
	case <-p.closed:
		return errPipeGone
	}
}

func (e *memServerEnd) InterruptRecv() { e.p.intOnce.Do(func() { close(e.p.interrupted) }) }

func (e *memServerEnd) ExposeMemory(mems [][]byte) ([]byte, func(), error) {
	p := e.p
	if p.t.refuse != nil {
		return nil, nil, p.t.refuse
	}
	p.mu.Lock()
	p.mems = mems
	p.mu.Unlock()
	p.t.mu.Lock()
	p.t.exposed++
	p.t.mu.Unlock()
	return []byte("mem"), func() {
		// Writes happen under p.mu: once revoked is set, none runs and
		// none will.
		p.mu.Lock()
		p.revoked = true
		p.mems = nil
		p.scan = nil
		p.mu.Unlock()
		p.t.mu.Lock()
		p.t.revoked++
		p.t.mu.Unlock()
	}, nil
}

func (e *memServerEnd) LandsHere() bool { return !e.p.t.noWatch }

func (e *memServerEnd) WatchLanding(scan func()) {
	p := e.p
	p.mu.Lock()
	p.scan = scan
	p.mu.Unlock()
	p.t.mu.Lock()
	p.t.watched++
	p.t.mu.Unlock()
}

var (
	_ handoff.LandingWatcher = (*memServerEnd)(nil)
	_ handoff.MemoryStream   = (*memClient)(nil)
)

// remoteSetup is a prefill and a decode pool, a sender whose chunks are
// a few pages, and a memory transport to the decode pool's receiver.
func remoteSetup(t *testing.T, mod ...func(*handoff.ReceiverConfig)) (prefill, decode *kvcache.Pool, recv *handoff.Receiver, tr *memTransport, s *handoff.Sender) {
	prefill = pool(t, testkit.PoolConfig{Pages: 1024})
	decode = pool(t, testkit.PoolConfig{Pages: 2048})
	recv = receiver(t, decode, mod...)
	tr = newMemTransport(recv)
	s = sender(t, func(c *handoff.SenderConfig) { c.FrameBytes = 4 << 10; c.ReclaimAfter = time.Minute })
	return
}

func exportOf(t *testing.T, s *handoff.Sender, p *kvcache.Pool, id string, prompt int) *handoff.Export {
	t.Helper()
	l, err := testkit.Prefill(p, id, "victim", prompt)
	require.NoError(t, err)
	exp, err := s.Export(l, 16)
	require.NoError(t, err)
	return exp
}

// sendVerified sends exp over tr and checks that the decode lease of id
// holds exactly the prefill's pages, then releases it.
func sendVerified(t *testing.T, exp *handoff.Export, tr handoff.Transport, recv *handoff.Receiver, decode *kvcache.Pool, id string) {
	t.Helper()
	require.NoError(t, exp.Send(context.Background(), tr))
	dl, ok := recv.Take(id)
	require.True(t, ok, "no decode lease for %s", id)
	require.NoError(t, testkit.VerifyContent(decode, dl, id))
	require.NoError(t, dl.Release())
}

// The pages of prompts of one token, one page and many chunks are
// written into the decode pool's memory, not sent: no data frame, a
// landed note per chunk, the memory exposed and revoked once per
// transfer, every page verified; a replay is refused.
func TestRemoteRoundTrip(t *testing.T) {
	prefill, decode, recv, tr, s := remoteSetup(t)
	ctx := context.Background()
	for i, prompt := range []int{1, 16, 700*16 + 5} {
		id := fmt.Sprint("remote-", i)
		exp := exportOf(t, s, prefill, id, prompt)
		sendVerified(t, exp, tr, recv, decode, id)
		assert.False(t, exp.Live())
	}
	tr.serves.Wait()
	writes, late, exposed, revoked := tr.counts()
	assert.Positive(t, writes)
	assert.Zero(t, late)
	assert.Equal(t, 3, exposed)
	assert.Equal(t, 3, revoked)
	assert.Zero(t, tr.kinds['D'], "no data frames")
	assert.Greater(t, tr.kinds['L'], 3, "a landed note per chunk")

	exp := exportOf(t, s, prefill, "remote-0", 1)
	assert.ErrorIs(t, exp.Send(ctx, tr), handoff.ErrReplay)
	require.NoError(t, exp.Abort())
	tr.serves.Wait()
	sweep(t, prefill, decode)
}

// A writer whose puts should carry 16 KiB at least (PutSizer; a put a
// region per chunk, 2 regions of 256-byte pages here) is given chunks of
// 32 KiB, 64 units, instead of 16 KiB (4 frames of 4 KiB): half as many
// writes, each but the last of 32 KiB; the transfer is the same.
func TestRemoteChunksMeetMinPutBytes(t *testing.T) {
	prefill, decode, recv, tr, s := remoteSetup(t)
	tr.minPut = 16 << 10
	const units = 701
	sendVerified(t, exportOf(t, s, prefill, "sized", (units-1)*16+5), tr, recv, decode, "sized")
	tr.serves.Wait()
	pageBytes := testkit.Geometry.PageBytes()
	require.Len(t, tr.batchBytes, (units+63)/64, "a write per chunk of 64 units")
	for i, b := range tr.batchBytes[:len(tr.batchBytes)-1] {
		assert.Equal(t, 64*pageBytes, b, "write %d", i)
	}
	assert.Equal(t, int64(units%64)*pageBytes, tr.batchBytes[len(tr.batchBytes)-1])
	assert.Equal(t, len(tr.batchBytes), tr.kinds['L'], "a landed note per chunk")
	sweep(t, prefill, decode)
}

// Where the prefill's pages are not host memory (a GPU's), a chunk is
// staged in the sender's memory before it is written, and a PutSizer's
// wish is bounded: 2 MiB asked for (1 MiB for each of 2 regions) gives
// chunks of 32 frames of 4 KiB, 256 units, not the whole prompt.
func TestRemoteStagedChunksBounded(t *testing.T) {
	prefill := pool(t, testkit.PoolConfig{Pages: 1024, Opaque: true})
	decode := pool(t, testkit.PoolConfig{Pages: 2048})
	recv := receiver(t, decode)
	tr := newMemTransport(recv)
	s := sender(t, func(c *handoff.SenderConfig) { c.FrameBytes = 4 << 10; c.ReclaimAfter = time.Minute })
	tr.minPut = 1 << 20
	const units = 700
	sendVerified(t, exportOf(t, s, prefill, "staged", units*16), tr, recv, decode, "staged")
	tr.serves.Wait()
	pageBytes := testkit.Geometry.PageBytes()
	assert.Equal(t, []int64{256 * pageBytes, 256 * pageBytes, (units - 512) * pageBytes}, tr.batchBytes)
	sweep(t, prefill, decode)
}

// A transport that cannot expose the memory makes the receiver accept
// with a plain verdict: the pages come in data frames.
func TestRemoteFallsBackToDataFrames(t *testing.T) {
	prefill, decode, recv, tr, s := remoteSetup(t)
	tr.refuse = fmt.Errorf("%w: not here", handoff.ErrNoRemoteMemory)
	sendVerified(t, exportOf(t, s, prefill, "frames", 300*16), tr, recv, decode, "frames")
	tr.serves.Wait()
	assert.Positive(t, tr.kinds['D'])
	assert.Zero(t, tr.kinds['L'])
	sweep(t, prefill, decode)
}

// Every way a remote transfer can go wrong ends it with its own error on
// the sender's side, no decode lease, the memory revoked before the
// import was scrubbed (no write after it), and both pools clean.
func TestRemoteFaults(t *testing.T) {
	cases := []struct {
		name   string
		setup  func(tr *memTransport)
		reason error // what the sender's error wraps
		stage  string
	}{
		{name: "a tampered grant", reason: handoff.ErrBadMAC, setup: func(tr *memTransport) {
			tr.toSender = func(msg []byte) []byte {
				if msg[0] == 'G' {
					msg[len(msg)/2] ^= 1
				}
				return msg
			}
		}},
		{name: "a landed note with a forged generation", reason: handoff.ErrProtocol, stage: "import", setup: func(tr *memTransport) {
			n := 0
			tr.toReceiver = func(msg []byte) []byte {
				if msg[0] == 'L' {
					if n++; n == 2 {
						msg[len(msg)-1] ^= 0xff
					}
				}
				return msg
			}
		}},
		{name: "a landed note lost", reason: handoff.ErrProtocol, stage: "import", setup: func(tr *memTransport) {
			n := 0
			tr.toReceiver = func(msg []byte) []byte {
				if msg[0] == 'L' {
					if n++; n == 2 {
						return nil // the next one does not follow on
					}
				}
				return msg
			}
		}},
		{name: "the last landed note lost", reason: kvcache.ErrIncompleteTransfer, stage: "import", setup: func(tr *memTransport) {
			tr.toReceiver = func(msg []byte) []byte {
				le := binary.LittleEndian
				if msg[0] == 'L' && le.Uint32(msg[17:])+le.Uint32(msg[21:]) == 200 {
					return nil // sealed with pages not landed
				}
				return msg
			}
		}},
		{name: "pages noted landed that were never written", reason: kvcache.ErrChecksumMismatch, stage: "import", setup: func(tr *memTransport) {
			n := 0
			tr.put = func(handoff.RemotePut) bool { n++; return n != 3 }
		}},
		{name: "a page changed after it was summed", reason: kvcache.ErrChecksumMismatch, stage: "import", setup: func(tr *memTransport) {
			n := 0
			tr.put = func(put handoff.RemotePut) bool {
				if n++; n == 3 {
					put.Src[0][10] ^= 0xff // a prefill page, summed before its chunk is written
				}
				return true
			}
		}},
		{name: "a grant for less memory than it places", reason: handoff.ErrProtocol, setup: func(tr *memTransport) {
			tr.toSender = func(msg []byte) []byte {
				if msg[0] == 'G' {
					return resignGrant(msg, func(g []byte) { // extent 0 one byte short
						const at = 16 + 1 + 2 + 4 // transfer ID, version, lanes, extents
						binary.LittleEndian.PutUint64(g[at:], binary.LittleEndian.Uint64(g[at:])-1)
					})
				}
				return msg
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			prefill, decode, recv, tr, s := remoteSetup(t, func(c *handoff.ReceiverConfig) { c.TransferTimeout = 2 * time.Second })
			l, err := testkit.Prefill(prefill, "faulty", "victim", 200*16)
			require.NoError(t, err)
			tc.setup(tr)
			exp, err := s.Export(l, 0)
			require.NoError(t, err)
			err = exp.Send(context.Background(), tr)
			require.Error(t, err)
			assert.ErrorIs(t, err, tc.reason)
			if tc.stage != "" {
				var refused *handoff.RefusedError
				require.ErrorAs(t, err, &refused)
				assert.Equal(t, tc.stage, refused.Stage)
			}
			tr.mu.Lock()
			p := tr.lastPipe
			tr.mu.Unlock()
			(&memClient{p: p}).Close() // the sender's Send closed it; a stalled one is cut here
			tr.serves.Wait()
			_, ok := recv.Take("faulty")
			assert.False(t, ok)
			_, _, exposed, revoked := tr.counts() // a write after its revoke is refused (counted late)
			assert.Equal(t, exposed, revoked, "every exposure revoked")
			require.NoError(t, exp.Abort())
			sweep(t, prefill, decode)
		})
	}
}

// resignGrant changes a grant's signed bytes (after 'G') with change and
// signs it again with testkit's key: what a receiver that lies would
// send.
func resignGrant(msg []byte, change func(signed []byte)) []byte {
	signed := append([]byte(nil), msg[1:len(msg)-32]...)
	change(signed)
	return handoff.SignGrantForTest(append([]byte{'G'}, signed...), testkit.Key())
}

// A sender that stops between chunks holds the decode pages no longer
// than the receiver's TransferTimeout: the watchdog stops the wait, the
// memory is revoked before the pages are scrubbed, and a write the
// sender attempts afterwards is refused.
func TestRemoteStalledSender(t *testing.T) {
	prefill, decode, recv, tr, s := remoteSetup(t, func(c *handoff.ReceiverConfig) { c.TransferTimeout = 100 * time.Millisecond })
	n := 0
	tr.put = func(handoff.RemotePut) bool {
		if n++; n == 5 {
			require.Eventually(t, func() bool { return decode.Stats().InUsePages == 0 }, 10*time.Second, time.Millisecond,
				"the receiver still holds the import of a stalled sender")
		}
		return true
	}
	exp := exportOf(t, s, prefill, "stalled", 300*16)
	err := exp.Send(context.Background(), tr)
	var refused *handoff.RefusedError
	require.ErrorAs(t, err, &refused)
	assert.ErrorIs(t, err, kvcache.ErrIncompleteTransfer)
	tr.serves.Wait()
	_, late, exposed, revoked := tr.counts()
	assert.Equal(t, 1, late, "the sender's next write found the memory revoked")
	assert.Equal(t, 1, exposed)
	assert.Equal(t, 1, revoked)
	_, ok := recv.Take("stalled")
	assert.False(t, ok)
	require.NoError(t, exp.Abort())
	sweep(t, prefill, decode)
}

// A sender whose connection drops in the middle of the writes fails with
// ErrTransport; the receiver revokes, aborts and scrubs.
func TestRemoteConnectionDropped(t *testing.T) {
	prefill, decode, recv, tr, s := remoteSetup(t)
	n := 0
	tr.put = func(handoff.RemotePut) bool {
		if n++; n == 5 {
			tr.mu.Lock()
			p := tr.lastPipe
			tr.mu.Unlock()
			(&memClient{p: p}).Close()
		}
		return true
	}
	exp := exportOf(t, s, prefill, "dropped", 500*16)
	err := exp.Send(context.Background(), tr)
	assert.ErrorIs(t, err, handoff.ErrTransport)
	assert.True(t, errors.Is(err, handoff.ErrTransport))
	tr.serves.Wait()
	_, ok := recv.Take("dropped")
	assert.False(t, ok)
	_, _, exposed, revoked := tr.counts()
	assert.Equal(t, exposed, revoked)
	require.NoError(t, exp.Abort())
	sweep(t, prefill, decode)
}

// A hybrid model's prompt is written whole into the decode pool's
// memory: the per-token pages, the window's pages at the prompt's end and
// the state slot, each region a lane of the grant; the decode lease holds
// exactly what prefill wrote, in every group.
func TestRemoteHybrid(t *testing.T) {
	hybrid := func() *kvcache.Pool { return pool(t, testkit.PoolConfig{Spec: testkit.HybridSpec(), Pages: 128}) }
	prefill, decode := hybrid(), hybrid()
	recv := receiver(t, decode)
	tr := newMemTransport(recv)
	for _, frame := range []int{handoff.MinFrameBytes, 64 << 10} {
		s := sender(t, func(c *handoff.SenderConfig) { c.FrameBytes = frame })
		for i, prompt := range []int{3, 16*25 + 9} {
			id := fmt.Sprintf("h%d-%d", frame, i)
			exp := exportOf(t, s, prefill, id, prompt)
			require.NoError(t, exp.Send(context.Background(), tr))
			dl, ok := recv.Take(id)
			require.True(t, ok)
			require.NoError(t, testkit.VerifyContent(decode, dl, id))
			require.NoError(t, dl.Release())
		}
	}
	tr.serves.Wait()
	assert.Zero(t, tr.kinds['D']+tr.kinds['P'], "no data frames")
	sweep(t, prefill, decode)
}

// The receiver watches the lent memory where the transport lands the
// bytes on its own threads (LandingWatcher) and its pages hold whole
// checksum blocks (6 KiB pages here): the transport scans after each
// write, and every page is verified. Where a put's last bytes land
// before the rest (tailFirst), some blocks are summed too soon; their
// units are summed again from memory before the import is completed,
// and the transfers still succeed.
func TestRemoteLandingWatched(t *testing.T) {
	g := kvcache.Geometry{TokensPerPage: 16, Layers: 2, KVHeads: 2, HeadDim: 96, DType: kvcache.FP16}
	for _, tailFirst := range []bool{false, true} {
		t.Run(fmt.Sprint("tailFirst=", tailFirst), func(t *testing.T) {
			prefill := pool(t, testkit.PoolConfig{Geometry: g, Pages: 128})
			decode := pool(t, testkit.PoolConfig{Geometry: g, Pages: 256})
			recv := receiver(t, decode)
			tr := newMemTransport(recv)
			tr.tailFirst = tailFirst
			s := sender(t, func(c *handoff.SenderConfig) { c.FrameBytes = 64 << 10; c.ReclaimAfter = time.Minute })
			for i, prompt := range []int{1, 16, 100*16 + 5} {
				id := fmt.Sprint("watched-", i)
				sendVerified(t, exportOf(t, s, prefill, id, prompt), tr, recv, decode, id)
			}
			tr.serves.Wait()
			tr.mu.Lock()
			watched, scans := tr.watched, tr.scans
			tr.mu.Unlock()
			assert.Equal(t, 3, watched)
			assert.Positive(t, scans)
			if resummed := recv.Stats().UnitsResummed; tailFirst {
				assert.Positive(t, resummed, "blocks summed too soon")
			} else {
				assert.Zero(t, resummed, "bytes that land in order")
			}

			tr.noWatch = true
			sendVerified(t, exportOf(t, s, prefill, "unwatched", 100*16), tr, recv, decode, "unwatched")
			tr.serves.Wait()
			tr.mu.Lock()
			assert.Equal(t, watched, tr.watched, "a transport whose memory lands elsewhere is not watched")
			tr.mu.Unlock()
			sweep(t, prefill, decode)
		})
	}
}
