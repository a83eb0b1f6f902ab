// Command router runs two pods' kvfence pools under a small synthetic
// multi-tenant load, exposes them the way operators and KV-aware routers
// expect, and runs the router side too: the pools' Prometheus metrics on
// /metrics, structured logs (log/slog, JSON) on stderr, each pool's
// prefix-cache events in vLLM's KV-event format on a ZeroMQ PUB socket
// (with token_ids, so that routers that derive their own keys index
// them), vLLM's replay socket next to it, and a router-side index fed by
// both streams the way llm-d's indexer is (internal/routerindex).
//
//	go run ./examples/router -metrics 127.0.0.1:9400 -events tcp://127.0.0.1:5557 -replay tcp://127.0.0.1:5558
//	curl -s 127.0.0.1:9400/metrics | grep -E '^(vllm|kvfence)_'
//
// pod-a serves the acme domain (tenants acme-support and acme-sales), pod-b
// tenant globex (a domain of its own); both get the same system prompts.
// Every second the router scores each tenant's system prompts against the
// index and logs the pod it picks: pod-a for acme's, pod-b for globex's,
// and none for a tenant of a third domain, whose requests are salted with
// a domain no pod has cached. -events and -replay are pod-a's endpoints,
// pod-b's the next port (as vLLM offsets them by data-parallel rank; port
// 0 takes any free one). -curve secures both sockets of both pods with
// CURVE and has the router connect with a key pair of its own.
// -duration stops the program; 0 runs until interrupted. -help lists every
// flag.
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
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvfence/kvfence/internal/routerindex"
	"github.com/kvfence/kvfence/kvcache"
	"github.com/kvfence/kvfence/kvevents"
	"github.com/kvfence/kvfence/metrics"
)

const (
	model         = "demo-model"
	tokensPerPage = 16
)

// The pods, and the tenants each serves.
var pods = []struct {
	name    string
	tenants []kvcache.TenantConfig
}{
	{"pod-a", []kvcache.TenantConfig{
		{Name: "acme-support", Domain: "acme", QuotaPages: 1024, ReservedPages: 128},
		{Name: "acme-sales", Domain: "acme", QuotaPages: 1024},
	}},
	{"pod-b", []kvcache.TenantConfig{{Name: "globex", QuotaPages: 1536}}},
}

func main() {
	fs := flag.NewFlagSet("router", flag.ContinueOnError)
	metricsAddr := fs.String("metrics", "127.0.0.1:9400", "`address` to serve /metrics on")
	events := fs.String("events", "tcp://127.0.0.1:5557", "ZeroMQ `endpoint` pod-a's KV-event PUB socket binds (tcp://HOST:PORT or ipc://PATH); pod-b's is the next port")
	replay := fs.String("replay", "tcp://127.0.0.1:5558", "ZeroMQ `endpoint` of pod-a's replay ROUTER socket, pod-b's the next port; empty for none")
	encoding := fs.String("encoding", "array", "KV-event encoding: array (vLLM's array_like: llm-d, vLLM's example subscriber) or map (current vLLM); the router here reads array")
	curve := fs.Bool("curve", false, "secure the sockets with CURVE; the router connects with a key pair of its own")
	tenantLabels := fs.Bool("tenant-labels", false, "add per-tenant metric series")
	rate := fs.Float64("rate", 50, "synthetic requests per `second`")
	duration := fs.Duration("duration", 0, "stop after this long; 0 runs until interrupted")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: router [flags]\n\n"+
			"Runs two pods' kvfence pools under a synthetic load (pod-a: domain acme, two tenants;\n"+
			"pod-b: tenant globex), serves their Prometheus metrics on -metrics at /metrics, publishes\n"+
			"their KV events in vLLM's format (ZMQ PUB, msgpack, token_ids) on -events, replays on\n"+
			"-replay, and routes each tenant's prompts with an index fed by the events.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		os.Exit(2)
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	if err := run(log, *metricsAddr, *events, *replay, *encoding, *curve, *tenantLabels, *rate, *duration); err != nil {
		log.Error("router example failed", slog.Any("error", err))
		os.Exit(1)
	}
}

// offset is endpoint with its port moved up by n (port 0 stays 0).
func offset(endpoint string, n int) (string, error) {
	if endpoint == "" || n == 0 || !strings.HasPrefix(endpoint, "tcp://") {
		return endpoint, nil
	}
	i := strings.LastIndexByte(endpoint, ':')
	port, err := strconv.Atoi(endpoint[i+1:])
	if err != nil {
		return "", fmt.Errorf("endpoint %q: %w", endpoint, err)
	}
	if port == 0 {
		return endpoint, nil
	}
	return endpoint[:i+1] + strconv.Itoa(port+n), nil
}

