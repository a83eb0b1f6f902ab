package bridge

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

// Handle names a pool or a lease across the C boundary. Zero is never
// issued.
type Handle = uint64

// nextHandle is shared by pools and leases so that a value names at most
// one object, ever.
var nextHandle atomic.Uint64

var (
	pools  sync.Map // Handle → *poolEntry
	leases sync.Map // Handle → *leaseEntry
)

type poolEntry struct {
	pool *kvcache.Pool
	// maxContext is the config's max_context_tokens: AdmitTokensTable
	// sizes the block table it needs before admitting.
	maxContext int
	device     cudaops.Device // owned by the entry, closed after the pool; nil: the pool's own host device
	// admin serialises tenant changes, so that the configurations
	// recorded in mu are the registry's. Held across the call into kvcache.
	admin sync.Mutex
	mu    struct {
		sync.RWMutex
		// names interns tenant names, so that an admission naming a
		// known tenant does not copy the name out of C memory. A typed
		// map, unlike sync.Map, looks a string up without boxing it.
		names map[string]string
		// tenants is each tenant's configuration as last set through C,
		// for the legacy update call (which keeps what it cannot name)
		// and the stats (its configured domain, "" for its own).
		tenants map[string]kvcache.TenantConfig
	}
	events eventQueue
}

// intern returns name as a Go string that owns its bytes. name may alias
// C memory; it is not retained.
func (pe *poolEntry) intern(name string) string {
	pe.mu.RLock()
	s, ok := pe.mu.names[name]
	pe.mu.RUnlock()
	if ok {
		return s
	}
	return strings.Clone(name)
}

func (pe *poolEntry) remember(tc kvcache.TenantConfig) {
	name := strings.Clone(tc.Name)
	pe.mu.Lock()
	defer pe.mu.Unlock()
	if pe.mu.names == nil {
		pe.mu.names = make(map[string]string)
		pe.mu.tenants = make(map[string]kvcache.TenantConfig)
	}
	pe.mu.names[name] = name
	tc.Name, tc.Domain = name, strings.Clone(tc.Domain)
	pe.mu.tenants[name] = tc
}

// domainOf is the name of tenant's sharing domain as kvcache names it
// (Lease.Domain): the configured domain, or the tenant's own.
func (pe *poolEntry) domainOf(tenant string) string {
	pe.mu.RLock()
	d := pe.mu.tenants[tenant].Domain
	pe.mu.RUnlock()
	if d == "" {
		return isolation.PrivateDomainPrefix + tenant
	}
	return d
}

type leaseEntry struct {
	pool *poolEntry
	// noRecycle: the lease was exported or imported, so a handoff object
	// (and its reclaim timer) may still refer to it after Free; it must
	// not be reused for another admission. Set under mu.
	mu struct {
		sync.RWMutex
		lease     *kvcache.Lease // nil once freed
		noRecycle bool
	}
}

// spareLeases recycles freed leases (and their page slices) for new
// admissions; see invariant 1 in the package doc.
var spareLeases = sync.Pool{New: func() any { return new(kvcache.Lease) }}

func lookupPool(h Handle) (*poolEntry, error) {
	if v, ok := pools.Load(h); ok {
		return v.(*poolEntry), nil
	}
	return nil, fmt.Errorf("%w: %#x is not a live pool", ErrInvalidHandle, h)
}

// withLease runs f on the live entry of h under its read lock.
func withLease(h Handle, f func(pe *poolEntry, l *kvcache.Lease) error) error {
	v, ok := leases.Load(h)
	if !ok {
		return fmt.Errorf("%w: %#x is not a live lease", ErrInvalidHandle, h)
	}
	e := v.(*leaseEntry)
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.mu.lease == nil { // freed after our Load
		return fmt.Errorf("%w: %#x is not a live lease", ErrInvalidHandle, h)
	}
	return f(e.pool, e.mu.lease)
}

// withLeaseEntry is withLease under the entry's write lock, for calls
// that change the entry itself.
func withLeaseEntry(h Handle, f func(e *leaseEntry) error) error {
	v, ok := leases.Load(h)
	if !ok {
		return fmt.Errorf("%w: %#x is not a live lease", ErrInvalidHandle, h)
	}
	e := v.(*leaseEntry)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.mu.lease == nil {
		return fmt.Errorf("%w: %#x is not a live lease", ErrInvalidHandle, h)
	}
	return f(e)
}

