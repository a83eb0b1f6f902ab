// Command router runs a kvfence pool under a small synthetic multi-tenant
// load and exposes it the way operators and KV-aware routers expect: the
// pool's Prometheus metrics on /metrics, structured logs (log/slog, JSON)
// on stderr, and its prefix-cache events in vLLM's KV-event format on a
// ZeroMQ PUB socket, with vLLM's replay socket next to it.
//
//	go run ./examples/router -metrics 127.0.0.1:9400 -events tcp://127.0.0.1:5557 -replay tcp://127.0.0.1:5558
//	curl -s 127.0.0.1:9400/metrics | grep -E '^(vllm|kvfence)_'
//
// A vLLM KV-event subscriber (kvevents/testdata/subscriber.py, or a
// router's) connects to -events. -duration stops the program; 0 runs until
// interrupted. -help lists every flag.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvfence/kvfence/kvcache"
	"github.com/kvfence/kvfence/kvevents"
	"github.com/kvfence/kvfence/metrics"
)

func main() {
	fs := flag.NewFlagSet("router", flag.ContinueOnError)
	metricsAddr := fs.String("metrics", "127.0.0.1:9400", "`address` to serve /metrics on")
	events := fs.String("events", "tcp://127.0.0.1:5557", "ZeroMQ `endpoint` the KV-event PUB socket binds (tcp://HOST:PORT or ipc://PATH)")
	replay := fs.String("replay", "tcp://127.0.0.1:5558", "ZeroMQ `endpoint` of the replay ROUTER socket; empty for none")
	topic := fs.String("topic", "kv@router-example@demo-model", "`topic` of every KV-event message")
	encoding := fs.String("encoding", "array", "KV-event encoding: array (every consumer) or map (current vLLM)")
	tenantLabels := fs.Bool("tenant-labels", false, "add per-tenant metric series")
	rate := fs.Float64("rate", 50, "synthetic requests per `second`")
	duration := fs.Duration("duration", 0, "stop after this long; 0 runs until interrupted")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: router [flags]\n\n"+
			"Runs a kvfence pool under a synthetic load of three tenants (two share a prefix-cache\n"+
			"domain), serves its Prometheus metrics on -metrics at /metrics, and publishes its\n"+
			"KV events in vLLM's format (ZMQ PUB, msgpack) on -events, replays on -replay.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		os.Exit(2)
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	if err := run(log, *metricsAddr, *events, *replay, *topic, *encoding, *tenantLabels, *rate, *duration); err != nil {
		log.Error("router example failed", slog.Any("error", err))
		os.Exit(1)
	}
}

func run(log *slog.Logger, metricsAddr, events, replay, topic, encoding string, tenantLabels bool,
	rate float64, duration time.Duration) error {
	enc := kvevents.ArrayEvents
	switch encoding {
	case "array":
	case "map":
		enc = kvevents.MapEvents
	default:
		return fmt.Errorf("-encoding %q: want array or map", encoding)
	}
	if rate <= 0 {
		return fmt.Errorf("-rate %v: want > 0", rate)
	}
	pool, err := kvcache.New(kvcache.Config{
		Geometry:         kvcache.Geometry{TokensPerPage: 16, Layers: 2, KVHeads: 2, HeadDim: 64, DType: kvcache.BF16},
		Pages:            2048,
		MaxContextTokens: 8192,
		Tenants: []kvcache.TenantConfig{
			{Name: "acme-support", Domain: "acme", QuotaPages: 1024, ReservedPages: 128},
			{Name: "acme-sales", Domain: "acme", QuotaPages: 1024},
			{Name: "globex", QuotaPages: 768},
		},
		Prefix: kvcache.PrefixConfig{EventBuffer: 4096},
		Logger: log,
	})
	if err != nil {
		return err
	}
	defer pool.Close()
	pub, err := kvevents.New(pool, kvevents.Config{Endpoint: events, ReplayEndpoint: replay, Topic: topic, Encoding: enc, Logger: log})
	if err != nil {
		return err
	}
	defer pub.Close()

	reg := prometheus.NewRegistry()
	if err := reg.Register(metrics.NewCollector(pool, metrics.Options{TenantLabels: tenantLabels, Events: pub,
		ConstLabels: prometheus.Labels{"model_name": "demo-model"}})); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", metricsAddr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	defer srv.Close()
	log.Info("router example running", slog.String("metrics", "http://"+ln.Addr().String()+"/metrics"),
		slog.String("events", pub.Addr().String()), slog.String("replay", fmt.Sprint(pub.ReplayAddr())), slog.String("topic", topic))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, duration)
		defer cancel()
	}
	load(ctx, pool, rate)
	s := pool.Stats()
	log.Info("router example done", slog.Uint64("admitted", s.Admitted), slog.Uint64("refused", s.Refused.Total()),
		slog.Uint64("batches_published", pub.Stats().Batches))
	return nil
}

// load sends requests until ctx ends: each tenant draws a system prompt
// from a few (so that prefixes repeat), adds a question, "prefills" it,
// publishes its prompt pages and holds the lease for a while. Some
// requests are longer than the context window, and are refused.
func load(ctx context.Context, pool *kvcache.Pool, rate float64) {
	tenants := []string{"acme-support", "acme-sales", "globex"}
	rng := rand.New(rand.NewPCG(1, 2))
	tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer tick.Stop()
	for n := 0; ; n++ {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		tenant := tenants[rng.IntN(len(tenants))]
		system := rng.IntN(4)
		prompt := make([]int32, 256*(1+system)+rng.IntN(300))
		for i := range prompt {
			if i < 256*(1+system) {
				prompt[i] = int32(system*100_000 + i)
			} else {
				prompt[i] = rng.Int32N(50_000)
			}
		}
		maxNew := 256
		if rng.IntN(20) == 0 {
			maxNew = 8192 // over the context window: refused, counted
		}
		l, err := pool.TryAdmit(kvcache.Request{ID: fmt.Sprintf("req-%d", n), Tenant: tenant,
			PromptTokens: len(prompt), MaxNewTokens: maxNew, TokenIDs: prompt})
		if err != nil {
			continue // refused: the metrics count it by reason
		}
		l.Commit(len(prompt))
		l.CachePrefix(len(prompt))
		hold := time.Duration(rng.IntN(200)) * time.Millisecond
		go func() {
			time.Sleep(hold)
			l.Release()
		}()
	}
}
