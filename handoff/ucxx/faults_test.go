//go:build cgo && ucx

package ucxx_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/handoff/ucxx"
	"github.com/kvfence/kvfence/kvcache"
)

var tenants = []kvcache.TenantConfig{{Name: "victim"}, {Name: "other"}}

func newPool(t testing.TB, pages int) *kvcache.Pool {
	p, err := testkit.NewPool(testkit.PoolConfig{Pages: pages, Tenants: tenants})
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

// serve starts a ucxx server on loopback that imports into the decode
// pool of rc (whose Key defaults to testkit's), closed at the end of the
// test, and dials it.
func serve(t testing.TB, rc handoff.ReceiverConfig, opts ucxx.Options) (*handoff.Receiver, *ucxx.Server, *ucxx.Transport) {
	if rc.Key == nil {
		rc.Key = testkit.Key()
	}
	recv, err := handoff.NewReceiver(rc)
	require.NoError(t, err)
	srv, err := ucxx.NewServer(recv, opts)
	require.NoError(t, err)
	t.Cleanup(func() { srv.Close() })
	addr, err := srv.Listen("127.0.0.1:0")
	require.NoError(t, err)
	return recv, srv, dial(t, addr)
}

func dial(t testing.TB, addr string) *ucxx.Transport {
	tr, err := ucxx.Dial(addr, ucxx.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { tr.Close() })
	return tr
}

func newSender(t testing.TB) *handoff.Sender {
	s, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key(), FrameBytes: 32 << 10, ReclaimAfter: time.Minute})
	require.NoError(t, err)
	return s
}

func export(t testing.TB, s *handoff.Sender, p *kvcache.Pool, id string, prompt int) *handoff.Export {
	l, err := testkit.Prefill(p, id, "victim", prompt)
	require.NoError(t, err)
	exp, err := s.Export(l, 16)
	require.NoError(t, err)
	return exp
}

func refusedBy(recv *handoff.Receiver, name string) uint64 {
	for code, n := range handoff.ReasonNames {
		if n == name {
			return recv.Stats().RefusedBy[code]
		}
	}
	panic("no reason " + name)
}

// hooked passes a transport's streams on, calling before ahead of each
// write into the receiver's memory (counted from 1), and reply on each
// message the sender receives (which it may change in place).
type hooked struct {
	inner  handoff.Transport
	before func(n int)
	reply  func(msg []byte)
	n      int
}

func (h *hooked) Open(ctx context.Context) (handoff.Stream, error) {
	st, err := h.inner.Open(ctx)
	if err != nil {
		return nil, err
	}
	return &hookedStream{ViewStream: st.(handoff.ViewStream), h: h}, nil
}

type hookedStream struct {
	handoff.ViewStream
	h *hooked
}

func (s *hookedStream) Recv() ([]byte, error) {
	msg, err := s.ViewStream.Recv()
	if err == nil && s.h.reply != nil {
		s.h.reply(msg)
	}
	return msg, err
}

func (s *hookedStream) OpenRemote(desc []byte, memBytes []int64) (handoff.RemoteWriter, error) {
	w, err := s.ViewStream.(handoff.MemoryStream).OpenRemote(desc, memBytes)
	if err != nil {
		return nil, err
	}
	return &hookedWriter{RemoteWriter: w, h: s.h}, nil
}

type hookedWriter struct {
	handoff.RemoteWriter
	h *hooked
}

func (w *hookedWriter) Write(puts []handoff.RemotePut) (func() error, error) {
	w.h.n++
	if w.h.before != nil {
		w.h.before(w.h.n)
	}
	return w.RemoteWriter.Write(puts)
}

