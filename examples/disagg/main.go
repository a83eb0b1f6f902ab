// Command disagg runs a prefill pool and a decode pool in two processes on
// loopback and hands a prompt's KV from one to the other over gRPC (or
// handoff/tcpx's own frames over TCP, with -transport tcpx; over UCX with
// -transport ucx, the decode pool's pages then written with RMA puts), then replays
// the incident kvfence exists for: an over-long prompt on a prefill pool
// too small for the model's context window.
//
//	go run ./examples/disagg
//	go run ./examples/disagg -transport tcpx
//	go run -tags ucx ./examples/disagg -transport ucx   # cgo, libucx-dev
//	go run ./examples/disagg -model glm-5.3-flash
//
// With -model, the pools hold a miniature of a model preset's caches
// (kvcache.Preset, CacheSpec.Miniature: every group, the first layer of
// each, at a fraction of the bytes). -model glm-5.3-flash is the
// incident's own deployment: a hybrid of MLA latents and a sparse
// indexer per token, and a Kimi Delta Attention state slot per request,
// all of which the handoff moves; the decode process then proves that
// its lease holds exactly the prefill's bytes in every group.
//
// The program re-executes itself with -role=decode for the decode process
// and drives it over its stdin; every step is printed.
package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"os/exec"
	"strings"
	"time"

	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/grpcx"
	"github.com/kvfence/kvfence/handoff/tcpx"
	"github.com/kvfence/kvfence/handoff/ucxx"
	"github.com/kvfence/kvfence/kvcache"
)

// A small page (1 layer, 1 KV head of 8 dims, fp16, 16 tokens: 512 bytes)
// so that the incident's pool sizes fit in a few tens of MB of RAM.
var geometry = kvcache.Geometry{TokensPerPage: 16, Layers: 1, KVHeads: 1, HeadDim: 8, DType: kvcache.FP16}

const (
	contextWindow = 1_048_576
	prefillTokens = 681_280 // the incident's prefill pool
	decodeTokens  = 1_120_000
	// A model preset's pools keep the first layer of each group at
	// 1/miniShrink of its bytes, and hold state slots (or window rings)
	// for maxLeases requests at once.
	miniShrink = 64
	maxLeases  = 8
)

func main() {
	role := flag.String("role", "prefill", "prefill (starts the decode process) or decode")
	secret := flag.String("key", "", "hex HMAC key shared by the pools (the prefill process makes one)")
	transport := flag.String("transport", "grpc", "how the KV travels: grpc (handoff/grpcx), tcpx (handoff/tcpx) or ucx (handoff/ucxx, built with -tags ucx)")
	model := flag.String("model", "", "a model preset whose caches (a miniature of them) the pools hold, e.g. glm-5.3-flash; "+
		"empty: one small K/V group")
	flag.Parse()
	log.SetFlags(0)
	var err error
	switch {
	case *transport != "grpc" && *transport != "tcpx" && *transport != "ucx":
		err = fmt.Errorf("-transport %q: want grpc, tcpx or ucx", *transport)
	case *role == "decode":
		err = decode(*secret, *transport, *model)
	default:
		err = prefill(*transport, *model)
	}
	if err != nil {
		log.Fatalf("%s: %v", *role, err)
	}
}

// newPool makes a pool of about tokens tokens: of the small geometry, or
// of a miniature of model's caches.
func newPool(model string, tokens int, undersized bool) (*kvcache.Pool, error) {
	cfg := kvcache.Config{
		MaxContextTokens: contextWindow, AllowUndersizedPool: undersized,
		Tenants: []kvcache.TenantConfig{{Name: "acme"}, {Name: "globex"}},
	}
	if model == "" {
		cfg.Geometry, cfg.Pages = geometry, tokens/geometry.TokensPerPage
		return kvcache.New(cfg)
	}
	spec, err := miniature(model)
	if err != nil {
		return nil, err
	}
	cfg.Cache, cfg.Pages = spec, tokens/spec.TokensPerPage()
	if len(spec.Groups) > 1 {
		cfg.MaxLeases = maxLeases
	}
	return kvcache.New(cfg)
}

// miniature is the spec of model's miniature.
func miniature(model string) (kvcache.CacheSpec, error) {
	full, err := kvcache.Preset(model)
	if err != nil {
		return kvcache.CacheSpec{}, err
	}
	return full.Miniature(1, miniShrink)
}

func keyFrom(secretHex string) (*handoff.Key, error) {
	secret, err := hex.DecodeString(secretHex)
	if err != nil {
		return nil, err
	}
	return handoff.NewKey(secret)
}

