package kvsim

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

// Policies are the scrub policies kvbench compares, "none" being the
// unsafe baseline.
var Policies = []string{"zero", "poison", "canary", "none"}

// Baseline is the policy the others are compared against.
const Baseline = "none"

// Sharing-domain layouts a run can use.
const (
	// DomainsPerTenant gives every tenant its own sharing domain (the
	// pool's default): prefixes are shared only among one tenant's
	// requests.
	DomainsPerTenant = "per-tenant"
	// DomainsShared puts each tenant into the domain its trace line names
	// (Tenant.Domain; the synthetic workload's organisations), or its own
	// when it names none.
	DomainsShared = "shared"
)

// DomainModes are the layouts kvbench compares.
var DomainModes = []string{DomainsPerTenant, DomainsShared}

// Sizings a run can use: how admission sizes a lease.
const (
	// SizingFull reserves prompt + output budget at admission (kvcache's
	// SizeFull, the default): a lease never grows, no request is ever
	// preempted.
	SizingFull = "full"
	// SizingOnDemand reserves the prompt and a headroom of output tokens
	// (kvcache's SizeOnDemand); the lease grows a page at a time as the
	// request generates, and a refused growth preempts (see Run).
	SizingOnDemand = "on-demand"
)

// SizingModes are the sizings kvbench compares.
var SizingModes = []string{SizingFull, SizingOnDemand}

// ParsePolicy maps a policy name to the pool's scrub policy; unsafe is
// true for "none", which keeps the zero policy's bookkeeping but runs on a
// device that skips the fills.
func ParsePolicy(name string) (policy isolation.ScrubPolicy, unsafe bool, err error) {
	if name == Baseline {
		return isolation.ScrubPolicy{Kind: isolation.ScrubZero}, true, nil
	}
	kind, err := isolation.ParseScrubKind(name)
	if err != nil {
		return policy, false, fmt.Errorf("%w: unknown policy %q (want %s)", ErrBadConfig, name, strings.Join(Policies, ", "))
	}
	return isolation.ScrubPolicy{Kind: kind}, false, nil
}

// RunConfig is one replay of a trace against one pool.
type RunConfig struct {
	// Geometry is the pool's page shape; Model, instead, runs a pool of
	// a model's cache spec (see ModelPool): set exactly one.
	Geometry   kvcache.Geometry
	Model      *ModelPool
	PoolPages  int
	MaxContext int
	Policy     string
	// Step is the virtual time of one continuous-batching decode step:
	// every running request generates one token per step.
	Step     time.Duration
	MaxBatch int // most requests running at once
	// QueueTimeout drops a request that waited this long (virtual time)
	// for pages.
	QueueTimeout time.Duration
	// Duration is the virtual serving time replayed; at its end live
	// requests are released (counted as shutdown) and queued ones dropped.
	Duration time.Duration
	// Audit checks every reused page, right after admission and before
	// the engine writes, for anything but the policy's scrub pattern.
	Audit bool
	// WriteKV makes the simulated engine write each token's KV (a marker
	// naming its tenant) into the pages, as a real engine would.
	WriteKV bool
	// PrefixCache gives every request the page keys of its prompt's token
	// IDs (see AppendPromptTokens and Pool.PageKeys), so that the pool
	// shares the longest prefix cached in the tenant's domain and the
	// engine skips its prefill (Lease.HitTokens); after prefill the engine
	// publishes the prompt's full pages (Lease.CachePrefix). Off: the
	// pool's prefix cache is disabled and requests carry no keys.
	PrefixCache bool
	// Domains is DomainsPerTenant (also when empty) or DomainsShared.
	Domains string
	// Sizing is SizingFull (also when empty) or SizingOnDemand.
	Sizing string
	// HeadroomTokens is, under SizingOnDemand, the output tokens admission
	// reserves beyond the prompt (0: the prompt alone; its last page may
	// still hold a few output tokens).
	HeadroomTokens int
	// GrowthWatermark is, under SizingOnDemand, the share of the pool that
	// new admissions (re-admissions of preempted requests included) leave
	// free for the growth of running leases (kvcache's
	// Config.GrowthWatermark, 0..kvcache.MaxGrowthWatermark).
	GrowthWatermark float64
	// Seed derives the prompts' token IDs.
	Seed uint64
	// PrefillTokens is the engine's prefill budget per step (chunked
	// prefill): running requests compute their prompts, oldest first, up
	// to this many tokens in all per step; a request whose prompt
	// completes generates its first token in the same step. 0: no limit,
	// every prompt is computed in the step that admits it.
	PrefillTokens int
	// ReportGeometry, when set, is the model whose bytes the result
	// reports (pool, KV written, scrubbed, prefill avoided): the pool is
	// allocated at Geometry, small enough for host memory, and every byte
	// figure is scaled to what the same pages hold at ReportGeometry. It
	// must have Geometry's page size. Fill bandwidths and times stay the
	// host's.
	ReportGeometry *kvcache.Geometry
	// HostTierPages gives the pool a host tier of that many pages
	// (kvcache.HostTierConfig): cached pages the device evicts are kept
	// there and copied back into admissions whose prefix continues there,
	// which counts as hits. 0: none. Preemptions do not swap to it (the
	// simulated engine resumes a request by its page keys alone).
	HostTierPages int
	// HostTierCheckpoints is, with a hybrid Model and a host tier, how
	// many state checkpoints the tier keeps (kvcache.HostTierConfig.
	// Checkpoints): those the device evicts go there and are restored by
	// hits, as pages are onloaded. Required (≥ 1) there, 0 otherwise.
	HostTierCheckpoints int
	// OpenDevice returns the device for one run's pool; nil means a new
	// Host. The run closes it.
	OpenDevice func() (cudaops.Device, error)
	// Progress, if set, is called after every step.
	Progress   func(Progress)
	MaxSamples int // utilisation samples kept (default 1000)

	// afterAdmit, in tests, runs after each admission, before the audit.
	afterAdmit func(s *sim, a *active)
	// onKeys, in tests, runs each time a request's token IDs and page
	// keys are derived.
	onKeys func(r *Request)
	// afterGrow, in tests, runs after each growth that added pages.
	afterGrow func(s *sim, a *active)
	// onEnd, in tests, runs when a request ends for good (completed,
	// aborted, truncated, released at shutdown), before its lease is
	// released.
	onEnd func(s *sim, a *active, how string)
	// afterStep, in tests, runs after every step.
	afterStep func(s *sim)
}