// A connection that ends as the protocol says hands its UCX worker on to
// a later one, on both ends (the receiver's may still be closing when the
// next connection comes: it then makes a second); one that fails
// destroys its worker (which ends whatever it still had in flight), and
// the next connection gets a new one.
func TestWorkersServeOnOrEnd(t *testing.T) {
	prefill, decode := newPool(t, 2048), newPool(t, 2048)
	recv, srv, tr := serve(t, handoff.ReceiverConfig{Pool: decode}, ucxx.Options{})
	s := newSender(t)
	handoff := func(id string) {
		require.NoError(t, export(t, s, prefill, id, 100*16).Send(context.Background(), tr))
		l, ok := recv.Take(id)
		require.True(t, ok)
		require.NoError(t, l.Release())
	}
	workers := func(v any) [2]int {
		made, destroyed := ucxx.Workers(v)
		return [2]int{made, destroyed}
	}
	for i := range 5 {
		handoff(fmt.Sprint("clean-", i))
	}
	assert.Equal(t, [2]int{1, 0}, workers(tr), "the sender's workers (made, destroyed) after 5 clean handoffs")
	made, destroyed := ucxx.Workers(srv)
	assert.LessOrEqual(t, made, 2, "the receiver's workers made in 5 handoffs, one after the other")
	assert.Zero(t, destroyed, "the receiver's workers destroyed in 5 clean handoffs")

	st, err := tr.Open(context.Background())
	require.NoError(t, err)
	ucxx.Cut(st)
	st.Close()
	assert.Equal(t, [2]int{1, 1}, workers(tr), "the sender's workers after a cut")
	require.Eventually(t, func() bool { return workers(srv)[1] == 1 }, 10*time.Second, time.Millisecond,
		"the receiver's workers after a cut: %v", workers(srv))
	handoff("after-the-cut")
	assert.Equal(t, [2]int{2, 1}, workers(tr), "the sender's workers after a handoff that followed the cut")
	assert.Equal(t, 1, workers(srv)[1], "the receiver's workers destroyed after a clean handoff that followed the cut")
	require.NoError(t, testkit.Sweep(prefill))
	require.NoError(t, testkit.Sweep(decode))
}

// A grant whose remote keys (or anything else) changed on the way is
// refused for its MAC: the sender writes nothing, and both pools end
// clean.
func TestTamperedGrantIsRefused(t *testing.T) {
	prefill, decode := newPool(t, 1024), newPool(t, 2048)
	recv, _, tr := serve(t, handoff.ReceiverConfig{Pool: decode}, ucxx.Options{})
	exp := export(t, newSender(t), prefill, "tampered", 300*16)
	h := &hooked{inner: tr, reply: func(msg []byte) {
		if msg[0] == 'G' {
			msg[len(msg)-32-3] ^= 0x5a // in the transport's description: a remote key
		}
	}}
	err := exp.Send(context.Background(), h)
	assert.ErrorIs(t, err, handoff.ErrBadMAC)
	assert.Zero(t, h.n, "writes after a grant that failed its MAC")
	require.Eventually(t, func() bool { return recv.Stats().Refused == 1 }, 10*time.Second, time.Millisecond)
	require.NoError(t, exp.Abort())
	require.NoError(t, testkit.Sweep(prefill))
	require.NoError(t, testkit.Sweep(decode))
}

// An import that ends while its sender still writes (the receiver's
// TransferTimeout passes while the sender stalls between two chunks) is
// taken back before it is scrubbed: the sender's next write is refused,
// and no byte of it lands in the scrubbed pages (Sweep finds every free
// page holding its canary).
func TestStaleImportStopsTheWrites(t *testing.T) {
	prefill, decode := newPool(t, 2048), newPool(t, 2048)
	recv, _, tr := serve(t, handoff.ReceiverConfig{Pool: decode, TransferTimeout: 200 * time.Millisecond}, ucxx.Options{})
	exp := export(t, newSender(t), prefill, "stale", 1500*16)
	h := &hooked{inner: tr, before: func(n int) {
		if n == 3 {
			require.Eventually(t, func() bool { return decode.Stats().InUsePages == 0 }, 10*time.Second, time.Millisecond,
				"the receiver still holds the import of a stalled sender")
		}
	}}
	err := exp.Send(context.Background(), h)
	var refused *handoff.RefusedError
	require.ErrorAs(t, err, &refused)
	assert.ErrorIs(t, err, kvcache.ErrIncompleteTransfer)
	assert.Equal(t, 3, h.n, "the sender wrote past the revoke")
	require.Eventually(t, func() bool { return refusedBy(recv, "incomplete_transfer") == 1 }, 10*time.Second, time.Millisecond)
	require.NoError(t, exp.Abort())
	require.NoError(t, testkit.Sweep(prefill))
	require.NoError(t, testkit.Sweep(decode))
}

// rawServer serves connections with serve instead of a receiver's Serve.
func rawServer(t *testing.T, serve func(ctx context.Context, ep handoff.Endpoint) error, opts ucxx.Options) *ucxx.Transport {
	srv, err := ucxx.NewRawServer(serve, opts)
	require.NoError(t, err)
	t.Cleanup(func() { srv.Close() })
	addr, err := srv.Listen("127.0.0.1:0")
	require.NoError(t, err)
	return dial(t, addr)
}

