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
// Prometheus collector registered and scraped every 10 ms.
//
// The paired cases are the comparisons to read: a plain pool and an
// observed (or drained) one side by side in one process, one cycle of
// each per iteration (in alternating order), each timed, so that both
// see the same load on a shared machine at the grain of a cycle. They
// report each one's ns/cycle and x-plain, observed ÷ plain; ns/op is the
// pair's. The separate plain and observed cases run one after the other,
// seconds apart, and their ratio swings with whatever else the machine
// runs meanwhile. What a pair does not separate is the observers' own
// goroutines (publisher, subscriber, scrapes: paired-drained has almost
// none), which run beside both pools' cycles alike; their CPU is in the
// separate cases' cpu-ns/op.
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
// The prefix=tokens cases carry the prompts' token IDs instead of their
// keys (the pool hashes them), and their observed pools publish them
// (kvcache.PrefixConfig.EventTokens, kvevents' token_ids); tokens+curve
// publishes them over CURVE to a CURVE subscriber. Their plain pools are
// given the same requests, so that x-plain is what the events cost.
//
// cpu-ns/op is the process's CPU time (user and system, every thread)
// per cycle: on a machine with cores to spare observed can match plain
// in ns/op while its publisher's CPU shows here.
func BenchmarkAdmitReleaseObserved(b *testing.B) {
	for _, bc := range []struct {
		name     string
		prefix   prefixMode
		drain    drainMode
		observed bool
	}{
		{"prefix=none/plain", noPrefix, noDrain, false}, {"prefix=none/observed", noPrefix, noDrain, true},
		{"prefix=publish/plain", keysPrefix, noDrain, false}, {"prefix=publish/drained", keysPrefix, drainWindow, false},
		{"prefix=publish/drained-woken", keysPrefix, drainEach, false}, {"prefix=publish/observed", keysPrefix, noDrain, true},
		{"prefix=tokens/plain", tokensPrefix, noDrain, false}, {"prefix=tokens/observed", tokensPrefix, noDrain, true},
		{"prefix=tokens+curve/observed", tokensCurvePrefix, noDrain, true},
	} {
		b.Run(bc.name, func(b *testing.B) {
			r := newObservedRig(b, bc.prefix, bc.drain, bc.observed)
			defer r.close()
			b.ReportAllocs()
			cpu0 := processCPU()
			for b.Loop() {
				r.cycle(b)
			}
			b.StopTimer()
			if cpu := processCPU(); cpu > 0 {
				b.ReportMetric(float64(cpu-cpu0)/float64(b.N), "cpu-ns/op")
			}
			r.finish(b)
		})
	}
	for _, pc := range []struct {
		name     string
		prefix   prefixMode
		drain    drainMode
		observed bool
	}{
		{"prefix=none/paired", noPrefix, noDrain, true},
		{"prefix=publish/paired-drained", keysPrefix, drainWindow, false},
		{"prefix=publish/paired", keysPrefix, noDrain, true},
		{"prefix=tokens/paired-drained", tokensPrefix, drainWindow, false},
		{"prefix=tokens+curve/paired", tokensCurvePrefix, noDrain, true},
	} {
		b.Run(pc.name, func(b *testing.B) {
			plainPrefix := pc.prefix
			if plainPrefix == tokensCurvePrefix {
				plainPrefix = tokensPrefix // the same requests; CURVE is the observer's
			}
			plain, observed := newObservedRig(b, plainPrefix, noDrain, false), newObservedRig(b, pc.prefix, pc.drain, pc.observed)
			defer plain.close()
			defer observed.close()
			var plainTime, observedTime time.Duration
			timed := func(r *observedRig, sum *time.Duration) {
				t0 := time.Now()
				r.cycle(b)
				*sum += time.Since(t0)
			}
			b.ReportAllocs()
			odd := false
			for b.Loop() {
				if odd {
					timed(observed, &observedTime)
					timed(plain, &plainTime)
				} else {
					timed(plain, &plainTime)
					timed(observed, &observedTime)
				}
				odd = !odd
			}
			b.StopTimer()
			b.ReportMetric(float64(plainTime.Nanoseconds())/float64(b.N), "plain-ns/cycle")
			b.ReportMetric(float64(observedTime.Nanoseconds())/float64(b.N), "observed-ns/cycle")
			b.ReportMetric(observedTime.Seconds()/plainTime.Seconds(), "x-plain")
			plain.finish(b)
			observed.finish(b)
		})
	}
}

// prefixMode is what an observedRig's requests carry, and how its
// observer publishes.
type prefixMode int