func (c *RunConfig) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrBadConfig, fmt.Sprintf(format, args...))
	}
	if _, _, err := ParsePolicy(c.Policy); err != nil {
		return err
	}
	switch {
	case c.Step <= 0:
		return bad("step %v, want > 0", c.Step)
	case c.Duration <= 0 || c.Duration/c.Step > 100_000_000:
		return bad("duration %v at step %v, want > 0 and at most 1e8 steps", c.Duration, c.Step)
	case c.MaxBatch < 1:
		return bad("max batch %d, want ≥ 1", c.MaxBatch)
	case c.QueueTimeout <= 0:
		return bad("queue timeout %v, want > 0", c.QueueTimeout)
	case c.PoolPages < 1:
		return bad("pool of %d pages", c.PoolPages)
	case c.Domains != "" && !slices.Contains(DomainModes, c.Domains):
		return bad("domains %q, want %s", c.Domains, strings.Join(DomainModes, " or "))
	case c.PrefillTokens < 0:
		return bad("prefill budget of %d tokens per step, want ≥ 0 (0: no limit)", c.PrefillTokens)
	case c.Sizing != "" && !slices.Contains(SizingModes, c.Sizing):
		return bad("sizing %q, want %s", c.Sizing, strings.Join(SizingModes, " or "))
	case c.HeadroomTokens < 0 || c.HeadroomTokens > isolation.MaxHeadroomTokens:
		return bad("headroom of %d tokens, want 0..%d", c.HeadroomTokens, isolation.MaxHeadroomTokens)
	case !(c.GrowthWatermark >= 0 && c.GrowthWatermark <= kvcache.MaxGrowthWatermark): // NaN fails too
		return bad("growth watermark %v, want 0..%v", c.GrowthWatermark, kvcache.MaxGrowthWatermark)
	case c.Sizing != SizingOnDemand && (c.HeadroomTokens != 0 || c.GrowthWatermark != 0):
		return bad("a headroom (%d tokens) or a growth watermark (%v) with %s sizing: they are for %s leases only",
			c.HeadroomTokens, c.GrowthWatermark, SizingFull, SizingOnDemand)
	case c.HostTierCheckpoints != 0 && !(c.Model.Hybrid() && c.HostTierPages > 0):
		return bad("%d host-tier checkpoints without a hybrid model's host tier (host tier of %d pages)", c.HostTierCheckpoints, c.HostTierPages)
	}
	if m := c.Model; m != nil {
		switch {
		case c.Geometry != (kvcache.Geometry{}):
			return bad("a geometry and a model: give one")
		case c.ReportGeometry != nil:
			return bad("a report geometry and a model: a model's bytes are reported at its own size")
		case m.Hybrid() && c.HostTierPages > 0 && c.HostTierCheckpoints < 1:
			return bad("a host tier of %d pages and %d checkpoints on a hybrid model's pool: its prefixes need their state checkpoints, want ≥ 1",
				c.HostTierPages, c.HostTierCheckpoints)
		case m.Hybrid() && c.PrefillTokens > 0 && c.PrefillTokens < m.Spec.TokensPerPage():
			return bad("prefill budget of %d tokens per step on a hybrid model's pool, whose chunks end on pages of %d tokens: want 0 or ≥ a page",
				c.PrefillTokens, m.Spec.TokensPerPage())
		}
		return m.Validate()
	}
	if err := c.Geometry.Validate(); err != nil {
		return err
	}
	if g := c.ReportGeometry; g != nil {
		if err := g.Validate(); err != nil {
			return bad("report geometry: %v", err)
		}
		if g.TokensPerPage != c.Geometry.TokensPerPage {
			return bad("report geometry of %d tokens per page, want the pool's %d", g.TokensPerPage, c.Geometry.TokensPerPage)
		}
	}
	return nil
}

// Progress is where a run stands, given to RunConfig.Progress after every
// step.
type Progress struct {
	Step, Steps   int           // steps done, of all
	Now, Duration time.Duration // virtual time replayed, of all
	Requests      int           // in the trace
	// Done counts the requests that ended: completed, aborted, or dropped
	// (refused for good, or timed out in the queue).
	Done            uint64
	Queued, Running int
	// Refusals counts the admission attempts refused so far, retries
	// included.
	Refusals uint64
}

// markerBit is set in every word the simulated engine writes and clear in
// every scrub word (zero, the dtypes' negative zeros, canaries, whose
// finite mask clears bit 30), so the audit can tell stale KV from a
// scrubbed page and name the tenant it came from.
const markerBit = 0x40000000

func markerWord(tenant int, seq int) uint32 {
	return markerBit | uint32(tenant&0xff)<<16 | uint32(seq&0xffff)
}

// Run replays tr against a fresh pool and returns what it measured. The
// error is an ErrBadConfig, a pool error, or ErrAuditFailed when a safe
// policy handed out a page that was not clean or Check failed; the unsafe
// baseline's stale pages are results, not errors.
func Run(tr *Trace, cfg RunConfig) (*RunResult, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if cfg.MaxSamples <= 0 {
		cfg.MaxSamples = 1000
	}
	policy, unsafe, _ := ParsePolicy(cfg.Policy)
	open := cfg.OpenDevice
	if open == nil {
		open = func() (cudaops.Device, error) { return cudaops.NewHost(), nil }
	}
	base, err := open()
	if err != nil {
		return nil, err
	}
	defer base.Close()
	var dev cudaops.Device = base
	if unsafe {
		dev = unsafeNoScrubDevice{base}
	}
	metered := &meteredDevice{Device: dev}
	if cfg.Domains == "" {
		cfg.Domains = DomainsPerTenant
	}
	tenants := make([]kvcache.TenantConfig, len(tr.Tenants))
	tenantIdx := make(map[string]int, len(tr.Tenants))
	domainOf := make([]string, len(tr.Tenants))
	for i, t := range tr.Tenants {
		tenants[i] = kvcache.TenantConfig{Name: t.Name, QuotaPages: t.QuotaPages, ReservedPages: t.ReservedPages}
		domainOf[i] = isolation.PrivateDomainPrefix + t.Name
		if cfg.Domains == DomainsShared && t.Domain != "" {
			tenants[i].Domain, domainOf[i] = t.Domain, t.Domain
		}
		tenantIdx[t.Name] = i
	}
	if cfg.Sizing == "" {
		cfg.Sizing = SizingFull
	}
	sizing := kvcache.Sizing{Mode: kvcache.SizeFull}
	if cfg.Sizing == SizingOnDemand {
		sizing = kvcache.Sizing{Mode: kvcache.SizeOnDemand, HeadroomTokens: cfg.HeadroomTokens}
	}
	pc := kvcache.Config{
		Pages: cfg.PoolPages, MaxContextTokens: cfg.MaxContext,
		AllowUndersizedPool: true, Tenants: tenants, Scrub: policy, Device: metered,
		Prefix: kvcache.PrefixConfig{Disable: !cfg.PrefixCache},
		Sizing: sizing, GrowthWatermark: cfg.GrowthWatermark,
		HostTier: kvcache.HostTierConfig{Pages: cfg.HostTierPages, Checkpoints: cfg.HostTierCheckpoints, NoSwap: true},
	}
	if m := cfg.Model; m != nil {
		pc.Cache = m.poolSpec()
		if m.Hybrid() {
			pc.MaxLeases = m.MaxLeases
			pc.Prefix.CheckpointSlots, pc.Prefix.MaxCheckpoints = m.CheckpointSlots, m.MaxCheckpoints
		}
	} else {
		pc.Geometry = cfg.Geometry
	}
	pool, err := kvcache.New(pc)
	if err != nil {
		return nil, err
	}
	lay := layoutOf(cfg)
	s := &sim{
		cfg: cfg, tr: tr, pool: pool, dev: metered, tenantIdx: tenantIdx, domainOf: domainOf, lay: lay,
		hybrid: cfg.Model.Hybrid() && cfg.PrefixCache,
		reused: make([]bool, cfg.PoolPages), readmitByDomain: map[string]readmitCount{},
		res: &RunResult{Policy: cfg.Policy, Unsafe: unsafe, Device: metered.Name(), PoolPages: cfg.PoolPages,
			PoolTokens: cfg.PoolPages * lay.tpp, PoolBytes: lay.reportPool, HostPoolBytes: lay.hostPool,
			KVWritesSimulated: cfg.WriteKV, Domains: cfg.Domains, Dropped: map[string]uint64{},
			HostTierPages: cfg.HostTierPages, HostTierTokens: cfg.HostTierPages * lay.tpp, HostTierCheckpoints: cfg.HostTierCheckpoints,
			Sizing: cfg.Sizing, HeadroomTokens: cfg.HeadroomTokens, GrowthWatermark: cfg.GrowthWatermark,
			Growth: GrowthResult{Truncated: map[string]uint64{}}},
	}
	s.served = newBoundIndexFor(tr, cfg)
	s.stateGroups = stateGroupsOf(cfg, lay)
	// The policy's pattern over the pool's element types (the unsafe
	// baseline's is the zero policy's).
	s.spec = pool.FillSpec()
	if unsafe {
		// The safe pools scrubbed every page at creation, which also
		// faulted their memory in; do the same for the baseline behind its
		// back, or its first KV writes would pay the page faults and make
		// scrubbing look cheaper than it is.
		if err := prefault(base, lay, s.spec); err != nil {
			pool.Close()
			return nil, err
		}
	}
	// The pool scrubbed every page at creation; serving figures start after.
	s.scrub0 = pool.Stats().Scrub
	metered.reset()
	if cfg.WriteKV {
		if h, ok := base.(hostMemory); ok {
			s.host = h
		} else {
			s.res.KVWritesSimulated = false // the engine's writes live on the device
		}
	}
	err = s.run()
	closeErr := pool.Close()
	if err == nil && closeErr != nil {
		err = fmt.Errorf("closing pool: %w", closeErr)
	}
	if err != nil {
		return nil, err
	}
	s.finish()
	au := &s.res.Audit
	// Prefix sharing does not depend on scrubbing: a hit page with
	// another domain's KV, or a restored slot without its domain's state,
	// fails even the unsafe baseline.
	if au.Enabled && !au.Passed && (!unsafe || au.ForeignHitPages+au.EmptyHitPages+au.ForeignStateSlots > 0) {
		return s.res, fmt.Errorf("%w: policy %s: %s", ErrAuditFailed, cfg.Policy, au.Summary)
	}
	return s.res, nil
}