// exposeOne is a raw server's transfer that exposes mem, sends the
// description (changed by change, if set) and waits for the sender's end.
func exposeOne(mem []byte, change func([]byte) []byte) func(ctx context.Context, ep handoff.Endpoint) error {
	return func(ctx context.Context, ep handoff.Endpoint) error {
		desc, revoke, err := ep.(handoff.MemoryEndpoint).ExposeMemory([][]byte{mem})
		if err != nil {
			return err
		}
		defer revoke()
		if change != nil {
			desc = change(desc)
		}
		if err := ep.Send(desc); err != nil {
			return err
		}
		for {
			if _, err := ep.Recv(); err != nil {
				return nil
			}
		}
	}
}

// A put outside the memory the receiver granted is refused before
// anything is posted, naming the cause; the writer and the connection
// stay usable, and a put inside lands: by UCX's puts, or by rendezvous
// over TCP alone.
func TestPutOutsideTheGrant(t *testing.T) {
	mem := make([]byte, 4096)
	tr := rawServer(t, exposeOne(mem, nil), ucxx.Options{})
	st, err := tr.Open(context.Background())
	require.NoError(t, err)
	defer st.Close()
	desc, err := st.Recv()
	require.NoError(t, err)
	w, err := st.(handoff.MemoryStream).OpenRemote(desc, []int64{int64(len(mem))})
	require.NoError(t, err)
	src := []byte("sixteen bytes!!!")
	for _, put := range []handoff.RemotePut{
		{Mem: 0, Off: 4090, Src: [][]byte{src}},
		{Mem: 0, Off: -1, Src: [][]byte{src}},
		{Mem: 1, Off: 0, Src: [][]byte{src}},
		{Mem: 0, Off: 4080, Src: [][]byte{src, src}},
	} {
		_, err := w.Write([]handoff.RemotePut{{Mem: 0, Off: 0, Src: [][]byte{src}}, put})
		assert.ErrorIs(t, err, handoff.ErrProtocol, "%+v", put)
		assert.ErrorContains(t, err, "outside the memory the receiver granted")
	}
	assert.Equal(t, make([]byte, len(src)), mem[:len(src)], "a refused batch wrote its first put")
	wait, err := w.Write([]handoff.RemotePut{{Mem: 0, Off: 4080, Src: [][]byte{src}}})
	require.NoError(t, err)
	require.NoError(t, wait())
	assert.Equal(t, src, mem[4080:])
	require.NoError(t, w.Close())
}

// A description whose remote key is cut short, or of more or fewer
// extents than the grant names, is refused by OpenRemote.
func TestRemoteKeyThatDoesNotUnpack(t *testing.T) {
	mem := make([]byte, 4096)
	for name, change := range map[string]func([]byte) []byte{
		"a key cut short":       func(d []byte) []byte { return d[:len(d)-1] },
		"a key of no bytes":     func(d []byte) []byte { return append(d[:8:8], 0, 0) },
		"a second extent":       func(d []byte) []byte { return append(d, d...) },
		"no extent":             func([]byte) []byte { return nil },
		"a key length past end": func(d []byte) []byte { d[8], d[9] = 0xff, 0xff; return d },
	} {
		t.Run(name, func(t *testing.T) {
			var receives atomic.Bool
			tr := rawServer(t, exposeOne(mem, func(d []byte) []byte {
				if d[0] != 'p' {
					receives.Store(true)
					return d
				}
				return change(d)
			}), ucxx.Options{})
			st, err := tr.Open(context.Background())
			require.NoError(t, err)
			defer st.Close()
			desc, err := st.Recv()
			require.NoError(t, err)
			if receives.Load() {
				t.Skip("no remote keys: over TCP alone the writes go by rendezvous")
			}
			_, err = st.(handoff.MemoryStream).OpenRemote(desc, []int64{int64(len(mem))})
			assert.ErrorIs(t, err, handoff.ErrProtocol)
		})
	}
}