// newLease registers a lease handle for l in pe.
func newLease(pe *poolEntry, l *kvcache.Lease, noRecycle bool) Handle {
	e := &leaseEntry{pool: pe}
	e.mu.lease = l
	e.mu.noRecycle = noRecycle
	lh := nextHandle.Add(1)
	leases.Store(lh, e)
	return lh
}

// openDevice opens the device a config selects; nil for host memory with
// synchronous fills, which the pool allocates and owns itself. A remote
// group waits here for its ranks (ranks.go).
func openDevice(d DeviceJSON) (cudaops.Device, error) {
	switch d.Kind {
	case DeviceCUDA:
		return cudaops.OpenCUDA(d.Ordinal)
	case DeviceRemote:
		return openRemote(d)
	}
	if d.AsyncFills {
		return cudaops.NewHostWith(cudaops.HostConfig{AsyncFills: true}), nil
	}
	return nil, nil
}

// CreatePool builds a pool from a ConfigJSON document.
func CreatePool(configJSON []byte) (Handle, error) {
	cfg, devSel, err := parseConfig(configJSON)
	if err != nil {
		return 0, err
	}
	dev, err := openDevice(devSel)
	if err != nil {
		return 0, err
	}
	cfg.Device = dev
	p, err := kvcache.New(cfg)
	if err != nil {
		if dev != nil {
			dev.Close()
		}
		return 0, err
	}
	pe := &poolEntry{pool: p, device: dev, maxContext: cfg.MaxContextTokens}
	pe.events.ch = p.Events()
	for _, t := range cfg.Tenants {
		pe.remember(t)
	}
	h := nextHandle.Add(1)
	pools.Store(h, pe)
	return h, nil
}

// DestroyPool closes the pool (its live leases are released and scrubbed,
// fills are waited for) and invalidates its handle. Lease handles of the
// pool stay valid until freed; calls on them report ErrLeaseReleased or
// ErrPoolClosed. The error is Close's: the handle is gone either way.
func DestroyPool(h Handle) error {
	v, ok := pools.LoadAndDelete(h)
	if !ok {
		return fmt.Errorf("%w: %#x is not a live pool", ErrInvalidHandle, h)
	}
	pe := v.(*poolEntry)
	err := pe.pool.Close()
	if pe.device != nil {
		// After Close: every fill has completed, nothing reads the pages.
		if derr := pe.device.Close(); err == nil {
			err = derr
		}
	}
	return err
}

// AddTenant registers a tenant; UpdateTenant changes one. Strings may
// alias C memory.
func AddTenant(h Handle, tc kvcache.TenantConfig) error {
	pe, err := lookupPool(h)
	if err != nil {
		return err
	}
	tc.Name, tc.Domain = strings.Clone(tc.Name), strings.Clone(tc.Domain)
	pe.admin.Lock()
	defer pe.admin.Unlock()
	if err := pe.pool.AddTenant(tc); err != nil {
		return err
	}
	pe.remember(tc)
	return nil
}

// UpdateTenant replaces a tenant's configuration, domain included (empty:
// its own), as kvcache.Pool.UpdateTenant does.
func UpdateTenant(h Handle, tc kvcache.TenantConfig) error {
	return updateTenant(h, tc, false)
}

// UpdateTenantQuota changes a tenant's quota and reservation (tc's
// QuotaPages and ReservedPages) and keeps the rest of its configuration
// as last set through C: its sharing domain, sizing and checkpoint bound.
// It is the call of ABI 1, which names none of them, and must not move a
// tenant out of a shared domain or drop its settings.
func UpdateTenantQuota(h Handle, tc kvcache.TenantConfig) error {
	return updateTenant(h, tc, true)
}

func updateTenant(h Handle, tc kvcache.TenantConfig, quotaOnly bool) error {
	pe, err := lookupPool(h)
	if err != nil {
		return err
	}
	tc.Name, tc.Domain = pe.intern(tc.Name), strings.Clone(tc.Domain)
	pe.admin.Lock()
	defer pe.admin.Unlock()
	if quotaOnly {
		pe.mu.RLock()
		kept, ok := pe.mu.tenants[tc.Name]
		pe.mu.RUnlock()
		if ok { // else unknown: the pool refuses it
			kept.QuotaPages, kept.ReservedPages = tc.QuotaPages, tc.ReservedPages
			tc = kept
		}
	}
	if err := pe.pool.UpdateTenant(tc); err != nil {
		return err
	}
	pe.remember(tc)
	return nil
}