// hostMemory is a device whose pages the simulated engine can write in
// place (cudaops.Host).
type hostMemory interface {
	PageBytes(region int, page int32) []byte
}

// queued is a request waiting for admission. With the prefix cache on it
// carries its prompt's page keys from its first admission attempt on, so
// that a request retried every step (a full pool, a full quota) is
// tokenised and hashed once, not once per attempt: on an overloaded pool
// that hashing was nearly all of the run's CPU. The keys depend on the
// tenant's sharing domain, which never changes during a run.
//
// A preempted request waits here too, at the head of the queue, with the
// keys of every token it had computed (its prompt, then the tokens it
// generated): its next admission takes them all as its prompt, so that the
// prefix cache gives back the pages Preempt kept.
type queued struct {
	req   *Request
	since time.Duration
	keys  []kvcache.BlockKey
	keyed bool // keys derived (they may be none: a prompt shorter than a page)
	// resumed: a preempted request, which has generated tokens so far.
	// It is admitted again, never dropped from the queue for waiting.
	resumed   bool
	generated int
}

type active struct {
	req    *Request
	tenant int
	lease  *kvcache.Lease
	table  []int32
	slots  []int32 // its slot in each state group (a hybrid model's pool)
	hit    int     // leading prompt tokens shared from the prefix cache
	// prompt is what this lease was admitted with as its prompt: the
	// request's, or after a preemption its prompt and the tokens it had
	// generated, which it computes again (after the hit) before it
	// generates the next one.
	prompt    int
	written   int // tokens whose KV is in the pages (hit ones included)
	target    int // prompt + tokens generated before the request ends
	generated int // output tokens generated, over all its admissions
	marker    []byte
	// preempted: taken off the batch by a refused growth during this
	// step's decode; the loop drops it when it gets there.
	preempted bool
}

// readmitCount is what re-admissions looked up and hit in one domain, to
// be told apart from the pool's counters (which count every admission).
type readmitCount struct{ lookups, hits uint64 }

type sim struct {
	cfg       RunConfig
	tr        *Trace
	pool      *kvcache.Pool
	dev       *meteredDevice
	host      hostMemory // set when the engine's KV writes are simulated
	spec      cudaops.FillSpec
	scrub0    isolation.ScrubStats // the pool's own scrub at creation, not part of serving
	tenantIdx map[string]int
	domainOf  []string  // tenant index → its sharing domain's name in the pool
	lay       simLayout // what the engine writes into, and the bytes the result reports
	// hybrid: the engine checkpoints its requests' state (a hybrid
	// model's pool with the prefix cache on): ckptCalls calls, ckptTime
	// their wall time; peakState the most state bytes checkpoints held at
	// a sample.
	hybrid      bool
	stateGroups []stateGroup // a hybrid model's state groups, whose slots the engine marks and the audit reads
	stateBuf    []byte
	ckptCalls   uint64
	ckptTime    time.Duration
	peakState   int64
	served      *boundIndex // the prefix bound of the admitted requests, in admission order
	ttft        []time.Duration
	refused     uint64        // admission attempts refused
	done        uint64        // requests completed, aborted or dropped
	endStats    kvcache.Stats // at the end of serving, before Close
	fillTime    time.Duration
	filled      uint64
	fillBuckets []FillBucket
	reused      []bool // page was held by a lease before
	queue       []queued
	running     []*active
	// Concurrency: requests running, summed and at most, over the steps
	// that ran any.
	runningSum      uint64
	runningMax      int
	busySteps       int
	writtenShare    float64 // samples' pages holding written KV, summed (share of the pool)
	inUseShare      float64 // samples' pages held by leases, summed (share of the pool)
	readmitByDomain map[string]readmitCount
	growTime        time.Duration
	preemptTime     time.Duration
	spare           []*active
	tokens          []int32              // scratch: the prompt being hashed into keys
	spareKeys       [][]kvcache.BlockKey // key buffers of requests no longer queued
	now             time.Duration
	lat             []time.Duration
	res             *RunResult

	auditBuf, wantBuf []byte
	auditTime         time.Duration
	sampleTime        time.Duration
	keyTime           time.Duration
	admitTime         time.Duration
	releaseTime       time.Duration
	writeTime         time.Duration
}