const (
	noPrefix          prefixMode = iota
	keysPrefix                   // the prompts' page keys
	tokensPrefix                 // the prompts' token IDs, published as token_ids when observed
	tokensCurvePrefix            // the same, published over CURVE
)

// drainMode is how an observedRig without a publisher consumes its
// pool's events.
type drainMode int

const (
	noDrain     drainMode = iota
	drainWindow           // what has arrived, once a millisecond
	drainEach             // ranging over the channel
)

// observedRig is one pool of BenchmarkAdmitReleaseObserved, with what
// observes it, and the requests it cycles through.
type observedRig struct {
	p        *kvcache.Pool
	prefix   prefixMode
	drain    drainMode
	observed bool
	keys     [][]kvcache.BlockKey // one prompt's pages' keys each
	toks     [][]int32            // one prompt's tokens each
	next     int                  // the prompt of the next cycle
	cycles   int
	l        kvcache.Lease
	before   kvcache.Stats

	pub  *kvevents.Publisher
	conn net.Conn             // the subscriber's, over NULL
	sub  *kvevents.Subscriber // the subscriber, over CURVE
	stop chan struct{}
	wg   sync.WaitGroup
	// Set by the consumers, read once they are done (wg).
	received, drainedEvents uint64
}

func newObservedRig(b *testing.B, prefix prefixMode, drain drainMode, observed bool) *observedRig {
	const (
		tpp     = 16
		pages   = 1024
		prompt  = 2048
		prompts = 16 // 16 × 128 pages: twice the pool
	)
	geom := kvcache.Geometry{TokensPerPage: tpp, Layers: 4, KVHeads: 8, HeadDim: 128, DType: kvcache.BF16}
	r := &observedRig{prefix: prefix, drain: drain, observed: observed, stop: make(chan struct{})}
	dev := discardFills{cudaops.NewHost()}
	b.Cleanup(func() { dev.Close() })
	cfg := kvcache.Config{Geometry: geom, Pages: pages, MaxContextTokens: pages * tpp, Device: dev,
		Tenants: []kvcache.TenantConfig{{Name: "bench"}}}
	if drain != noDrain || observed {
		cfg.Prefix.EventBuffer = 1 << 14
		cfg.Prefix.EventTokens = prefix >= tokensPrefix
	}
	p, err := kvcache.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	r.p = p
	r.keys = make([][]kvcache.BlockKey, prompts)
	r.toks = make([][]int32, prompts)
	for i := range r.keys {
		r.toks[i] = tokens(i*prompt, prompt)
		if r.keys[i], err = p.PageKeys("bench", "", r.toks[i], nil); err != nil {
			b.Fatal(err)
		}
	}
	if drain != noDrain {
		r.wg.Add(1)
		go r.drainEvents()
	}
	if observed {
		pcfg := kvevents.Config{Endpoint: "tcp://127.0.0.1:0"}
		var client *kvevents.ClientCurve
		if prefix == tokensCurvePrefix {
			serverPub, serverSec, err := kvevents.NewCurveKeyPair()
			if err != nil {
				b.Fatal(err)
			}
			clientPub, clientSec, err := kvevents.NewCurveKeyPair()
			if err != nil {
				b.Fatal(err)
			}
			pcfg.Curve = &kvevents.CurveConfig{SecretKey: serverSec, Clients: []kvevents.CurveKey{clientPub}}
			client = &kvevents.ClientCurve{ServerKey: serverPub, SecretKey: clientSec}
		}
		if r.pub, err = kvevents.New(p, pcfg); err != nil {
			b.Fatal(err)
		}
		if client != nil {
			if r.sub, err = kvevents.DialSubscriber("tcp://"+r.pub.Addr().String(), "", client, 10*time.Second); err != nil {
				b.Fatal(err)
			}
			for r.pub.Stats().Subscribers == 0 {
				time.Sleep(time.Millisecond)
			}
		} else if r.conn, err = dialDiscarding(r.pub.Addr().String()); err != nil {
			b.Fatal(err)
		}
		reg := prometheus.NewRegistry()
		if err := reg.Register(metrics.NewCollector(p, metrics.Options{Events: r.pub})); err != nil {
			b.Fatal(err)
		}
		r.wg.Add(2)
		go func() { // the router, on another host in production: it only reads
			defer r.wg.Done()
			if r.sub != nil { // decrypting what it reads
				for {
					_, _, payload, err := r.sub.Recv()
					if err != nil {
						return
					}
					r.received += uint64(len(payload))
				}
			}
			n, _ := io.Copy(io.Discard, r.conn)
			r.received = uint64(n)
		}()
		go func() { // Prometheus
			defer r.wg.Done()
			t := time.NewTicker(10 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-r.stop:
					return
				case <-t.C:
					if _, err := reg.Gather(); err != nil {
						panic(err)
					}
				}
			}
		}()
	}
	r.before = p.Stats()
	return r
}