// Admit admits a request and returns its lease handle. id and tenant may
// alias C memory: they are copied (or interned) before the pool keeps
// them. wait > 0 lets the admission wait that long for pages or quota; 0
// refuses a busy pool at once.
func Admit(h Handle, id, tenant string, promptTokens, maxNewTokens int64, wait time.Duration) (Handle, error) {
	return admit(h, kvcache.Request{ID: id, Tenant: tenant, PromptTokens: clampInt(promptTokens), MaxNewTokens: clampInt(maxNewTokens)}, wait)
}

// AdmitTokens admits a request whose prompt is tokens (its token IDs), so
// that it shares the longest prefix cached in its tenant's sharing domain
// (Lease.HitTokens); adapter names the weights (a LoRA ID), "" for the
// base model. tokens and the strings may alias C memory: kvcache copies
// the tokens into the lease during the call and keeps no reference.
func AdmitTokens(h Handle, id, tenant string, tokens []int32, maxNewTokens int64, adapter string, wait time.Duration) (Handle, error) {
	return admit(h, kvcache.Request{ID: id, Tenant: tenant, PromptTokens: len(tokens), MaxNewTokens: clampInt(maxNewTokens),
		TokenIDs: tokens, Adapter: strings.Clone(adapter)}, wait)
}

// AdmitTokensTable is AdmitTokens that also copies the new lease's block
// table into table, in the same call, and returns the handle and the
// table's length.
//
// table must hold the most pages the lease can ever have: the pages of
// prompt + max new tokens, whatever the sizing (an on-demand lease starts
// with fewer and grows up to that). A shorter one is refused before
// anything is admitted, with a *BufferError naming that number, and the
// pool is left as it was: not even a refusal is counted. A request the
// admission refuses whatever the buffer (no tokens, a negative max new,
// more than the pool's max context) is refused as AdmitTokens refuses
// it, so that its error is the specific one. On any error table is not
// written.
func AdmitTokensTable(h Handle, id, tenant string, tokens []int32, maxNewTokens int64, adapter string, wait time.Duration,
	table []int32) (Handle, int, error) {
	return admitTable(h, kvcache.Request{ID: id, Tenant: tenant, PromptTokens: len(tokens), MaxNewTokens: clampInt(maxNewTokens),
		TokenIDs: tokens, Adapter: strings.Clone(adapter)}, maxNewTokens, wait, table)
}

// admitTable is AdmitTokensTable of a request by token IDs (req) whose
// max new tokens, as the caller gave it, is maxNewTokens.
func admitTable(h Handle, req kvcache.Request, maxNewTokens int64, wait time.Duration, table []int32) (Handle, int, error) {
	tokens := req.TokenIDs
	pe, err := lookupPool(h)
	if err != nil {
		return 0, 0, err
	}
	if wait < 0 {
		return 0, 0, fmt.Errorf("%w: negative wait %v", kvcache.ErrInvalidArgument, wait)
	}
	if n := int64(len(tokens)); n > 0 && maxNewTokens >= 0 && maxNewTokens <= int64(pe.maxContext)-n {
		tpp := int64(pe.pool.TokensPerPage())
		if need := int((n + maxNewTokens + tpp - 1) / tpp); need > len(table) {
			return 0, need, &BufferError{What: "block table", Need: need, Have: len(table)}
		}
	}
	l, err := pe.admit(req, wait)
	if err != nil {
		return 0, 0, err
	}
	// The table is read before the handle exists, so that no other call
	// can grow, release or free the lease in between; only the pool's
	// destruction can end it.
	n := l.Pages()
	if n > len(table) {
		// Cannot happen: an admitted lease holds at most the pages
		// checked above. Undo it rather than write past the buffer.
		err = fmt.Errorf("%w: an admitted lease of %d pages, more than the %d the table holds",
			ErrInternal, n, len(table))
	} else if _, err = l.AppendBlockTable(table[:0]); errors.Is(err, kvcache.ErrLeaseReleased) {
		err = fmt.Errorf("%w: the pool was destroyed during the admission", kvcache.ErrPoolClosed)
	}
	if err != nil {
		l.Release() // nothing stays admitted; a lease the destruction released refuses, harmlessly
		spareLeases.Put(l)
		return 0, 0, err
	}
	return newLease(pe, l, false), n, nil
}

