// Command peer is the other process of ucxx's two-process tests: the
// decode side (a decode pool behind a ucxx server on loopback), or the
// prefill side (a prefill pool whose handoff stalls part way, for the
// test to kill it).
//
// As the decode side (-role decode) it prints "addr HOST:PORT", then
// answers commands on stdin, one per line:
//
//	take ID   verify the imported lease's bytes, release it: "ok …" or "err …"
//	sweep     audit the idle pool (Check, canaries, no tenant bytes left)
//	stats     print the receiver's counters
//
// and exits at end of input. As the prefill side (-role prefill -addr
// HOST:PORT) it exports a prompt of -prompt tokens, sends it, prints
// "stalled" after -stall chunks of writes into the decode pool's memory
// (or data frames), and waits there to be killed; with -die it posts the
// -stall-th chunk and kills itself at once instead, its bytes in flight.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"syscall"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/handoff/ucxx"
	"github.com/kvfence/kvfence/kvcache"
)

var tenants = []kvcache.TenantConfig{{Name: "victim"}, {Name: "other"}}

func main() {
	role := flag.String("role", "decode", "decode or prefill")
	pages := flag.Int("pages", 4096, "the pool's pages")
	addr := flag.String("addr", "", "prefill: the decode server's address")
	prompt := flag.Int("prompt", 2000*16, "prefill: the prompt's tokens")
	stall := flag.Int("stall", 4, "prefill: stall after this many chunks")
	die := flag.Bool("die", false, "prefill: post the -stall-th chunk and die (SIGKILL) instead of stalling")
	flag.Parse()
	var err error
	if *role == "prefill" {
		err = prefill(*pages, *addr, *prompt, *stall, *die)
	} else {
		err = decode(*pages)
	}
	if err != nil {
		fmt.Println("err", err)
		os.Exit(1)
	}
}

func decode(pages int) error {
	pool, err := testkit.NewPool(testkit.PoolConfig{Pages: pages, Tenants: tenants})
	if err != nil {
		return err
	}
	defer pool.Close()
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: pool, Key: testkit.Key()})
	if err != nil {
		return err
	}
	srv, err := ucxx.NewServer(recv, ucxx.Options{})
	if err != nil {
		return err
	}
	defer srv.Close()
	addr, err := srv.Listen("127.0.0.1:0")
	if err != nil {
		return err
	}
	fmt.Println("addr", addr)

	return testkit.ServeCommands(os.Stdin, os.Stdout, pool, recv)
}

func prefill(pages int, addr string, prompt, stall int, die bool) error {
	pool, err := testkit.NewPool(testkit.PoolConfig{Pages: pages, Tenants: tenants})
	if err != nil {
		return err
	}
	defer pool.Close()
	tr, err := ucxx.Dial(addr, ucxx.Options{})
	if err != nil {
		return err
	}
	defer tr.Close()
	s, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key(), FrameBytes: 32 << 10})
	if err != nil {
		return err
	}
	l, err := testkit.Prefill(pool, "killed", "victim", prompt)
	if err != nil {
		return err
	}
	exp, err := s.Export(l, 16)
	if err != nil {
		return err
	}
	return exp.Send(context.Background(), &stalling{inner: tr, after: stall, die: die})
}

// stalling passes a transport's streams on, and stops the sender for
// good at its stall-th page operation (a write into the receiver's
// memory, or a data frame): it waits, or (die) posts the operation and
// kills its process.
type stalling struct {
	inner handoff.Transport
	after int
	die   bool
	n     int
}

func (s *stalling) Open(ctx context.Context) (handoff.Stream, error) {
	st, err := s.inner.Open(ctx)
	if err != nil {
		return nil, err
	}
	return &stallingStream{ViewStream: st.(handoff.ViewStream), s: s}, nil
}

// op counts a page operation, about to be posted: at the stall-th it
// waits to be killed, or reports that the process dies once it is posted.
func (s *stalling) op() (die bool) {
	if s.n++; s.n == s.after {
		if s.die {
			return true
		}
		fmt.Println("stalled")
		select {} // until killed
	}
	return false
}

// dieNow kills the process, as the kernel's OOM killer or a crash would:
// no deferred call runs, and whatever was posted is in flight.
func dieNow() {
	fmt.Println("dying")
	syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}

type stallingStream struct {
	handoff.ViewStream
	s *stalling
}

func (st *stallingStream) SendViews(head []byte, views [][]byte, done func()) error {
	if st.s.op() {
		go st.ViewStream.SendViews(head, views, done)
		dieNow()
	}
	return st.ViewStream.SendViews(head, views, done)
}

func (st *stallingStream) OpenRemote(desc []byte, memBytes []int64) (handoff.RemoteWriter, error) {
	w, err := st.ViewStream.(handoff.MemoryStream).OpenRemote(desc, memBytes)
	if err != nil {
		return nil, err
	}
	return &stallingWriter{RemoteWriter: w, s: st.s}, nil
}

type stallingWriter struct {
	handoff.RemoteWriter
	s *stalling
}

func (w *stallingWriter) Write(puts []handoff.RemotePut) (func() error, error) {
	if w.s.op() {
		w.RemoteWriter.Write(puts) // posted: its bytes are on their way
		dieNow()
	}
	return w.RemoteWriter.Write(puts)
}