// serve serves handoffs to recv on loopback over the transport named,
// until the returned stop is called, and returns its address. Plain TCP
// (and UCX's bytes unencrypted): this example runs on loopback.
func serve(recv *handoff.Receiver, transport string) (addr string, stop func(), err error) {
	if transport == "ucx" {
		srv, err := ucxx.NewServer(recv, ucxx.Options{})
		if err != nil {
			return "", nil, err
		}
		addr, err := srv.Listen("127.0.0.1:0")
		if err != nil {
			srv.Close()
			return "", nil, err
		}
		return addr, func() { srv.Close() }, nil
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	if transport == "tcpx" {
		srv, err := tcpx.NewServer(recv, tcpx.Insecure(), tcpx.Options{})
		if err != nil {
			ln.Close()
			return "", nil, err
		}
		go srv.Serve(ln)
		return ln.Addr().String(), func() { srv.Close() }, nil
	}
	srv, err := grpcx.NewServer(recv, insecure.NewCredentials())
	if err != nil {
		ln.Close()
		return "", nil, err
	}
	go srv.Serve(ln)
	return ln.Addr().String(), srv.Stop, nil
}

// dial connects to the decode process's server over the transport named.
func dial(addr, transport string) (handoff.Transport, func() error, error) {
	if transport == "ucx" {
		tr, err := ucxx.Dial(addr, ucxx.Options{})
		if err != nil {
			return nil, nil, err
		}
		return tr, tr.Close, nil
	}
	if transport == "tcpx" {
		tr, err := tcpx.Dial(addr, tcpx.Insecure(), tcpx.Options{})
		if err != nil {
			return nil, nil, err
		}
		return tr, tr.Close, nil
	}
	tr, err := grpcx.Dial(addr, insecure.NewCredentials())
	if err != nil {
		return nil, nil, err
	}
	return tr, tr.Close, nil
}

// decode serves imports and answers "take ID" and "stats" on stdin.
func decode(secretHex, transport, model string) error {
	key, err := keyFrom(secretHex)
	if err != nil {
		return err
	}
	pool, err := newPool(model, decodeTokens, false)
	if err != nil {
		return err
	}
	defer pool.Close()
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: pool, Key: key})
	if err != nil {
		return err
	}
	addr, stop, err := serve(recv, transport)
	if err != nil {
		return err
	}
	defer stop()
	fmt.Printf("decode pool: %d pages (%d tokens), serving handoffs on %s over %s\n", pool.Pages(), pool.CapacityTokens(), addr, transport)
	fmt.Println("addr", addr)
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		cmd, id, _ := strings.Cut(in.Text(), " ")
		switch cmd {
		case "take":
			l, ok := recv.Take(id)
			if !ok {
				fmt.Printf("no usable lease for %q\n", id)
				break
			}
			table, _ := l.BlockTable()
			fmt.Printf("imported %q: phase %v, %d prompt tokens written, %d pages reserved (prompt + %d new tokens); decoding…\n",
				id, l.Phase(), l.Written(), len(table), l.MaxNewTokens())
			sum, err := promptDigest(pool, l)
			if err != nil {
				return err
			}
			fmt.Printf("digest %s\n", sum)
			if err := l.Release(); err != nil {
				return err
			}
			fmt.Printf("released %q: its pages were scrubbed\n", id)
		case "stats":
			s := pool.Stats()
			fmt.Printf("decode stats: %d imported, %d refused; %d pages in use; Check: %v\n",
				recv.Stats().Imported, recv.Stats().Refused, s.InUsePages, pool.Check())
		}
		fmt.Println("done")
	}
	return in.Err()
}