func admit(h Handle, req kvcache.Request, wait time.Duration) (Handle, error) {
	pe, err := lookupPool(h)
	if err != nil {
		return 0, err
	}
	if wait < 0 {
		return 0, fmt.Errorf("%w: negative wait %v", kvcache.ErrInvalidArgument, wait)
	}
	l, err := pe.admit(req, wait)
	if err != nil {
		return 0, err
	}
	return newLease(pe, l, false), nil
}

// admit admits req into a recycled lease; wait is not negative.
func (pe *poolEntry) admit(req kvcache.Request, wait time.Duration) (*kvcache.Lease, error) {
	req.ID = strings.Clone(req.ID)
	req.Tenant = pe.intern(req.Tenant)
	l := spareLeases.Get().(*kvcache.Lease)
	var err error
	if wait == 0 {
		err = tryAdmitInto(pe.pool, req, l)
	} else {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		err = admitInto(pe.pool, ctx, req, l)
		cancel()
	}
	if err != nil {
		spareLeases.Put(l)
		return nil, err
	}
	return l, nil
}

// The two admissions of kvcache, the only ones the bridge makes (imports
// are admitted by package handoff). kvcache.Pool.AdmitInto waits for
// pages or quota for as long as its context lives, as
// golang.org/x/sync/semaphore does, context.Background() included; so the
// C ABI's wait_ms = 0, "refuse a busy pool at once", must be
// TryAdmitInto, and a wait AdmitInto under a deadline that long. Variables
// so that a test can check which one each wait makes.
var (
	tryAdmitInto = (*kvcache.Pool).TryAdmitInto
	admitInto    = (*kvcache.Pool).AdmitInto
)

// clampInt keeps an int64 token count meaningful on 32-bit platforms: a
// count beyond int is as invalid as it is absurd, and kvcache refuses it.
func clampInt(v int64) int {
	if int64(int(v)) != v {
		if v < 0 {
			return -1
		}
		return int(^uint(0) >> 1)
	}
	return int(v)
}

// testHookSized, set by tests only, runs in BlockTable and SlotMapping
// between the check of the lease's size against the caller's buffer and
// the copy: where a growth of the lease on another thread can land (the
// calls share the entry's read lock).
var testHookSized func(l *kvcache.Lease)

// BlockTable copies the lease's block table into dst and returns its
// length. A short dst gets nothing and a *BufferError.
func BlockTable(h Handle, dst []int32) (int, error) {
	n := 0
	err := withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		n = l.Pages()
		if !l.Live() {
			_, err := l.AppendBlockTable(nil) // the lease's own error
			return err
		}
		if n > len(dst) {
			return &BufferError{What: "block table", Need: n, Have: len(dst)}
		}
		if testHookSized != nil {
			testHookSized(l)
		}
		out, err := l.AppendBlockTable(dst[:0])
		if err != nil {
			return err
		}
		// The table is the one read now: a growth since n was read (on
		// another thread) made it longer, and one that outgrew dst was
		// appended into new memory, leaving dst as it was.
		if n = len(out); n > len(dst) {
			return &BufferError{What: "block table", Need: n, Have: len(dst)}
		}
		return nil
	})
	return n, err
}

// SlotMapping copies the cache slot of each token in [start, end) into dst
// and returns end - start. For a range outside the lease it returns 0 and
// kvcache's error: the difference of two arbitrary int64s can wrap, and
// C would be told a length of SIZE_MAX.
func SlotMapping(h Handle, start, end int64, dst []int64) (int, error) {
	n := 0
	err := withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		s, e := clampInt(start), clampInt(end)
		buf := dst[:0]
		if s >= 0 && e >= s && e <= l.CapacityTokens() {
			n = e - s
			if l.Live() && n > len(dst) {
				return &BufferError{What: "slot mapping", Need: n, Have: len(dst)}
			}
		} else {
			// Outside the lease, for kvcache to refuse with its error;
			// unchecked against dst, so not written into it should the
			// lease have grown over the range meanwhile (another
			// thread's growth): kvcache then returns the slots in new
			// memory, copied below if they fit.
			buf = nil
		}
		if testHookSized != nil {
			testHookSized(l)
		}
		out, err := l.SlotMapping(s, e, buf)
		if err != nil {
			return err
		}
		if n = len(out); n > len(dst) {
			return &BufferError{What: "slot mapping", Need: n, Have: len(dst)}
		}
		if buf == nil {
			copy(dst, out)
		}
		return nil
	})
	return n, err
}