func (s *sim) run() error {
	steps := int((s.cfg.Duration + s.cfg.Step - 1) / s.cfg.Step)
	every := max(1, steps/s.cfg.MaxSamples)
	next := 0
	start := time.Now()
	for step := range steps {
		s.now = time.Duration(step) * s.cfg.Step
		for next < len(s.tr.Requests) && s.tr.Requests[next].At <= s.now {
			s.queue = append(s.queue, queued{req: &s.tr.Requests[next], since: s.tr.Requests[next].At})
			s.res.Arrived++
			next++
		}
		if err := s.admit(); err != nil {
			return err
		}
		if n := len(s.running); n > 0 {
			s.runningSum += uint64(n)
			s.busySteps++
			s.runningMax = max(s.runningMax, n)
		}
		if err := s.decode(); err != nil {
			return err
		}
		if step%every == 0 || step == steps-1 {
			s.sample()
		}
		if s.cfg.afterStep != nil {
			s.cfg.afterStep(s)
		}
		if s.cfg.Progress != nil {
			s.cfg.Progress(Progress{Step: step + 1, Steps: steps, Now: s.now + s.cfg.Step, Duration: s.cfg.Duration,
				Requests: len(s.tr.Requests), Done: s.done, Queued: len(s.queue), Running: len(s.running), Refusals: s.refused})
		}
	}
	// Shutdown: the serving window is over.
	s.now = s.cfg.Duration
	for _, a := range s.running {
		s.res.ShutdownReleases++
		if s.cfg.onEnd != nil {
			s.cfg.onEnd(s, a, "shutdown")
		}
		if err := s.release(a); err != nil {
			return err
		}
	}
	s.running = nil
	for _, q := range s.queue {
		if q.resumed {
			s.res.Growth.PreemptedAtEnd++
		} else {
			s.res.Dropped["unserved_at_end"]++
		}
	}
	s.res.Dropped["not_arrived"] += uint64(len(s.tr.Requests) - next)
	wall := time.Since(start)
	s.res.WallSeconds = wall.Seconds()
	s.res.ServingCPUSeconds = (wall - s.auditTime - s.sampleTime).Seconds()
	if err := s.pool.Check(); err != nil {
		return fmt.Errorf("%w: pool Check after the run: %w", ErrAuditFailed, err)
	}
	// The figures end here: Close scrubs the pages still cached, which
	// is not serving (CachedPagesAtEnd counts them).
	s.endStats = s.pool.Stats()
	if got, want := s.res.Growth.Preempted, s.endStats.Growth.Preempted; got != want {
		return fmt.Errorf("%w: the engine preempted %d leases, the pool counts %d", ErrAuditFailed, got, want)
	}
	s.fillTime, s.filled = s.dev.totals()
	s.fillBuckets = s.dev.report()
	for _, g := range s.lay.groups {
		s.res.BytesScrubbed += s.dev.unitsFilled(g.first) * uint64(g.report)
	}
	return nil
}

// reason names a refusal sentinel in reports.
func reason(err error) string {
	for _, r := range []struct {
		err  error
		name string
	}{
		{kvcache.ErrExceedsCapacity, "exceeds_capacity"},
		{kvcache.ErrExceedsMaxContext, "exceeds_max_context"},
		{kvcache.ErrExceedsQuota, "exceeds_quota"},
		{kvcache.ErrPoolExhausted, "pool_exhausted"},
		{kvcache.ErrInvalidRequest, "invalid_request"},
		{kvcache.ErrUnknownTenant, "unknown_tenant"},
		{kvcache.ErrDuplicateRequest, "duplicate_request"},
		{kvcache.ErrPoolFaulted, "pool_faulted"},
	} {
		if errors.Is(err, r.err) {
			return r.name
		}
	}
	return "other"
}

// admit tries queued requests in arrival order, preempted ones first
// (they are put back at the head of the queue). A request the pool cannot
// take now for lack of pages holds the queue (first come, first served); a
// request over its tenant's quota waits without holding the others.
func (s *sim) admit() error {
	kept := s.queue[:0]
	for _, q := range s.queue {
		if !q.resumed && s.now-q.since > s.cfg.QueueTimeout {
			s.res.Dropped["queue_timeout"]++
			s.done++
			s.recycleKeys(&q)
			continue
		}
		kept = append(kept, q)
	}
	clear(s.queue[len(kept):])
	s.queue = kept
	i := 0
	for i < len(s.queue) && len(s.running) < s.cfg.MaxBatch {
		q := &s.queue[i]
		req := kvcache.Request{ID: q.req.ID, Tenant: q.req.Tenant, PromptTokens: q.req.Prompt, MaxNewTokens: q.req.MaxNew}
		if q.resumed {
			// Everything it computed is its prompt now; the rest of its
			// budget is what it may still generate.
			req.PromptTokens += q.generated
			req.MaxNewTokens -= q.generated
		}
		if s.cfg.PrefixCache {
			if err := s.deriveKeys(q); err != nil {
				return err
			}
			req.PageKeys = q.keys
		}
		a := s.newActive(q.req)
		start := time.Now()
		// TryAdmitInto, not AdmitInto: an engine's scheduler asks and
		// moves on, it does not park its loop inside the pool; the queue
		// above is where requests wait.
		err := s.pool.TryAdmitInto(req, a.lease)
		took := time.Since(start)
		s.admitTime += took
		if err == nil {
			s.lat = append(s.lat, took)
			qq := *q
			s.dequeue(i) // the lease holds a copy of the keys
			if err := s.start(a, &qq, len(req.PageKeys)); err != nil {
				return err
			}
			continue
		}
		s.spare = append(s.spare, a)
		s.refused++
		var ae *kvcache.AdmissionError
		switch {
		case errors.Is(err, kvcache.ErrCanaryMismatch):
			// The pool's own canary audit caught a written free page:
			// it retired the page and faulted (the refusal is an
			// ErrPoolFaulted caused by the mismatch, so this comes
			// before the refusals). Record it and carry on.
			s.res.Audit.PoolCanaryFaults++
			if len(s.res.Audit.Examples) < maxAuditExamples {
				s.res.Audit.Examples = append(s.res.Audit.Examples, err.Error())
			}
			s.pool.ClearFault()
			return nil
		case errors.As(err, &ae) && ae.Retryable():
			if errors.Is(err, kvcache.ErrPoolExhausted) {
				return nil
			}
			i++
		case errors.As(err, &ae) && q.resumed:
			// Admitted before, refused for good now (its computed
			// tokens and headroom outgrew the pool or the quota): it
			// ends with the tokens it generated.
			s.res.Growth.Truncated[reason(err)]++
			s.done++
			s.dequeue(i)
		case errors.As(err, &ae):
			s.res.Dropped[reason(err)]++
			s.done++
			s.dequeue(i)
		default:
			return fmt.Errorf("admitting %s (trace line %d): %w", q.req.ID, q.req.Line, err)
		}
	}
	return nil
}

// deriveKeys tokenises q's prompt and hashes it into the page keys the
// pool would derive for it (Pool.PageKeys), once: a request that waits
// keeps its keys. A request of a tenant the pool does not know gets none,
// nor does one longer than the context window or the pool, as an engine
// would not hash a prompt it cannot serve: admission refuses them for
// good.
func (s *sim) deriveKeys(q *queued) error {
	if q.keyed {
		return nil
	}
	q.keyed = true
	if _, ok := s.tenantIdx[q.req.Tenant]; !ok {
		return nil
	}
	if !admissible(q.req, s.cfg) {
		return nil
	}
	start := time.Now()
	s.tokens = AppendPromptTokens(s.tokens[:0], s.cfg.Seed, q.req, s.tr.BlockTokens)
	var buf []kvcache.BlockKey
	if n := len(s.spareKeys); n > 0 {
		buf, s.spareKeys = s.spareKeys[n-1], s.spareKeys[:n-1]
	}
	keys, err := s.pool.PageKeys(q.req.Tenant, "", s.tokens, buf)
	s.keyTime += time.Since(start)
	if err != nil {
		return fmt.Errorf("deriving the page keys of %s (trace line %d): %w", q.req.ID, q.req.Line, err)
	}
	q.keys = keys
	s.res.Prefix.KeyDerivations++
	if s.cfg.onKeys != nil {
		s.cfg.onKeys(q.req)
	}
	return nil
}

// dequeue removes the i-th queued request, keeping its key buffer for the
// next request to hash.
func (s *sim) dequeue(i int) {
	s.recycleKeys(&s.queue[i])
	s.queue = slices.Delete(s.queue, i, i+1)
}

