package metrics_test

import (
	"encoding/binary"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
	"github.com/kvfence/kvfence/kvevents"
	"github.com/kvfence/kvfence/metrics"
)

// discardFills is a device whose fills touch no memory, so that the
// benchmark measures admission and release, not the fill (as
// kvcache's BenchmarkAdmitRelease/fill=excluded does).
type discardFills struct{ *cudaops.Host }

func (d discardFills) Fill(pages []int32, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	return cudaops.Completed(nil), nil
}

// BenchmarkAdmitReleaseObserved admits and releases 2,048-token requests
// (128 pages of 16 tokens) in a 1,024-page pool. With prefix=none they
// carry no prefix material, as kvcache's BenchmarkAdmitRelease; with
// prefix=publish they carry the page keys of 16 prompts in turn, are
// committed and published, so that every cycle stores a prompt and
// evicts an older one: two events of 128 keys. "plain" has no observer:
// no event channel, no collector, no publisher. "observed" has all of
// them: a publisher in vLLM's format with a subscriber reading it, and a
// Prometheus collector registered and scraped every 10 ms. Compare ns/op
// in the same run.
//
// Two more cases (prefix=publish only) take the pool's side of the events
// apart from the rest: the channel is on, and a goroutine receives from
// it and does nothing else but hand each event's keys back
// (Pool.ReturnEventKeys, as the publisher does). In "drained" it receives what has arrived
// once a millisecond, as the publisher does under load (its
// Config.BatchWindow), so drained ÷ plain is what building and sending
// the events costs the pool, and observed ÷ drained what the publisher,
// the subscriber and the collector add. In "drained-woken" it ranges over
// the channel, parked whenever it is empty, so that every event the pool
// sends wakes it: the cost of a consumer that waits on the channel.
//
// cpu-ns/op is the process's CPU time (user and system, every thread)
// per cycle: on a machine with cores to spare observed can match plain
// in ns/op while its publisher's CPU shows here.
func BenchmarkAdmitReleaseObserved(b *testing.B) {
	const (
		tpp     = 16
		pages   = 1024
		prompt  = 2048
		prompts = 16 // 16 × 128 pages: twice the pool
	)
	geom := kvcache.Geometry{TokensPerPage: tpp, Layers: 4, KVHeads: 8, HeadDim: 128, DType: kvcache.BF16}
	const (
		noDrain = iota
		drainWindow
		drainEach
	)
	for _, bc := range []struct {
		name     string
		prefix   bool
		drain    int
		observed bool
	}{
		{"prefix=none/plain", false, noDrain, false}, {"prefix=none/observed", false, noDrain, true},
		{"prefix=publish/plain", true, noDrain, false}, {"prefix=publish/drained", true, drainWindow, false},
		{"prefix=publish/drained-woken", true, drainEach, false}, {"prefix=publish/observed", true, noDrain, true},
	} {
		prefix, drain, observed := bc.prefix, bc.drain, bc.observed
		b.Run(bc.name, func(b *testing.B) {
			dev := discardFills{cudaops.NewHost()}
			defer dev.Close()
			cfg := kvcache.Config{Geometry: geom, Pages: pages, MaxContextTokens: pages * tpp, Device: dev,
				Tenants: []kvcache.TenantConfig{{Name: "bench"}}}
			if drain != noDrain || observed {
				cfg.Prefix.EventBuffer = 1 << 14
			}
			p, err := kvcache.New(cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			keys := make([][]kvcache.BlockKey, prompts)
			for i := range keys {
				toks := make([]int32, prompt)
				for j := range toks {
					toks[j] = int32(i*prompt + j)
				}
				if keys[i], err = p.PageKeys("bench", "", toks, nil); err != nil {
					b.Fatal(err)
				}
			}

			var pub *kvevents.Publisher
			stop := make(chan struct{})
			var wg sync.WaitGroup
			var received, drainedEvents uint64
			if drain != noDrain {
				wg.Add(1)
				go func() { // a consumer that costs nothing but its receives
					defer wg.Done()
					if drain == drainEach {
						for ev := range p.Events() {
							p.ReturnEventKeys(ev.Keys)
							drainedEvents++
						}
						return
					}
					for {
						time.Sleep(time.Millisecond)
					receive:
						for {
							select {
							case ev, ok := <-p.Events():
								if !ok {
									return
								}
								p.ReturnEventKeys(ev.Keys)
								drainedEvents++
							default:
								break receive
							}
						}
					}
				}()
			}
			if observed {
				pub, err = kvevents.New(p, kvevents.Config{Endpoint: "tcp://127.0.0.1:0"})
				if err != nil {
					b.Fatal(err)
				}
				defer pub.Close()
				conn, err := dialDiscarding(pub.Addr().String())
				if err != nil {
					b.Fatal(err)
				}
				defer conn.Close()
				wg.Add(2)
				go func() { // the router, on another host in production: it only reads
					defer wg.Done()
					n, _ := io.Copy(io.Discard, conn)
					received = uint64(n)
				}()
				reg := prometheus.NewRegistry()
				if err := reg.Register(metrics.NewCollector(p, metrics.Options{Events: pub})); err != nil {
					b.Fatal(err)
				}
				go func() { // Prometheus
					defer wg.Done()
					t := time.NewTicker(10 * time.Millisecond)
					defer t.Stop()
					for {
						select {
						case <-stop:
							return
						case <-t.C:
							if _, err := reg.Gather(); err != nil {
								panic(err)
							}
						}
					}
				}()
			}

			var l kvcache.Lease
			before := p.Stats()
			i := 0
			b.ReportAllocs()
			cpu0 := processCPU()
			for b.Loop() {
				req := kvcache.Request{ID: "req", Tenant: "bench", PromptTokens: prompt}
				if prefix {
					req.PageKeys = keys[i%prompts]
					i++
				}
				if err := p.TryAdmitInto(req, &l); err != nil {
					b.Fatal(err)
				}
				if prefix {
					if err := l.Commit(prompt); err != nil {
						b.Fatal(err)
					}
					if _, err := l.CachePrefix(prompt); err != nil {
						b.Fatal(err)
					}
				}
				if err := l.Release(); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			if cpu := processCPU(); cpu > 0 {
				b.ReportMetric(float64(cpu-cpu0)/float64(b.N), "cpu-ns/op")
			}
			close(stop)
			s := p.Stats()
			if s.Admitted-before.Admitted != uint64(b.N) || s.LiveLeases != 0 || s.FreePages+s.CachedPages != pages {
				b.Fatalf("after %d cycles: %d admitted, %d live, %d free + %d cached", b.N, s.Admitted-before.Admitted,
					s.LiveLeases, s.FreePages, s.CachedPages)
			}
			if err := p.Check(); err != nil {
				b.Fatal(err)
			}
			if drain != noDrain {
				if s.Prefix.EventsDropped != 0 {
					b.Fatalf("the pool dropped %d of %d events", s.Prefix.EventsDropped, s.Prefix.EventsSent)
				}
				p.Close() // ends the drain, after its own events (the cache's eviction)
				wg.Wait()
				if sent := p.Stats().Prefix.EventsSent; drainedEvents != sent {
					b.Fatalf("the pool sent %d events, %d were received", sent, drainedEvents)
				}
			}
			if observed {
				// Every event the pool produced was published; none was
				// lost between the pool and the publisher.
				deadline := time.Now().Add(30 * time.Second)
				for pub.Stats().Events != s.Prefix.EventsSent && time.Now().Before(deadline) {
					time.Sleep(time.Millisecond)
				}
				ps := pub.Stats()
				if ps.Events != s.Prefix.EventsSent || s.Prefix.EventsDropped != 0 || ps.Lost != 0 {
					b.Fatalf("pool sent %d events (%d dropped), publisher published %d (lost %d)",
						s.Prefix.EventsSent, s.Prefix.EventsDropped, ps.Events, ps.Lost)
				}
				b.ReportMetric(float64(ps.Batches), "batches")
				pub.Close()
				wg.Wait()
				if ps.Batches > 0 && received == 0 {
					b.Fatalf("the subscriber received nothing of %d batches", ps.Batches)
				}
			}
		})
	}
}

// dialDiscarding connects a ZMTP SUB socket subscribed to everything and
// returns its connection, from which a reader discards the batches.
func dialDiscarding(addr string) (net.Conn, error) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	var g [64]byte
	g[0], g[9], g[10] = 0xff, 0x7f, 3
	copy(g[12:], "NULL")
	ready := append([]byte{5}, "READY"...)
	ready = append(ready, 11)
	ready = append(ready, "Socket-Type"...)
	ready = binary.BigEndian.AppendUint32(ready, 3)
	ready = append(ready, "SUB"...)
	msg := append(g[:], 0x04, byte(len(ready)))
	msg = append(msg, ready...)
	msg = append(msg, 0x00, 1, 1) // subscribe to everything
	if _, err := c.Write(msg); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// BenchmarkCollect is one scrape: "gather" gathers a registry holding the
// collector (with a publisher's figures) over a pool of N tenants, each
// in its own domain with a few pages cached; "stats" is the part of it
// that holds the pool's lock, one Pool.Stats.
func BenchmarkCollect(b *testing.B) {
	for _, tenants := range []int{1, 64} {
		cfg := kvcache.Config{Geometry: kvcache.Geometry{TokensPerPage: 4, Layers: 1, KVHeads: 1, HeadDim: 8, DType: kvcache.BF16},
			Pages: 16 * tenants, MaxContextTokens: 64, Prefix: kvcache.PrefixConfig{EventBuffer: 1024}}
		for i := range tenants {
			cfg.Tenants = append(cfg.Tenants, kvcache.TenantConfig{Name: "t" + strconv.Itoa(i)})
		}
		p, err := kvcache.New(cfg)
		if err != nil {
			b.Fatal(err)
		}
		defer p.Close()
		pub, err := kvevents.New(p, kvevents.Config{Endpoint: "tcp://127.0.0.1:0"})
		if err != nil {
			b.Fatal(err)
		}
		defer pub.Close()
		for i, t := range cfg.Tenants {
			l, err := p.TryAdmit(kvcache.Request{ID: t.Name, Tenant: t.Name, PromptTokens: 16, TokenIDs: tokens(16*i, 16)})
			if err != nil {
				b.Fatal(err)
			}
			if err := l.Commit(16); err != nil {
				b.Fatal(err)
			}
			if _, err := l.CachePrefix(16); err != nil {
				b.Fatal(err)
			}
			if err := l.Release(); err != nil {
				b.Fatal(err)
			}
		}
		reg := prometheus.NewRegistry()
		if err := reg.Register(metrics.NewCollector(p, metrics.Options{Events: pub, TenantLabels: true})); err != nil {
			b.Fatal(err)
		}
		b.Run("tenants="+strconv.Itoa(tenants)+"/gather", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := reg.Gather(); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("tenants="+strconv.Itoa(tenants)+"/stats", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if s := p.Stats(); len(s.Tenants) != tenants {
					b.Fatalf("%d tenants", len(s.Tenants))
				}
			}
		})
	}
}