// drainEvents is a consumer that costs nothing but its receives.
func (r *observedRig) drainEvents() {
	defer r.wg.Done()
	if r.drain == drainEach {
		for ev := range r.p.Events() {
			r.p.ReturnEventKeys(ev.Keys)
			r.p.ReturnEventTokens(ev.TokenIDs)
			r.drainedEvents++
		}
		return
	}
	for {
		time.Sleep(time.Millisecond)
	receive:
		for {
			select {
			case ev, ok := <-r.p.Events():
				if !ok {
					return
				}
				r.p.ReturnEventKeys(ev.Keys)
				r.p.ReturnEventTokens(ev.TokenIDs)
				r.drainedEvents++
			default:
				break receive
			}
		}
	}
}

// cycle admits one request, publishes its prompt if the rig's requests
// carry keys, and releases it.
func (r *observedRig) cycle(b *testing.B) {
	const prompt = 2048
	req := kvcache.Request{ID: "req", Tenant: "bench", PromptTokens: prompt}
	switch r.prefix {
	case keysPrefix:
		req.PageKeys = r.keys[r.next]
	case tokensPrefix, tokensCurvePrefix:
		req.TokenIDs = r.toks[r.next]
	}
	r.next = (r.next + 1) % len(r.keys)
	if err := r.p.TryAdmitInto(req, &r.l); err != nil {
		b.Fatal(err)
	}
	if r.prefix != noPrefix {
		if err := r.l.Commit(prompt); err != nil {
			b.Fatal(err)
		}
		if _, err := r.l.CachePrefix(prompt); err != nil {
			b.Fatal(err)
		}
	}
	if err := r.l.Release(); err != nil {
		b.Fatal(err)
	}
	r.cycles++
}

// finish checks the pool's books after the cycles and that every event
// reached its consumer, then stops the consumers.
func (r *observedRig) finish(b *testing.B) {
	p := r.p
	s := p.Stats()
	if s.Admitted-r.before.Admitted != uint64(r.cycles) || s.LiveLeases != 0 || s.FreePages+s.CachedPages != s.TotalPages {
		b.Fatalf("after %d cycles: %d admitted, %d live, %d free + %d cached of %d", r.cycles, s.Admitted-r.before.Admitted,
			s.LiveLeases, s.FreePages, s.CachedPages, s.TotalPages)
	}
	if err := p.Check(); err != nil {
		b.Fatal(err)
	}
	close(r.stop)
	if r.drain != noDrain {
		if s.Prefix.EventsDropped != 0 {
			b.Fatalf("the pool dropped %d of %d events", s.Prefix.EventsDropped, s.Prefix.EventsSent)
		}
		p.Close() // ends the drain, after its own events (the cache's eviction)
		r.wg.Wait()
		if sent := p.Stats().Prefix.EventsSent; r.drainedEvents != sent {
			b.Fatalf("the pool sent %d events, %d were received", sent, r.drainedEvents)
		}
	}
	if r.observed {
		// Every event the pool produced was published; none was
		// lost between the pool and the publisher.
		deadline := time.Now().Add(30 * time.Second)
		for r.pub.Stats().Events != s.Prefix.EventsSent && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		ps := r.pub.Stats()
		if ps.Events != s.Prefix.EventsSent || s.Prefix.EventsDropped != 0 || ps.Lost != 0 {
			b.Fatalf("pool sent %d events (%d dropped), publisher published %d (lost %d)",
				s.Prefix.EventsSent, s.Prefix.EventsDropped, ps.Events, ps.Lost)
		}
		b.ReportMetric(float64(ps.Batches), "batches")
		r.pub.Close()
		r.wg.Wait()
		if ps.Batches > 0 && r.received == 0 {
			b.Fatalf("the subscriber received nothing of %d batches", ps.Batches)
		}
	}
}

// close frees what finish did not: the publisher and subscriber if the
// benchmark failed before, and the pool.
func (r *observedRig) close() {
	if r.pub != nil {
		r.pub.Close()
	}
	if r.conn != nil {
		r.conn.Close()
	}
	if r.sub != nil {
		r.sub.Close()
	}
	r.p.Close()
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