func (s *sim) recycleKeys(q *queued) {
	if cap(q.keys) > 0 {
		s.spareKeys = append(s.spareKeys, q.keys[:0])
	}
	q.keys = nil
}

func (s *sim) newActive(r *Request) *active {
	var a *active
	if n := len(s.spare); n > 0 {
		a, s.spare = s.spare[n-1], s.spare[:n-1]
	} else {
		a = &active{lease: new(kvcache.Lease)}
	}
	a.req, a.tenant, a.preempted = r, s.tenantIdx[r.Tenant], false
	return a
}

// start sets an admitted request, queued as q, running; its prefill
// starts in this step's decode. keys is how many page keys the admission
// carried. A preempted request admitted again counts as a re-admission,
// not as an admission: its prompt, output and first admission were
// counted already.
func (s *sim) start(a *active, q *queued, keys int) error {
	var err error
	if a.table, err = a.lease.AppendBlockTable(a.table[:0]); err != nil {
		return err
	}
	if len(s.stateGroups) > 0 {
		if err := s.stateSlots(a); err != nil {
			return err
		}
	}
	a.hit = a.lease.HitTokens()
	a.prompt, a.generated = a.req.Prompt, 0
	if q.resumed {
		a.prompt, a.generated = a.req.Prompt+q.generated, q.generated
		g := &s.res.Growth
		g.Readmitted++
		g.ReadmitWaitSeconds += (s.now - q.since).Seconds()
		tpp := s.lay.tpp
		if s.cfg.PrefixCache {
			// As the pool counts a lookup (countMatchLocked): the full
			// pages it has keys for, but the one holding the last token.
			looked := uint64(min(keys, (a.prompt-1)/tpp))
			hits := uint64(a.hit / tpp)
			g.ReadmitLookupPages += looked
			g.ReadmitHitPages += hits
			d := s.readmitByDomain[s.domainOf[a.tenant]]
			d.lookups, d.hits = d.lookups+looked, d.hits+hits
			s.readmitByDomain[s.domainOf[a.tenant]] = d
		}
		g.ReadmitHitTokens += uint64(a.hit)
		g.RecomputedTokens += uint64(a.prompt - a.hit)
	} else {
		s.res.Admitted++
		s.res.QueueWaitSeconds += (s.now - q.since).Seconds()
		s.res.PromptTokens += uint64(a.req.Prompt)
		s.res.Prefix.HitTokens += uint64(a.hit)
		s.served.add(a.req)
		s.res.Prefix.PrefillBytesAvoided += uint64(a.hit) * uint64(s.lay.token)
	}
	if s.cfg.afterAdmit != nil {
		s.cfg.afterAdmit(s, a)
	}
	if s.cfg.Audit {
		s.audit(a, 0)
		if len(s.stateGroups) > 0 {
			start := time.Now()
			s.auditState(a)
			s.auditTime += time.Since(start)
		}
	}
	if s.host != nil {
		rb := int(slices.Max(s.lay.kvRegions))
		if cap(a.marker) < rb {
			a.marker = make([]byte, rb)
		}
		a.marker = a.marker[:rb]
		w := markerWord(a.tenant, int(s.res.Admitted+s.res.Growth.Readmitted))
		for off := 0; off < rb; off += 4 {
			binary.LittleEndian.PutUint32(a.marker[off:], w)
		}
	}
	// The shared prefix's KV is in the first pages already: prefill
	// starts after it.
	a.written, a.target = a.hit, a.req.Prompt+a.req.Generated()
	s.running = append(s.running, a)
	return nil
}

// decode is one continuous-batching step: running requests compute their
// prompts, oldest first, within the step's prefill budget (and publish
// them to the prefix cache when complete); every request past its prompt
// writes one token, growing its lease first when it is full (on-demand
// sizing; see grow); those that reached their end (or their client's
// abort) are released.
func (s *sim) decode() error {
	budget := s.cfg.PrefillTokens
	if budget == 0 {
		budget = math.MaxInt
	}
	kept := s.running[:0]
	for i, a := range s.running {
		if a.preempted {
			continue // a newer request's growth took its pages this step
		}
		if prompt := a.prompt; a.written < prompt {
			n := min(prompt-a.written, budget)
			if s.hybrid {
				// The chunk ends where the engine can checkpoint.
				n = s.chunkEnd(a, a.written+n) - a.written
			}
			if n == 0 {
				kept = append(kept, a)
				continue
			}
			budget -= n
			if err := s.write(a, n); err != nil {
				return err
			}
			if s.host != nil && len(s.stateGroups) > 0 {
				s.writeState(a) // the state now holds what a computed
			}
			if a.written < prompt {
				if s.hybrid {
					// The state reflects the chunk's end, a page boundary.
					if err := s.checkpoint(a, a.written); err != nil {
						return err
					}
				}
				kept = append(kept, a)
				continue
			}
			if s.cfg.PrefixCache {
				if err := s.cachePrompt(a); err != nil {
					return err
				}
			}
		}
		if a.written < a.target {
			if a.written >= a.lease.CapacityTokens() {
				// The next token needs a page the lease does not have: it
				// writes nothing until it holds one.
				out, err := s.grow(i, a)
				if err != nil {
					return err
				}
				switch out {
				case grewStalled:
					kept = append(kept, a)
					continue
				case grewEnded:
					continue
				}
			}
			if a.generated == 0 {
				// The step that completes the prompt samples the first
				// token; it is delivered with its KV written.
				s.ttft = append(s.ttft, s.now+s.cfg.Step-a.req.At)
			}
			if err := s.write(a, 1); err != nil {
				return err
			}
			a.generated++
			s.res.TokensGenerated++
		}
		if a.written < a.target {
			kept = append(kept, a)
			continue
		}
		how := "completed"
		if a.req.AbortAfter >= 0 {
			s.res.Aborted++
			how = "aborted"
		} else {
			s.res.Completed++
		}
		if err := s.end(a, how); err != nil {
			return err
		}
	}
	clear(s.running[len(kept):])
	s.running = kept
	return nil
}

// end releases a request that ended for good.
func (s *sim) end(a *active, how string) error {
	s.done++
	if s.cfg.onEnd != nil {
		s.cfg.onEnd(s, a, how)
	}
	return s.release(a)
}

// What a growth came to.
type growOutcome uint8

const (
	grewRoom    growOutcome = iota // the lease holds the page: write
	grewStalled                    // no page this step (a faulted pool was cleared): write nothing, try again next step
	grewEnded                      // preempted, or ended for good: off the batch
)