func run(log *slog.Logger, metricsAddr, events, replay, encoding string, curve, tenantLabels bool,
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
	var server *kvevents.CurveConfig
	var client *kvevents.ClientCurve
	if curve {
		serverPub, serverSec, err := kvevents.NewCurveKeyPair()
		if err != nil {
			return err
		}
		clientPub, clientSec, err := kvevents.NewCurveKeyPair()
		if err != nil {
			return err
		}
		server = &kvevents.CurveConfig{SecretKey: serverSec, Clients: []kvevents.CurveKey{clientPub}}
		client = &kvevents.ClientCurve{ServerKey: serverPub, SecretKey: clientSec}
		log.Info("CURVE on", slog.String("server_public_key", serverPub.String()), slog.String("router_public_key", clientPub.String()))
	}

	reg := prometheus.NewRegistry()
	idx := routerindex.New(tokensPerPage, "")
	pools := map[string]*kvcache.Pool{}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, duration)
		defer cancel()
	}
	var pubs []*kvevents.Publisher
	for i, pod := range pods {
		pool, err := kvcache.New(kvcache.Config{
			Geometry:         kvcache.Geometry{TokensPerPage: tokensPerPage, Layers: 2, KVHeads: 2, HeadDim: 64, DType: kvcache.BF16},
			Pages:            2048,
			MaxContextTokens: 8192,
			Tenants:          pod.tenants,
			// EventTokens: token_ids on the wire, for routers that derive
			// their keys from tokens. They are the tenants' prompts: bind
			// the sockets where only routers reach them, or use -curve.
			Prefix: kvcache.PrefixConfig{EventBuffer: 4096, EventTokens: true},
			Logger: log.With(slog.String("pod", pod.name)),
		})
		if err != nil {
			return err
		}
		defer pool.Close()
		pools[pod.name] = pool
		ev, err := offset(events, i)
		if err != nil {
			return err
		}
		rp, err := offset(replay, i)
		if err != nil {
			return err
		}
		topic := "kv@" + pod.name + "@" + model
		pub, err := kvevents.New(pool, kvevents.Config{Endpoint: ev, ReplayEndpoint: rp, Topic: topic, Encoding: enc,
			Curve: server, Logger: log.With(slog.String("pod", pod.name))})
		if err != nil {
			return err
		}
		defer pub.Close()
		pubs = append(pubs, pub)
		if err := reg.Register(metrics.NewCollector(pool, metrics.Options{TenantLabels: tenantLabels, Events: pub,
			ConstLabels: prometheus.Labels{"model_name": model, "pod": pod.name}})); err != nil {
			return err
		}
		log.Info("pod running", slog.String("pod", pod.name), slog.String("events", pub.Addr().String()),
			slog.String("replay", fmt.Sprint(pub.ReplayAddr())), slog.String("topic", topic))
		if enc == kvevents.ArrayEvents { // the router's index reads the array form, as llm-d's does
			sub, err := kvevents.DialSubscriber("tcp://"+pub.Addr().String(), "kv@", client, 5*time.Second)
			if err != nil {
				return err
			}
			defer sub.Close()
			go func() {
				for {
					topic, _, payload, err := sub.Recv()
					if err != nil {
						return // closed at the end
					}
					if err := idx.Apply(topic, payload); err != nil {
						log.Error("router index", slog.Any("error", err))
					}
				}
			}()
		}
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
	log.Info("router example running", slog.String("metrics", "http://"+ln.Addr().String()+"/metrics"))

	go route(ctx, log, idx, pools)
	load(ctx, pools, rate)
	var admitted, refused, batches uint64
	for _, pool := range pools {
		s := pool.Stats()
		admitted, refused = admitted+s.Admitted, refused+s.Refused.Total()
	}
	for _, pub := range pubs {
		batches += pub.Stats().Batches
	}
	is := idx.Stats()
	log.Info("router example done", slog.Uint64("admitted", admitted), slog.Uint64("refused", refused),
		slog.Uint64("batches_published", batches), slog.Uint64("blocks_indexed", is.Indexed),
		slog.Uint64("blocks_skipped", is.Skipped), slog.Uint64("blocks_removed", is.Removed))
	return nil
}

// tenantDomains are the domains the router knows its tenants by; initech
// sends requests too, but no pod serves its domain.
var tenantDomains = map[string]string{
	"acme-support": "acme", "acme-sales": "acme", "globex": "tenant:globex", "initech": "tenant:initech",
}

// route scores each tenant's system prompts once a second and logs the pod
// the index picks (none when no pod holds the prompt's first block in the
// tenant's domain).
func route(ctx context.Context, log *slog.Logger, idx *routerindex.Index, pools map[string]*kvcache.Pool) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		for _, tenant := range []string{"acme-support", "globex", "initech"} {
			for system := range 4 {
				toks := systemPrompt(system)
				u := make([]uint32, len(toks))
				for i, t := range toks {
					u[i] = uint32(t)
				}
				pod, blocks := idx.Best(idx.Keys(u, model, kvevents.CacheSalt(tenantDomains[tenant])))
				if pod == "" {
					pod = "none"
				}
				log.Info("routed", slog.String("tenant", tenant), slog.String("domain", tenantDomains[tenant]),
					slog.Int("system_prompt", system), slog.String("pod", pod), slog.Int("cached_blocks", blocks))
			}
		}
	}
}

// systemPrompt is one of the system prompts the tenants share.
func systemPrompt(system int) []int32 {
	out := make([]int32, 256*(1+system))
	for i := range out {
		out[i] = int32(system*100_000 + i)
	}
	return out
}

// load sends requests until ctx ends: each tenant draws a system prompt
// from a few (so that prefixes repeat), adds a question, "prefills" it on
// its pod, publishes its prompt pages and holds the lease for a while.
// Some requests are longer than the context window, and are refused.
func load(ctx context.Context, pools map[string]*kvcache.Pool, rate float64) {
	type tenant struct{ name, pod string }
	var tenants []tenant
	for _, pod := range pods {
		for _, tc := range pod.tenants {
			tenants = append(tenants, tenant{tc.Name, pod.name})
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer tick.Stop()
	for n := 0; ; n++ {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		tn := tenants[rng.IntN(len(tenants))]
		prompt := systemPrompt(rng.IntN(4))
		for range rng.IntN(300) {
			prompt = append(prompt, rng.Int32N(50_000))
		}
		maxNew := 256
		if rng.IntN(20) == 0 {
			maxNew = 8192 // over the context window: refused, counted
		}
		l, err := pools[tn.pod].TryAdmit(kvcache.Request{ID: fmt.Sprintf("req-%d", n), Tenant: tn.name,
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