// A write that a sender sends by rendezvous outside the memory the
// receiver exposed (past an extent's end, into an extent that does not
// exist), or after the receiver took the memory back, is never received:
// the receiver's connection fails naming the cause (a late write is
// released unread, and the sender's send fails), and the memory holds
// only what was written inside it.
func TestWriteOutsideTheExposedMemory(t *testing.T) {
	src := []byte("sixteen bytes!!!")
	for name, forge := range map[string]func(st handoff.Stream) error{
		"past the end":          func(st handoff.Stream) error { return ucxx.ForgeWrite(st, 0, 4090, src) },
		"a second extent":       func(st handoff.Stream) error { return ucxx.ForgeWrite(st, 1, 0, src) },
		"an offset past it":     func(st handoff.Stream) error { return ucxx.ForgeWrite(st, 0, 1<<40, src) },
		"after the revoke":      nil,
		"one byte past the end": func(st handoff.Stream) error { return ucxx.ForgeWrite(st, 0, 4096, src[:1]) },
	} {
		t.Run(name, func(t *testing.T) {
			mem := make([]byte, 4096)
			failed := make(chan error, 1)
			revoked := make(chan struct{})
			tr := rawServer(t, func(ctx context.Context, ep handoff.Endpoint) error {
				desc, revoke, err := ep.(handoff.MemoryEndpoint).ExposeMemory([][]byte{mem})
				if err != nil {
					return err
				}
				if err := ep.Send(desc); err != nil {
					revoke()
					return err
				}
				if forge == nil { // the memory goes back before the sender writes
					_, err := ep.Recv() // the sender is ready
					revoke()
					close(revoked)
					if err == nil {
						_, err = ep.Recv()
					}
					failed <- err
					return nil
				}
				for {
					if _, err := ep.Recv(); err != nil {
						revoke()
						failed <- err
						return nil
					}
				}
			}, ucxx.Options{})
			st, err := tr.Open(context.Background())
			require.NoError(t, err)
			defer st.Close()
			desc, err := st.Recv()
			require.NoError(t, err)
			if desc[0] != 'r' {
				st.Close()
				t.Skip("writes go by rendezvous over TCP alone; here by UCX's puts")
			}
			require.NoError(t, ucxx.ForgeWrite(st, 0, 16, src), "a write inside the memory")
			if forge == nil {
				require.NoError(t, st.Send([]byte("ready")))
				<-revoked
				ucxx.ForgeWrite(st, 0, 32, src) // released unread: UCX ends the send either way
				st.Close()
				<-failed
				assert.Equal(t, src, mem[16:32])
				assert.Equal(t, make([]byte, len(mem)-32), mem[32:], "a write landed after the revoke")
				return
			}
			forge(st)
			err = <-failed
			assert.ErrorIs(t, err, handoff.ErrProtocol)
			assert.ErrorContains(t, err, "outside the memory exposed")
			assert.Equal(t, src, mem[16:32])
			assert.Equal(t, make([]byte, len(mem)), append(append([]byte{}, mem[:16]...), append(make([]byte, 16), mem[32:]...)...),
				"a write outside landed")
		})
	}
}

// peer starts the other process of a two-process test (internal/peer)
// with args, and returns its stdin, a line reader of its stdout and the
// process.
func peer(t *testing.T, args ...string) (io.WriteCloser, func() string, *exec.Cmd) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds and runs a helper binary")
	}
	bin := filepath.Join(t.TempDir(), "peer")
	build := exec.Command(goTool(t), "build", "-tags", "ucx", "-o", bin, "github.com/kvfence/kvfence/handoff/ucxx/internal/peer")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "%s", out)
	cmd := exec.Command(bin, args...)
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		stdin.Close()
		cmd.Process.Kill()
		cmd.Wait()
	})
	lines := bufio.NewScanner(stdout)
	next := func() string {
		require.True(t, lines.Scan(), "peer exited: %v", lines.Err())
		return lines.Text()
	}
	return stdin, next, cmd
}

func goTool(t *testing.T) string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	p := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(p); err != nil {
		t.Skip("no go command to build the helper")
	}
	return p
}

// Real page bytes cross to a decode pool in another OS process, in its
// memory, and that process's pool is audited; a replay is refused across
// processes.
func TestTwoProcesses(t *testing.T) {
	stdin, next, _ := peer(t, "-role", "decode", "-pages", "4096")
	ask := func(cmd string) string {
		_, err := io.WriteString(stdin, cmd+"\n")
		require.NoError(t, err)
		return next()
	}
	addr, ok := strings.CutPrefix(next(), "addr ")
	require.True(t, ok)
	prefill := newPool(t, 2048)
	tr := dial(t, addr)
	s := newSender(t)
	for _, tc := range []struct {
		id     string
		prompt int
	}{{"first", 1}, {"second", 16}, {"third", 1500*16 + 7}} {
		exp := export(t, s, prefill, tc.id, tc.prompt)
		require.NoError(t, exp.Send(context.Background(), tr))
		assert.False(t, exp.Live())
		assert.Equal(t, "ok "+tc.id+" prefilled "+strconv.Itoa(tc.prompt), ask("take "+tc.id))
	}
	exp := export(t, s, prefill, "first", 1)
	assert.ErrorIs(t, exp.Send(context.Background(), tr), handoff.ErrReplay)
	require.NoError(t, exp.Abort())
	// The receiver counts the refusal once its verdict is out.
	require.Eventually(t, func() bool { return ask("stats") == "ok imported 3 refused 1" }, 10*time.Second, time.Millisecond)
	assert.Equal(t, "ok sweep", ask("sweep"))
	require.NoError(t, testkit.Sweep(prefill))
}