// grow adds the page running[i] (a) needs for its next token. A refusal
// the pool may lift (ErrPoolExhausted, or ErrExceedsQuota while the
// tenant's other leases hold its quota) preempts, as vLLM does, the newest
// request in the batch (for a quota, the newest of a's tenant) and tries
// again; the newest may be a itself, which then waits at the head of the
// queue. Newest first, because it has computed the least (the least to
// lose, and what it loses the prefix cache mostly keeps), and because the
// oldest requests then finish first and free their pages, as first come,
// first served promises; it is also vLLM's policy, so figures compare.
// A refusal nothing can lift (the request can never hold its output: more
// than the pool in service, or than its tenant's whole quota; a pool
// faulted by a failed fill) ends the request with the tokens it has
// generated (truncated). The pool's canary audit failing on the page it
// would get is no page this step (the fault is cleared, as in admit). A
// refused growth is never taken for room: the request writes nothing
// until it holds the page.
func (s *sim) grow(i int, a *active) (growOutcome, error) {
	for {
		start := time.Now()
		had := len(a.table)
		err := a.lease.TryGrow(1)
		s.growTime += time.Since(start)
		if err == nil {
			if a.table, err = a.lease.AppendBlockTable(a.table[:0]); err != nil {
				return 0, err
			}
			if s.cfg.afterGrow != nil {
				s.cfg.afterGrow(s, a)
			}
			if s.cfg.Audit {
				s.audit(a, had)
			}
			return grewRoom, nil
		}
		var ae *kvcache.AdmissionError
		switch {
		case errors.Is(err, kvcache.ErrCanaryMismatch):
			// As in admit: the pool's canary audit caught a written free
			// page, retired it and faulted. No page this step.
			s.res.Audit.PoolCanaryFaults++
			if len(s.res.Audit.Examples) < maxAuditExamples {
				s.res.Audit.Examples = append(s.res.Audit.Examples, err.Error())
			}
			s.pool.ClearFault()
			s.res.Growth.Stalls++
			return grewStalled, nil
		case errors.As(err, &ae) && ae.Retryable():
			v := s.victim(i, a, errors.Is(err, kvcache.ErrExceedsQuota))
			if err := s.preempt(v); err != nil {
				return 0, err
			}
			if v == a {
				return grewEnded, nil
			}
		case errors.As(err, &ae) && errors.Is(err, kvcache.ErrExceedsMaxContext):
			// The engine asks for one token while it has budget left:
			// this refusal is a simulator bug, not a workload's.
			return 0, fmt.Errorf("growing %s at %d of %d tokens: %w", a.req.ID, a.written, a.target, err)
		case errors.As(err, &ae):
			s.res.Growth.Truncated[reason(err)]++
			return grewEnded, s.end(a, "truncated")
		default:
			return 0, fmt.Errorf("growing %s: %w", a.req.ID, err)
		}
	}
}

// victim is the request a refused growth of running[i] (a) preempts: the
// newest in the batch not preempted yet (the newest of a's tenant when its
// quota binds), a itself when none is newer. The batch is in admission
// order (a re-admitted request is newest again), so that is the last one.
func (s *sim) victim(i int, a *active, sameTenant bool) *active {
	for j := len(s.running) - 1; j > i; j-- {
		v := s.running[j]
		if !v.preempted && (!sameTenant || v.tenant == a.tenant) {
			return v
		}
	}
	return a
}

// preempt takes a off the batch: Lease.Preempt publishes the full pages
// of the tokens it has written in its domain's prefix cache and scrubs the
// rest, and the request goes back to the head of the queue with the page
// keys of everything it computed (its prompt and the tokens it generated),
// so that its next admission shares those pages back. Without the prefix
// cache nothing is kept and the next admission computes it all again.
func (s *sim) preempt(a *active) error {
	start := time.Now()
	defer func() { s.preemptTime += time.Since(start) }()
	q := queued{req: a.req, since: s.now, keyed: true, resumed: true, generated: a.generated}
	var tokens []int32
	if s.cfg.PrefixCache {
		s.tokens = AppendPromptTokens(s.tokens[:0], s.cfg.Seed, a.req, s.tr.BlockTokens)
		s.tokens = AppendOutputTokens(s.tokens, s.cfg.Seed, a.req, a.generated)
		// The lease's written watermark: what it committed (a request
		// preempted before its first write has committed nothing).
		tokens = s.tokens[:a.lease.Written()]
	}
	if _, err := a.lease.Preempt(tokens); err != nil {
		return fmt.Errorf("preempting %s: %w", a.req.ID, err)
	}
	if s.cfg.PrefixCache {
		var buf []kvcache.BlockKey
		if n := len(s.spareKeys); n > 0 {
			buf, s.spareKeys = s.spareKeys[n-1], s.spareKeys[:n-1]
		}
		var err error
		if q.keys, err = s.pool.PageKeys(a.req.Tenant, "", s.tokens[:a.req.Prompt+a.generated], buf); err != nil {
			return fmt.Errorf("deriving the page keys of preempted %s: %w", a.req.ID, err)
		}
	}
	s.res.Growth.Preempted++
	for _, p := range a.table {
		s.reused[p] = true
	}
	a.preempted = true
	s.spare = append(s.spare, a)
	s.queue = slices.Insert(s.queue, 0, q)
	return nil
}

// write appends n tokens of KV to the request's pages and commits them.
// Past the pages its block table holds is a simulator bug (a growth taken
// for granted), refused before anything is written.
//
// Token t of a page of tpp tokens is words [t·W/tpp, (t+1)·W/tpp) of a
// region whose page holds W 4-byte words: a token's bytes in a
// geometry's regions, and in a model's regions whatever they hold per
// token (a pooled indexer holds an entry per four tokens; a miniature's
// region may hold less than a word per token). A page written whole holds
// the marker in every word of every region.
func (s *sim) write(a *active, n int) error {
	tpp := s.lay.tpp
	from, to := a.written, a.written+n
	if to > len(a.table)*tpp {
		return fmt.Errorf("writing tokens %d..%d of %s: its lease holds %d pages (%d tokens)",
			from, to, a.req.ID, len(a.table), len(a.table)*tpp)
	}
	s.res.KVBytesWritten += uint64(n) * uint64(s.lay.token)
	if s.host != nil {
		start := time.Now()
		for tok := from; tok < to; {
			off := tok % tpp
			k := min(tpp-off, to-tok)
			p := a.table[tok/tpp]
			for r, pb := range s.lay.kvRegions {
				words := int(pb / 4)
				lo, hi := 4*(off*words/tpp), 4*((off+k)*words/tpp)
				copy(s.host.PageBytes(r, p)[lo:hi], a.marker)
			}
			tok += k
		}
		s.writeTime += time.Since(start)
	}
	a.written = to
	return a.lease.Commit(to)
}

func (s *sim) release(a *active) error {
	start := time.Now()
	err := a.lease.Release()
	s.releaseTime += time.Since(start)
	if err != nil {
		return fmt.Errorf("releasing %s: %w", a.req.ID, err)
	}
	s.res.Releases++
	for _, p := range a.table {
		s.reused[p] = true
	}
	s.spare = append(s.spare, a)
	return nil
}

const maxAuditExamples = 5