// Commit moves the lease's written watermark.
func Commit(h Handle, tokens int64) error {
	return withLease(h, func(_ *poolEntry, l *kvcache.Lease) error { return l.Commit(clampInt(tokens)) })
}

// Grow makes room in the lease for tokens more tokens after its written
// watermark (kvcache.Lease.Grow). wait 0 never waits (TryGrow); wait > 0
// waits up to that long for pages or quota.
func Grow(h Handle, tokens int64, wait time.Duration) error {
	if wait < 0 {
		return fmt.Errorf("%w: negative wait %v", kvcache.ErrInvalidArgument, wait)
	}
	return withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		if wait == 0 {
			return l.TryGrow(clampInt(tokens))
		}
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		return l.Grow(ctx, clampInt(tokens))
	})
}

// Preempt ends the lease, publishing the full pages of its written tokens
// (kvcache.Lease.Preempt), and returns the tokens kept. tokens may alias C
// memory: they are hashed during the call and not kept.
func Preempt(h Handle, tokens []int32) (int, error) {
	var kept int
	err := withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		var err error
		kept, err = l.Preempt(tokens)
		return err
	})
	return kept, err
}

// LeaseInfo is a lease's shape (kvf_lease_info).
type LeaseInfo struct {
	Pages, CapacityTokens, PromptTokens, MaxNewTokens, Written int64
	Live                                                       bool
}

// DescribeLease reports a lease's shape; it works on released leases too.
func DescribeLease(h Handle) (LeaseInfo, error) {
	var li LeaseInfo
	err := withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		li = LeaseInfo{
			Pages: int64(l.Pages()), CapacityTokens: int64(l.CapacityTokens()),
			PromptTokens: int64(l.PromptTokens()), MaxNewTokens: int64(l.MaxNewTokens()),
			Written: int64(l.Written()), Live: l.Live(),
		}
		return nil
	})
	return li, err
}

// Release ends the lease; its scrub is ordered after the engine work in
// after. The handle stays valid (for Info) until Free.
func Release(h Handle, after cudaops.Ordering) error {
	return withLease(h, func(_ *poolEntry, l *kvcache.Lease) error { return l.ReleaseAfter(after) })
}

// Free releases the lease if it is still live and invalidates its handle.
// The error is the release's, if one was due and failed; the handle is
// gone either way. A lease that its pool's Close already released is not
// an error.
func Free(h Handle) error {
	v, ok := leases.LoadAndDelete(h)
	if !ok {
		return fmt.Errorf("%w: %#x is not a live lease", ErrInvalidHandle, h)
	}
	e := v.(*leaseEntry)
	e.mu.Lock()
	defer e.mu.Unlock()
	l := e.mu.lease
	e.mu.lease = nil
	var err error
	if l.Live() {
		if err = l.Release(); err == kvcache.ErrPoolClosed || err == kvcache.ErrLeaseReleased {
			err = nil // Close or a racing Release got there first
		}
	}
	if !l.Live() && !e.mu.noRecycle {
		spareLeases.Put(l)
	}
	return err
}

// Check runs the pool's accounting check. An inconsistency wraps
// ErrInternal: it is a kvfence bug (kvf_pool_check documents
// KVF_ERR_INTERNAL), and kvcache reports it with the allocator's or the
// registry's own error, which wraps no sentinel.
func Check(h Handle) error {
	pe, err := lookupPool(h)
	if err != nil {
		return err
	}
	if err := pe.pool.Check(); err != nil {
		return fmt.Errorf("%w: %w", ErrInternal, err)
	}
	return nil
}

// ClearFault lets a faulted pool admit again.
func ClearFault(h Handle) error {
	pe, err := lookupPool(h)
	if err != nil {
		return err
	}
	pe.pool.ClearFault()
	return nil
}

// StatsJSON returns the pool's Stats as a StatsDoc in JSON.
func StatsJSON(h Handle) ([]byte, error) {
	pe, err := lookupPool(h)
	if err != nil {
		return nil, err
	}
	doc := statsJSON(pe.pool.Stats(), pe.domainOf)
	doc.CUDA = cudaStatsDoc(pe.pool)
	js, err := json.Marshal(doc)
	if err != nil { // plain structs of numbers and strings: a bug
		return nil, fmt.Errorf("%w: stats JSON: %w", ErrInternal, err)
	}
	return js, nil
}
