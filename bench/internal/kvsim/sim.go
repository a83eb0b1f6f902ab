package kvsim

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
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
	Geometry   kvcache.Geometry
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
	// OpenDevice returns the device for one run's pool; nil means a new
	// Host. The run closes it.
	OpenDevice func() (cudaops.Device, error)
	// Progress, if set, is called after every step with the steps done.
	Progress   func(steps int)
	MaxSamples int // utilisation samples kept (default 1000)
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
	}
	return c.Geometry.Validate()
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
	spec, _ := policy.FillSpec(cfg.Geometry.DType)
	var dev cudaops.Device = base
	if unsafe {
		dev = unsafeNoScrubDevice{base}
	}
	metered := &meteredDevice{Device: dev}
	tenants := make([]kvcache.TenantConfig, len(tr.Tenants))
	tenantIdx := make(map[string]int, len(tr.Tenants))
	for i, t := range tr.Tenants {
		tenants[i] = kvcache.TenantConfig{Name: t.Name, QuotaPages: t.QuotaPages, ReservedPages: t.ReservedPages}
		tenantIdx[t.Name] = i
	}
	pool, err := kvcache.New(kvcache.Config{
		Geometry: cfg.Geometry, Pages: cfg.PoolPages, MaxContextTokens: cfg.MaxContext,
		AllowUndersizedPool: true, Tenants: tenants, Scrub: policy, Device: metered,
	})
	if err != nil {
		return nil, err
	}
	s := &sim{
		cfg: cfg, tr: tr, pool: pool, dev: metered, tenantIdx: tenantIdx,
		reused: make([]bool, cfg.PoolPages),
		res: &RunResult{Policy: cfg.Policy, Unsafe: unsafe, Device: metered.Name(), PoolPages: cfg.PoolPages,
			PoolBytes: int64(cfg.PoolPages) * cfg.Geometry.PageBytes(), KVWritesSimulated: cfg.WriteKV,
			Dropped: map[string]uint64{}},
	}
	s.spec = spec
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
	if s.res.Audit.Enabled && !s.res.Audit.Passed && !unsafe {
		return s.res, fmt.Errorf("%w: policy %s: %s", ErrAuditFailed, cfg.Policy, s.res.Audit.Summary)
	}
	return s.res, nil
}

// hostMemory is a device whose pages the simulated engine can write in
// place (cudaops.Host).
type hostMemory interface {
	PageBytes(region int, page int32) []byte
}

type queued struct {
	req   *Request
	since time.Duration
}

type active struct {
	req     *Request
	tenant  int
	lease   *kvcache.Lease
	table   []int32
	written int // tokens whose KV is in the pages
	target  int // prompt + tokens generated before the request ends
	marker  []byte
}