// audit checks, before the engine writes, that every page the lease got
// from its from-th on (0 at admission; after a growth, the pages it added)
// that an earlier lease held reads back as the policy's scrub word in
// every region, and that the pages it shares from the prefix cache hold
// its own domain's KV.
func (s *sim) audit(a *active, from int) {
	start := time.Now()
	defer func() { s.auditTime += time.Since(start) }()
	au := &s.res.Audit
	rb := int(slices.Max(s.lay.kvRegions)) // the largest region's page: every region's is a prefix of the buffers
	if len(s.auditBuf) != rb {
		s.auditBuf, s.wantBuf = make([]byte, rb), make([]byte, rb)
	}
	example := false // one example per lease keeps the report varied
	hitPages := a.hit / s.lay.tpp
	for i, p := range a.table[from:] {
		i += from
		if i < hitPages {
			if s.host != nil {
				s.auditHit(a, p)
			}
			continue
		}
		if !s.reused[p] {
			continue
		}
		au.PagesChecked++
		want := s.spec.WordFor(p)
		for off := 0; off < rb; off += 4 {
			binary.LittleEndian.PutUint32(s.wantBuf[off:], want)
		}
		for r, pb := range s.lay.kvRegions {
			buf := s.auditBuf[:pb]
			if err := s.dev.ReadPage(r, p, buf); err != nil {
				au.ReadErrors++
				break
			}
			if bytes.Equal(buf, s.wantBuf[:pb]) {
				continue
			}
			au.StalePages++
			off := 0
			for off < len(buf) && binary.LittleEndian.Uint32(buf[off:]) == want {
				off += 4
			}
			got := binary.LittleEndian.Uint32(buf[off:])
			prev := "of an unknown writer"
			if got&markerBit != 0 {
				pt := int(got>>16) & 0xff
				if pt < len(s.tr.Tenants) {
					prev = fmt.Sprintf("of tenant %q", s.tr.Tenants[pt].Name)
				}
				if pt != a.tenant {
					au.CrossTenantPages++
				}
			}
			if !example && len(au.Examples) < maxAuditExamples {
				example = true
				au.Examples = append(au.Examples, fmt.Sprintf(
					"page %d region %d byte %d: %#08x (KV %s), want %#08x, handed to tenant %q",
					p, r, off, got, prev, want, a.req.Tenant))
			}
			break
		}
	}
}

// auditHit checks a page the lease shares from the prefix cache: it must
// hold, in every region, the KV of one request of the lease's own sharing
// domain (pages are only written by the request that published them, so
// one marker word fills the page), never another domain's KV nor a scrub
// pattern.
func (s *sim) auditHit(a *active, p int32) {
	au := &s.res.Audit
	au.HitPagesChecked++
	for r, pb := range s.lay.kvRegions {
		buf, want := s.auditBuf[:pb], s.wantBuf[:pb]
		if err := s.dev.ReadPage(r, p, buf); err != nil {
			au.ReadErrors++
			return
		}
		first := binary.LittleEndian.Uint32(buf)
		if s.ownMarker(a, first) {
			for off := 0; off < len(want); off += 4 {
				binary.LittleEndian.PutUint32(want[off:], first)
			}
			if bytes.Equal(buf, want) {
				continue
			}
		}
		off := 0
		for off < len(buf) && s.ownMarker(a, binary.LittleEndian.Uint32(buf[off:])) {
			off += 4
		}
		got := binary.LittleEndian.Uint32(buf[off:])
		what := "no KV (a scrub pattern or never written)"
		if got&markerBit != 0 {
			au.ForeignHitPages++
			what = "KV of an unknown writer"
			if pt := int(got>>16) & 0xff; pt < len(s.tr.Tenants) {
				what = fmt.Sprintf("KV of tenant %q of domain %q", s.tr.Tenants[pt].Name, s.domainOf[pt])
			}
		} else {
			au.EmptyHitPages++
		}
		if len(au.Examples) < maxAuditExamples {
			au.Examples = append(au.Examples, fmt.Sprintf(
				"prefix hit page %d region %d byte %d: %#08x (%s), shared to tenant %q of domain %q",
				p, r, off, got, what, a.req.Tenant, s.domainOf[a.tenant]))
		}
		return
	}
}

// ownMarker reports whether w is KV the simulated engine wrote for a
// tenant of a's sharing domain.
func (s *sim) ownMarker(a *active, w uint32) bool {
	if w&markerBit == 0 {
		return false
	}
	pt := int(w>>16) & 0xff
	return pt < len(s.domainOf) && s.domainOf[pt] == s.domainOf[a.tenant]
}

func (s *sim) sample() {
	start := time.Now()
	st := s.pool.Stats()
	s.peakState = max(s.peakState, st.Checkpoints.StateBytes)
	// Only full written pages are ever shared, so a lease's pages past its
	// written tokens, and the free slots of a part-written last page, are
	// its own: subtracted from the pages in use (where a shared page
	// counts once) they leave what holds KV, each shared page once.
	unwritten, freeSlots := 0, 0
	tpp := st.TokensPerPage
	for _, a := range s.running {
		unwritten += a.lease.Pages() - (a.written+tpp-1)/tpp
		if r := a.written % tpp; r != 0 {
			freeSlots += tpp - r
		}
	}
	inUse := float64(st.InUsePages) / float64(st.TotalPages)
	writtenPages := float64(st.InUsePages-unwritten) / float64(st.TotalPages)
	written := (st.InUsePages-unwritten)*tpp - freeSlots
	s.inUseShare += inUse
	s.writtenShare += writtenPages
	s.res.Utilisation = append(s.res.Utilisation, UtilSample{
		T:            s.now.Seconds(),
		InUse:        inUse,
		WrittenPages: writtenPages,
		Written:      float64(written) / float64(st.TotalPages*st.TokensPerPage),
		Quarantined:  float64(st.QuarantinedPages) / float64(st.TotalPages),
		Cached:       float64(st.CachedPages) / float64(st.TotalPages),
		Queued:       len(s.queue),
		Running:      len(s.running),
	})
	s.sampleTime += time.Since(start)
}