// The decode process killed in the middle of the writes: the sender's
// Send fails with ErrTransport within seconds (the connection the ends
// met over closes with the process), every page it lent is given back,
// and the export stays pinned for a retry.
func TestKilledDecodePeer(t *testing.T) {
	_, next, cmd := peer(t, "-role", "decode", "-pages", "4096")
	addr, ok := strings.CutPrefix(next(), "addr ")
	require.True(t, ok)
	prefill := newPool(t, 2048)
	exp := export(t, newSender(t), prefill, "orphan", 1500*16)
	h := &hooked{inner: dial(t, addr), before: func(n int) {
		if n == 3 {
			require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
		}
	}}
	start := time.Now()
	err := exp.Send(context.Background(), h)
	assert.ErrorIs(t, err, handoff.ErrTransport)
	assert.Less(t, time.Since(start), 10*time.Second, "the sender took this long to notice")
	assert.True(t, exp.Live(), "the pages stay pinned for a retry")
	require.NoError(t, exp.Abort())
	require.NoError(t, testkit.Sweep(prefill))
}

// The prefill process dies right after it posted a chunk of writes, their
// bytes in flight (over TCP, rendezvous messages whose receives the
// decode side has posted or is about to; over shared memory, emulated
// puts): this process, the decode side, carries on (UCX's put handler
// would have aborted it over TCP, where ucxx therefore never puts), fails
// the import as a transport failure within seconds, ends the receives
// with the connection's worker, and scrubs the pages: the decode pool
// ends clean. Run twice: the second import's connection is served by a
// worker of the server's like the first's.
func TestPrefillPeerDiesMidWrite(t *testing.T) {
	decode := newPool(t, 4096)
	recv, srv, _ := serve(t, handoff.ReceiverConfig{Pool: decode}, ucxx.Options{})
	addr, err := srv.Listen("127.0.0.1:0") // a second listener, for the peer
	require.NoError(t, err)
	for i := 1; i <= 2; i++ {
		_, next, cmd := peer(t, "-role", "prefill", "-addr", addr, "-prompt", strconv.Itoa(1500*16), "-stall", "3", "-die")
		require.Equal(t, "dying", next())
		cmd.Wait()
		require.Eventually(t, func() bool { return refusedBy(recv, "transport") == uint64(i) }, 10*time.Second, time.Millisecond,
			"the receiver did not fail the import: %+v", recv.Stats())
		require.Eventually(t, func() bool { return decode.Stats().InUsePages == 0 }, 10*time.Second, time.Millisecond)
		_, ok := recv.Take("killed")
		assert.False(t, ok)
		require.NoError(t, testkit.Sweep(decode))
	}
}

// The prefill process killed in the middle of its writes: the receiver
// fails the import as a transport failure within seconds, takes its
// memory back and scrubs it: the decode pool ends clean.
func TestKilledPrefillPeer(t *testing.T) {
	decode := newPool(t, 4096)
	recv, srv, _ := serve(t, handoff.ReceiverConfig{Pool: decode}, ucxx.Options{})
	addr, err := srv.Listen("127.0.0.1:0") // a second listener, for the peer
	require.NoError(t, err)
	_, next, cmd := peer(t, "-role", "prefill", "-addr", addr, "-prompt", strconv.Itoa(1500*16), "-stall", "3")
	require.Equal(t, "stalled", next())
	require.Positive(t, decode.Stats().InUsePages, "the import holds its pages while the sender stalls")
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	require.Eventually(t, func() bool { return refusedBy(recv, "transport") == 1 }, 10*time.Second, time.Millisecond,
		"the receiver did not fail the import: %+v", recv.Stats())
	require.Eventually(t, func() bool { return decode.Stats().InUsePages == 0 }, 10*time.Second, time.Millisecond)
	_, ok := recv.Take("killed")
	assert.False(t, ok)
	require.NoError(t, testkit.Sweep(decode))
}
