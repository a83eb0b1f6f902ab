// Command peer is the decode side of the two-process handoff test: a
// decode pool behind a gRPC handoff server on loopback. It prints
// "addr HOST:PORT", then answers commands on stdin, one per line:
//
//	take ID   verify the imported lease's bytes, release it: "ok …" or "err …"
//	sweep     audit the idle pool (Check, canaries, no tenant bytes left)
//	stats     print the receiver's counters
//
// and exits at end of input.
package main

import (
	"flag"
	"fmt"
	"net"
	"os"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/grpcx"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

func main() {
	pages := flag.Int("pages", 4096, "decode pool pages")
	flag.Parse()
	if err := run(*pages); err != nil {
		fmt.Println("err", err)
		os.Exit(1)
	}
}

func run(pages int) error {
	pool, err := testkit.NewPool(testkit.PoolConfig{Pages: pages, Tenants: []kvcache.TenantConfig{{Name: "victim"}, {Name: "other"}}})
	if err != nil {
		return err
	}
	defer pool.Close()
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: pool, Key: testkit.Key()})
	if err != nil {
		return err
	}
	srv, err := grpcx.NewServer(recv, insecure.NewCredentials())
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go srv.Serve(ln)
	defer srv.Stop()
	fmt.Println("addr", ln.Addr())

	return testkit.ServeCommands(os.Stdin, os.Stdout, pool, recv)
}