func prefill(transport, model string) error {
	secret := make([]byte, 32)
	rand.Read(secret)
	self, err := os.Executable()
	if err != nil {
		return err
	}
	child := exec.Command(self, "-role=decode", "-key="+hex.EncodeToString(secret), "-transport="+transport, "-model="+model)
	child.Stderr = os.Stderr
	toChild, _ := child.StdinPipe()
	fromChild, _ := child.StdoutPipe()
	if err := child.Start(); err != nil {
		return err
	}
	defer child.Wait()
	defer toChild.Close()
	lines := bufio.NewScanner(fromChild)
	// relay prints the decode process's lines up to its "done" (or
	// "addr"), and returns the address or the digest it reported.
	relay := func(cmd string) string {
		if cmd != "" {
			io.WriteString(toChild, cmd+"\n")
		}
		var got string
		for lines.Scan() {
			line := lines.Text()
			if line == "done" {
				return got
			}
			if addr, ok := strings.CutPrefix(line, "addr "); ok {
				return addr
			}
			if d, ok := strings.CutPrefix(line, "digest "); ok {
				got = d
			}
			fmt.Println("  [decode]", line)
		}
		return got
	}
	addr := relay("")

	key, err := keyFrom(hex.EncodeToString(secret))
	if err != nil {
		return err
	}
	pool, err := newPool(model, prefillTokens, true)
	if err != nil {
		return err
	}
	defer pool.Close()
	fmt.Printf("prefill pool: %d pages (%d tokens) for a %d-token context window: undersized, allowed explicitly\n",
		pool.Pages(), pool.CapacityTokens(), contextWindow)
	if model != "" {
		fmt.Printf("model: a miniature of %s (the first layer of each group, 1/%d of the bytes); cache groups:", model, miniShrink)
		for _, g := range pool.Stats().Groups {
			fmt.Printf(" %s (%v, %d of %d bytes)", g.Name, g.Kind, g.Pages, g.PageBytes)
		}
		fmt.Println()
	}
	sender, err := handoff.NewSender(handoff.SenderConfig{Key: key, TTL: 30 * time.Second})
	if err != nil {
		return err
	}
	tr, closeTransport, err := dial(addr, transport)
	if err != nil {
		return err
	}
	defer closeTransport()
	ctx := context.Background()

	fmt.Println("\n1. A normal request: 5,000 prompt tokens, up to 1,000 new.")
	lease, err := pool.Admit(ctx, kvcache.Request{ID: "req-ok", Tenant: "acme", PromptTokens: 5_000})
	if err != nil {
		return err
	}
	fmt.Printf("   admitted: %d pages, phase %v\n", lease.Pages(), lease.Phase())
	lease.BeginPrefill()
	lease.Commit(5_000)
	if err := writePrompt(pool, lease); err != nil {
		return err
	}
	if err := lease.FinishPrefill(); err != nil {
		return err
	}
	sent, err := promptDigest(pool, lease)
	if err != nil {
		return err
	}
	fmt.Printf("   prefill wrote %d tokens in every cache group: phase %v, digest %s\n", lease.Written(), lease.Phase(), sent)
	exp, err := sender.Export(lease, 1_000)
	if err != nil {
		return err
	}
	m := exp.Manifest()
	fmt.Printf("   exported: manifest for %q of tenant %q in sharing domain %q, %d units, expires in %v, signed (HMAC-SHA256);\n",
		m.RequestID, m.Tenant, m.Domain, m.Units(), time.Until(m.Expires).Round(time.Second))
	for i, e := range exp.Extents() {
		fmt.Printf("     group %q (%v): %d units of %d bytes from logical page %d\n", pool.Spec().Groups[i].Name, e.Kind, e.Units, e.UnitBytes, e.First)
	}
	fmt.Println("   the content checksum is summed as the units are sent and sealed after them (HMAC-SHA256, same key)")
	if err := exp.Send(ctx, tr); err != nil {
		return err
	}
	fmt.Printf("   sent over %s and acknowledged; prefill pages released and scrubbed: %v\n", transport, !lease.Live())
	if got := relay("take req-ok"); got != sent {
		return fmt.Errorf("the decode lease holds other bytes than the prefill's: digest %s, sent %s", got, sent)
	}
	fmt.Println("   the decode lease holds exactly the prefill's bytes, in every cache group (the digests match)")

	fmt.Printf("\n2. The incident: a 700,000-token prompt on the %d-token prefill pool.\n", pool.CapacityTokens())
	_, err = pool.Admit(ctx, kvcache.Request{ID: "req-long", Tenant: "globex", PromptTokens: 700_000})
	var ae *kvcache.AdmissionError
	if !errors.As(err, &ae) {
		return fmt.Errorf("the over-long prompt was not refused: %v", err)
	}
	fmt.Printf("   refused at admission: %v\n", err)
	fmt.Printf("   permanent: %v; no lease, so no pages, no manifest, nothing to send\n", ae.Permanent())

	fmt.Println("\n3. A placeholder: a lease for 20,000 tokens whose prefill wrote one.")
	ph, err := pool.Admit(ctx, kvcache.Request{ID: "req-long", Tenant: "globex", PromptTokens: 20_000})
	if err != nil {
		return err
	}
	ph.BeginPrefill()
	ph.Commit(1)
	_, err = sender.Export(ph, 1_000)
	fmt.Printf("   export refused: %v\n", err)
	ph.Release()
	relay("take req-long")

	fmt.Println("\n4. Audit.")
	fmt.Printf("   prefill: %d pages in use, Check: %v\n", pool.Stats().InUsePages, pool.Check())
	relay("stats")
	return nil
}

// writePrompt stands in for the prefill kernels: it writes the prompt's
// cache in every group, each page (slot) with bytes of its own: the
// per-token pages, the window's pages at the prompt's end (the windows
// slid there first, as an engine's do), the state slot.
func writePrompt(p *kvcache.Pool, l *kvcache.Lease) error {
	if _, err := l.SlideWindows(cudaops.Ordering{}); err != nil {
		return err
	}
	spec := p.Spec()
	for gi, e := range spec.HandoffExtents(l.PromptTokens()) {
		for j := range e.Units {
			for r, reg := range spec.Groups[gi].Regions {
				page := make([]byte, reg.PageBytes)
				for k := range page {
					page[k] = byte(gi*31 + (e.First+j)*7 + r*3 + k)
				}
				if err := l.WritePage(e.Group, j, r, page); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// promptDigest is a SHA-256 over the prompt's cache in lease l, every
// group's units in handoff order: what a handoff must deliver unchanged.
func promptDigest(p *kvcache.Pool, l *kvcache.Lease) (string, error) {
	h := sha256.New()
	spec := p.Spec()
	for gi, e := range spec.HandoffExtents(l.PromptTokens()) {
		for j := range e.Units {
			for r, reg := range spec.Groups[gi].Regions {
				page := make([]byte, reg.PageBytes)
				if err := l.ReadPage(e.Group, j, r, page); err != nil {
					return "", err
				}
				h.Write(page)
			}
		}
	}
	return hex.EncodeToString(h.Sum(nil)[:8]), nil
}