// finish turns the counters into the result's figures.
func (s *sim) finish() {
	r := s.res
	st := s.endStats
	r.ServingSeconds = s.cfg.Duration.Seconds()
	r.Refusals = refusalsMap(st.Refused)
	r.PagesScrubbed = st.Scrub.PagesScrubbed - s.scrub0.PagesScrubbed
	r.ScrubFills = st.Scrub.Fills - s.scrub0.Fills
	// BytesScrubbed was summed at the end of serving: fills write whole
	// pages (slots), so the bytes scale exactly unit for unit, group by
	// group.
	r.HostBytesScrubbed, r.FillSeconds = s.filled, s.fillTime.Seconds()
	r.AdmitSeconds = s.admitTime.Seconds()
	r.Prefix.KeySeconds = s.keyTime.Seconds()
	r.ReleaseSeconds = s.releaseTime.Seconds()
	r.KVWriteSeconds = s.writeTime.Seconds()
	r.AuditSeconds = s.auditTime.Seconds()
	r.ScrubByBatch = s.fillBuckets
	r.Latencies = s.lat
	r.AdmitLatency = latencySummary(s.lat)
	if r.ServingSeconds > 0 {
		r.AdmissionsPerServingSecond = float64(r.Admitted) / r.ServingSeconds
	}
	if r.AdmitSeconds > 0 {
		r.AdmitThroughput = float64(r.Admitted) / r.AdmitSeconds
	}
	if r.ServingCPUSeconds > 0 {
		r.FillShare = r.FillSeconds / r.ServingCPUSeconds
	}
	if r.TokensGenerated > 0 {
		r.ScrubBytesPerGeneratedToken = float64(r.BytesScrubbed) / float64(r.TokensGenerated)
	}
	if r.KVBytesWritten > 0 {
		r.ScrubPerKVWritten = float64(r.BytesScrubbed) / float64(r.KVBytesWritten)
	}
	r.Concurrency = Concurrency{Mean: ratio(float64(s.runningSum), float64(s.busySteps)), Max: s.runningMax,
		BusySeconds: (time.Duration(s.busySteps) * s.cfg.Step).Seconds()}
	r.KVUtilisation = ratio(s.writtenShare, s.inUseShare)
	g := &r.Growth
	g.Grown, g.PagesGrown = st.Growth.Grown, st.Growth.PagesGrown
	g.Refused = refusalsMap(st.Growth.Refused)
	g.PreemptKeptPages = st.Growth.PreemptKeptPages
	g.GrowSeconds, g.PreemptSeconds = s.growTime.Seconds(), s.preemptTime.Seconds()
	s.finishPrefix()
	s.finishCheckpoints()
	slices.Sort(s.ttft)
	r.TTFT = ttftSummary(s.ttft)
	var inUse float64
	for _, u := range r.Utilisation {
		inUse += u.InUse
		r.PeakInUse = max(r.PeakInUse, u.InUse)
	}
	if n := len(r.Utilisation); n > 0 {
		r.MeanInUse = inUse / float64(n)
	}
	au := &r.Audit
	au.Enabled = s.cfg.Audit || st.Scrub.CanaryChecks > 0
	au.CanaryChecks, au.CanaryFailures = st.Scrub.CanaryChecks, st.Scrub.CanaryFailures
	switch {
	case s.cfg.Audit && st.Scrub.CanaryChecks > 0:
		au.Method = "canary (pool, every allocation) + marker check (every reuse, every prefix hit)"
	case s.cfg.Audit:
		au.Method = "marker check (every reuse, every prefix hit)"
	case st.Scrub.CanaryChecks > 0:
		au.Method = "canary (pool, every allocation)"
	default:
		au.Method = "off"
	}
	if s.cfg.Audit && len(s.stateGroups) > 0 {
		au.Method = strings.Replace(au.Method, "every prefix hit)", "every prefix hit, every state slot)", 1)
	}
	bad := au.StalePages + au.CanaryFailures + au.ReadErrors + au.PoolCanaryFaults + au.ForeignHitPages + au.EmptyHitPages +
		au.StaleStateSlots + au.ForeignStateSlots
	au.Passed = bad == 0
	switch {
	case !au.Enabled:
		au.Summary = "not audited (run with -audit)"
	case au.Passed:
		au.Summary = fmt.Sprintf("passed: %d reused pages checked, %d canary checks, none held data; "+
			"%d prefix-hit pages checked, all held their own domain's KV", au.PagesChecked, au.CanaryChecks, au.HitPagesChecked)
		if au.StateSlotsChecked > 0 {
			au.Summary += fmt.Sprintf("; %d state slots checked, each scrubbed or its own domain's restored checkpoint", au.StateSlotsChecked)
		}
	default:
		au.Summary = fmt.Sprintf("FAILED: %d of %d reused pages held stale KV (%d another tenant's), %d canary failures",
			au.StalePages, au.PagesChecked, au.CrossTenantPages, au.CanaryFailures+au.PoolCanaryFaults)
		if n := au.ForeignHitPages + au.EmptyHitPages; n > 0 {
			au.Summary += fmt.Sprintf("; %d of %d prefix-hit pages held another domain's KV (%d) or none (%d)",
				n, au.HitPagesChecked, au.ForeignHitPages, au.EmptyHitPages)
		}
		if n := au.StaleStateSlots + au.ForeignStateSlots; n > 0 {
			au.Summary += fmt.Sprintf("; %d of %d state slots held stale state (%d, %d another tenant's) or restored no state of their domain (%d)",
				n, au.StateSlotsChecked, au.StaleStateSlots, au.CrossTenantStateSlots, au.ForeignStateSlots)
		}
	}
}

// finishPrefix fills in the prefix-cache figures from the pool's
// per-domain counters, taken at the end of the run.
func (s *sim) finishPrefix() {
	if t := s.endStats.Tier; t.Enabled {
		r := &TierResult{OffloadedPages: t.Offloads, OffloadsDropped: t.OffloadsDropped, OnloadedPages: t.Onloads,
			EvictedSlots: t.EvictedSlots, CachedAtEnd: t.Cached,
			OffloadedBytes: t.Offloads * uint64(s.lay.groups[0].report), OnloadedBytes: t.Onloads * uint64(s.lay.groups[0].report),
			OffloadSeconds: t.OffloadLatency.Sum.Seconds(), OnloadSeconds: t.OnloadLatency.Sum.Seconds()}
		for _, d := range s.endStats.Prefix.Domains {
			r.TierHitPages += d.TierHitPages
		}
		if t.CheckpointSlots > 0 {
			r.CheckpointSlots, r.CheckpointsAtEnd = t.CheckpointSlots, t.Checkpoints
			r.CheckpointsStored, r.CheckpointsDropped, r.CheckpointsFailed = t.CheckpointsStored, t.CheckpointsDropped, t.CheckpointsFailed
			r.CheckpointsRestored, r.CheckpointsEvicted = t.CheckpointsRestored, t.CheckpointsEvicted
			// At the model's size: a restore copies one checkpoint's state.
			r.CheckpointRestoreBytes = t.CheckpointsRestored * uint64(stateBytes(s.cfg.Model.Spec))
		}
		s.res.Tier = r
	}
	px := &s.res.Prefix
	px.Enabled = s.endStats.Prefix.Enabled && s.cfg.PrefixCache
	hitTokens := px.HitTokens // counted from the leases' first admissions
	px.HitTokens = 0
	tpp := uint64(s.lay.tpp)
	var poolHitTokens uint64
	for _, d := range s.endStats.Prefix.Domains {
		// The pool counts every admission's lookup; the figures here are
		// first admissions', comparable with the bound: re-admissions of
		// preempted requests are in Growth.
		rc := s.readmitByDomain[d.Name]
		hits, misses := d.HitPages-rc.hits, d.MissPages-(rc.lookups-rc.hits)
		poolHitTokens += d.HitTokens
		px.Domains++
		px.HitPages += hits
		px.MissPages += misses
		px.HitTokens += hits * tpp
		px.StoredPages += d.StoredPages
		px.EvictedPages += d.EvictedPages
		px.CachedPagesAtEnd += d.CachedPages
		if d.HitPages+d.MissPages+d.StoredPages > 0 {
			px.PerDomain = append(px.PerDomain, DomainPrefix{Name: d.Name, Shared: d.Shared, Tenants: d.Tenants,
				HitPages: hits, MissPages: misses, HitTokens: hits * tpp,
				StoredPages: d.StoredPages, EvictedPages: d.EvictedPages})
		}
	}
	px.LeaseHitTokensMatch = poolHitTokens == hitTokens+s.res.Growth.ReadmitHitTokens && px.HitTokens == hitTokens
	px.Bound = boundFor(s.tr, s.cfg)
	px.ServedBound = s.served.bound()
	px.LookupPages = px.HitPages + px.MissPages
	if px.LookupPages > 0 {
		px.HitRate = float64(px.HitPages) / float64(px.LookupPages)
	}
	if s.res.PromptTokens > 0 {
		px.PromptHitShare = float64(hitTokens) / float64(s.res.PromptTokens)
	}
}

func refusalsMap(r kvcache.Refusals) map[string]uint64 {
	m := map[string]uint64{}
	for _, kv := range []struct {
		k string
		v uint64
	}{
		{"invalid_request", r.InvalidRequest}, {"unknown_tenant", r.UnknownTenant},
		{"duplicate_request", r.DuplicateRequest}, {"exceeds_max_context", r.ExceedsContext},
		{"exceeds_capacity", r.ExceedsCapacity}, {"exceeds_quota", r.ExceedsQuota},
		{"pool_exhausted", r.PoolExhausted}, {"pool_faulted", r.PoolFaulted},
	} {
		if kv.v > 0 {
			m[kv.k] = kv.v
		}
	}
	return m
}