type sim struct {
	cfg       RunConfig
	tr        *Trace
	pool      *kvcache.Pool
	dev       *meteredDevice
	host      hostMemory // set when the engine's KV writes are simulated
	spec      cudaops.FillSpec
	scrub0    isolation.ScrubStats // the pool's own scrub at creation, not part of serving
	tenantIdx map[string]int
	reused    []bool // page was held by a lease before
	queue     []queued
	running   []*active
	spare     []*active
	now       time.Duration
	lat       []time.Duration
	res       *RunResult

	auditBuf, wantBuf []byte
	auditTime         time.Duration
	sampleTime        time.Duration
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
		if err := s.decode(); err != nil {
			return err
		}
		if step%every == 0 || step == steps-1 {
			s.sample()
		}
		if s.cfg.Progress != nil {
			s.cfg.Progress(1)
		}
	}
	// Shutdown: the serving window is over.
	s.now = s.cfg.Duration
	for _, a := range s.running {
		s.res.ShutdownReleases++
		if err := s.release(a); err != nil {
			return err
		}
	}
	s.running = nil
	s.res.Dropped["unserved_at_end"] += uint64(len(s.queue))
	s.res.Dropped["not_arrived"] += uint64(len(s.tr.Requests) - next)
	wall := time.Since(start)
	s.res.WallSeconds = wall.Seconds()
	s.res.ServingCPUSeconds = (wall - s.auditTime - s.sampleTime).Seconds()
	if err := s.pool.Check(); err != nil {
		return fmt.Errorf("%w: pool Check after the run: %w", ErrAuditFailed, err)
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

// admit tries queued requests in arrival order. A request the pool cannot
// take now for lack of pages holds the queue (first come, first served); a
// request over its tenant's quota waits without holding the others.
func (s *sim) admit() error {
	kept := s.queue[:0]
	for _, q := range s.queue {
		if s.now-q.since > s.cfg.QueueTimeout {
			s.res.Dropped["queue_timeout"]++
			continue
		}
		kept = append(kept, q)
	}
	s.queue = kept
	ctx := context.Background() // no deadline: a busy pool refuses at once
	i := 0
	for i < len(s.queue) && len(s.running) < s.cfg.MaxBatch {
		q := s.queue[i]
		a := s.newActive(q.req)
		// When the pool gains a prefix cache, this is where q.req.Prefix
		// (the tenant's shared system prompt) is offered to it and hits
		// are counted into RunResult.PrefixCacheHitRate.
		start := time.Now()
		err := s.pool.AdmitInto(ctx, kvcache.Request{ID: q.req.ID, Tenant: q.req.Tenant,
			PromptTokens: q.req.Prompt, MaxNewTokens: q.req.MaxNew}, a.lease)
		took := time.Since(start)
		s.admitTime += took
		if err == nil {
			s.lat = append(s.lat, took)
			s.queue = slices.Delete(s.queue, i, i+1)
			if err := s.start(a, q); err != nil {
				return err
			}
			continue
		}
		s.spare = append(s.spare, a)
		var ae *kvcache.AdmissionError
		switch {
		case errors.As(err, &ae) && ae.Retryable():
			if errors.Is(err, kvcache.ErrPoolExhausted) {
				return nil
			}
			i++
		case errors.As(err, &ae):
			s.res.Dropped[reason(err)]++
			s.queue = slices.Delete(s.queue, i, i+1)
		case errors.Is(err, kvcache.ErrCanaryMismatch):
			// The pool's own canary audit caught a written free page:
			// it retired the page and faulted. Record it and carry on.
			s.res.Audit.PoolCanaryFaults++
			if len(s.res.Audit.Examples) < maxAuditExamples {
				s.res.Audit.Examples = append(s.res.Audit.Examples, err.Error())
			}
			s.pool.ClearFault()
			return nil
		default:
			return fmt.Errorf("admitting %s (trace line %d): %w", q.req.ID, q.req.Line, err)
		}
	}
	return nil
}

func (s *sim) newActive(r *Request) *active {
	var a *active
	if n := len(s.spare); n > 0 {
		a, s.spare = s.spare[n-1], s.spare[:n-1]
	} else {
		a = &active{lease: new(kvcache.Lease)}
	}
	a.req, a.tenant = r, s.tenantIdx[r.Tenant]
	return a
}

// start runs an admitted request's prefill.
func (s *sim) start(a *active, q queued) error {
	var err error
	if a.table, err = a.lease.AppendBlockTable(a.table[:0]); err != nil {
		return err
	}
	s.res.Admitted++
	s.res.QueueWaitSeconds += (s.now - q.since).Seconds()
	s.res.PromptTokens += uint64(a.req.Prompt)
	s.res.PrefixShareableTokens += uint64(a.req.Prefix)
	if s.cfg.Audit {
		s.audit(a)
	}
	if s.host != nil {
		rb := int(s.cfg.Geometry.RegionPageBytes())
		if cap(a.marker) < rb {
			a.marker = make([]byte, rb)
		}
		a.marker = a.marker[:rb]
		w := markerWord(a.tenant, int(s.res.Admitted))
		for off := 0; off < rb; off += 4 {
			binary.LittleEndian.PutUint32(a.marker[off:], w)
		}
	}
	a.written, a.target = 0, a.req.Prompt+a.req.Generated()
	if err := s.write(a, a.req.Prompt); err != nil {
		return err
	}
	s.running = append(s.running, a)
	return nil
}

// decode is one continuous-batching step: every running request writes
// one token; those that reached their end (or their client's abort) are
// released.
func (s *sim) decode() error {
	kept := s.running[:0]
	for _, a := range s.running {
		if a.written < a.target {
			if err := s.write(a, 1); err != nil {
				return err
			}
			s.res.TokensGenerated++
		}
		if a.written < a.target {
			kept = append(kept, a)
			continue
		}
		if a.req.AbortAfter >= 0 {
			s.res.Aborted++
		} else {
			s.res.Completed++
		}
		if err := s.release(a); err != nil {
			return err
		}
	}
	clear(s.running[len(kept):])
	s.running = kept
	return nil
}

// write appends n tokens of KV to the request's pages and commits them.
func (s *sim) write(a *active, n int) error {
	from, to := a.written, a.written+n
	s.res.KVBytesWritten += uint64(n) * uint64(s.cfg.Geometry.TokenBytes())
	if s.host != nil {
		start := time.Now()
		tpp := s.cfg.Geometry.TokensPerPage
		tb := int(s.cfg.Geometry.RegionPageBytes()) / tpp
		for tok := from; tok < to; {
			off := tok % tpp
			k := min(tpp-off, to-tok)
			p := a.table[tok/tpp]
			for r := range s.cfg.Geometry.Regions() {
				copy(s.host.PageBytes(r, p)[off*tb:(off+k)*tb], a.marker)
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

// audit checks, before the engine writes, that every page the new lease
// got that an earlier lease held reads back as the policy's scrub word in
// every region.
func (s *sim) audit(a *active) {
	start := time.Now()
	defer func() { s.auditTime += time.Since(start) }()
	au := &s.res.Audit
	rb := int(s.cfg.Geometry.RegionPageBytes())
	if len(s.auditBuf) != rb {
		s.auditBuf, s.wantBuf = make([]byte, rb), make([]byte, rb)
	}
	example := false // one example per lease keeps the report varied
	for _, p := range a.table {
		if !s.reused[p] {
			continue
		}
		au.PagesChecked++
		want := s.spec.WordFor(p)
		for off := 0; off < rb; off += 4 {
			binary.LittleEndian.PutUint32(s.wantBuf[off:], want)
		}
		for r := range s.cfg.Geometry.Regions() {
			if err := s.dev.ReadPage(r, p, s.auditBuf); err != nil {
				au.ReadErrors++
				break
			}
			if bytes.Equal(s.auditBuf, s.wantBuf) {
				continue
			}
			au.StalePages++
			off := 0
			for off < rb && binary.LittleEndian.Uint32(s.auditBuf[off:]) == want {
				off += 4
			}
			got := binary.LittleEndian.Uint32(s.auditBuf[off:])
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

func (s *sim) sample() {
	start := time.Now()
	st := s.pool.Stats()
	written := 0
	for _, a := range s.running {
		written += a.written
	}
	s.res.Utilisation = append(s.res.Utilisation, UtilSample{
		T:           s.now.Seconds(),
		InUse:       float64(st.InUsePages) / float64(st.TotalPages),
		Written:     float64(written) / float64(st.TotalPages*st.TokensPerPage),
		Quarantined: float64(st.QuarantinedPages) / float64(st.TotalPages),
		Queued:      len(s.queue),
		Running:     len(s.running),
	})
	s.sampleTime += time.Since(start)
}

// finish turns the counters into the result's figures.
func (s *sim) finish() {
	r := s.res
	st := s.pool.Stats()
	r.ServingSeconds = s.cfg.Duration.Seconds()
	r.Refusals = refusalsMap(st.Refused)
	r.PagesScrubbed = st.Scrub.PagesScrubbed - s.scrub0.PagesScrubbed
	r.ScrubFills = st.Scrub.Fills - s.scrub0.Fills
	fillTime, filled := s.dev.totals()
	r.BytesScrubbed, r.FillSeconds = filled, fillTime.Seconds()
	r.AdmitSeconds = s.admitTime.Seconds()
	r.ReleaseSeconds = s.releaseTime.Seconds()
	r.KVWriteSeconds = s.writeTime.Seconds()
	r.AuditSeconds = s.auditTime.Seconds()
	r.ScrubByBatch = s.dev.report()
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
	if r.PromptTokens > 0 {
		r.PrefixShareableFraction = float64(r.PrefixShareableTokens) / float64(r.PromptTokens)
	}
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
		au.Method = "canary (pool, every allocation) + marker check (every reuse)"
	case s.cfg.Audit:
		au.Method = "marker check (every reuse)"
	case st.Scrub.CanaryChecks > 0:
		au.Method = "canary (pool, every allocation)"
	default:
		au.Method = "off"
	}
	bad := au.StalePages + au.CanaryFailures + au.ReadErrors + au.PoolCanaryFaults
	au.Passed = bad == 0
	switch {
	case !au.Enabled:
		au.Summary = "not audited (run with -audit)"
	case au.Passed:
		au.Summary = fmt.Sprintf("passed: %d reused pages checked, %d canary checks, none held data", au.PagesChecked, au.CanaryChecks)
	default:
		au.Summary = fmt.Sprintf("FAILED: %d of %d reused pages held stale KV (%d another tenant's), %d canary failures",
			au.StalePages, au.PagesChecked, au.CrossTenantPages, au.CanaryFailures+au.PoolCanaryFaults)
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
