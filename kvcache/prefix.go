package kvcache

import (
	"context"
	"fmt"
	"slices"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
)

// This file holds the prefix cache: the per-domain index of published
// pages, admission's matching and eviction, publication (CachePrefix),
// release of shared pages, and the checks and stats that cover them. See
// the package doc for the model.

// cacheEntry is one published page: full, immutable, in one domain.
type cacheEntry struct {
	key      BlockKey
	parent   BlockKey // zero for a prompt's first page
	dom      *isolation.Domain
	page     int32
	detached bool // out of the key index (ClearPrefixCache) while leases still hold it

	prev, next *cacheEntry // LRU links while the page is Cached
	inLRU      bool
	pinned     bool        // scratch: matched by the admission now running
	chain      *cacheEntry // next entry with the same index64

	// tenants counts, per tenant, the live leases that hold the page: each
	// tenant is charged once for it, whatever its number of leases.
	tenants []tenantRef
}

type tenantRef struct {
	t    *isolation.Tenant
	refs int
}

// ref returns the count for t, or nil.
func (e *cacheEntry) ref(t *isolation.Tenant) *tenantRef {
	for i := range e.tenants {
		if e.tenants[i].t == t {
			return &e.tenants[i]
		}
	}
	return nil
}

// domainCounters are one domain's prefix-cache totals.
type domainCounters struct {
	hitPages, missPages, hitTokens uint64
	storedPages, evictedPages      uint64
	cachedPages                    int // Cached (evictable) pages now
	entries                        int // indexed pages now, cached or in use
}

// prefixCache is the pool's index of published pages. Guarded by Pool.mu.
type prefixCache struct {
	disabled bool
	byKey    map[uint64]*cacheEntry // index64 → chain of entries
	byPage   []*cacheEntry          // page → its entry, nil for private pages
	// lru holds the entries whose page is Cached (no lease references it),
	// least recently used first. Only these pages can be evicted.
	lruHead, lruTail *cacheEntry
	lruLen           int
	domains          []domainCounters // index = domain ID - 1, grown on demand
	matched          []*cacheEntry    // scratch of the admission now running
	parked           chan struct{}    // closed when pages become evictable; nil while nobody waits
	parkBuf          [1]int32
	events           eventSink
}

func (c *prefixCache) init(pages int, cfg PrefixConfig) {
	c.disabled = cfg.Disable
	c.byKey = make(map[uint64]*cacheEntry)
	c.byPage = make([]*cacheEntry, pages)
	if cfg.EventBuffer > 0 {
		c.events.ch = make(chan KVEvent, cfg.EventBuffer)
	}
}

func (c *prefixCache) counters(d *isolation.Domain) *domainCounters {
	for int(d.ID) > len(c.domains) {
		c.domains = append(c.domains, domainCounters{})
	}
	return &c.domains[d.ID-1]
}

func (c *prefixCache) lookup(d *isolation.Domain, k BlockKey) *cacheEntry {
	for e := c.byKey[k.index64(uint32(d.ID))]; e != nil; e = e.chain {
		if e.key == k && e.dom == d {
			return e
		}
	}
	return nil
}

func (c *prefixCache) insert(e *cacheEntry) {
	i := e.key.index64(uint32(e.dom.ID))
	e.chain = c.byKey[i]
	c.byKey[i] = e
	c.byPage[e.page] = e
	c.counters(e.dom).entries++
}

// unindex takes e out of the key index; it stays in byPage.
func (c *prefixCache) unindex(e *cacheEntry) {
	i := e.key.index64(uint32(e.dom.ID))
	if head := c.byKey[i]; head == e {
		c.byKey[i] = e.chain
	} else {
		for pp := head; pp != nil; pp = pp.chain {
			if pp.chain == e {
				pp.chain = e.chain
				break
			}
		}
	}
	if c.byKey[i] == nil {
		delete(c.byKey, i)
	}
	e.chain = nil
	e.detached = true
}

// drop forgets e entirely: its page is leaving the cache.
func (c *prefixCache) drop(e *cacheEntry) {
	if !e.detached {
		c.unindex(e)
	}
	c.byPage[e.page] = nil
	c.counters(e.dom).entries--
}

func (c *prefixCache) lruPush(e *cacheEntry) {
	e.prev, e.next, e.inLRU = c.lruTail, nil, true
	if c.lruTail != nil {
		c.lruTail.next = e
	} else {
		c.lruHead = e
	}
	c.lruTail = e
	c.lruLen++
	c.counters(e.dom).cachedPages++
}

func (c *prefixCache) lruRemove(e *cacheEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		c.lruHead = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		c.lruTail = e.prev
	}
	e.prev, e.next, e.inLRU = nil, nil, false
	c.lruLen--
	c.counters(e.dom).cachedPages--
}

// wakeParked tells admissions waiting for pages that some became
// evictable.
func (c *prefixCache) wakeParked() {
	if c.parked != nil {
		close(c.parked)
		c.parked = nil
	}
}

// maxHitPages is how many of a request's pages may be shared: full prompt
// pages, but never the one holding the last prompt token, which the engine
// must compute (for its logits) and therefore write.
func maxHitPages(req Request, tokensPerPage int) int {
	return (req.PromptTokens - 1) / tokensPerPage
}

// validatePrefix checks a request's prefix material.
func validatePrefix(req Request, tokensPerPage int) error {
	switch {
	case len(req.TokenIDs) > 0 && len(req.PageKeys) > 0:
		return fmt.Errorf("request carries both TokenIDs and PageKeys; give one")
	case len(req.TokenIDs) > 0 && len(req.TokenIDs) != req.PromptTokens:
		return fmt.Errorf("%d prompt tokens given, PromptTokens = %d", len(req.TokenIDs), req.PromptTokens)
	case len(req.PageKeys) > req.PromptTokens/tokensPerPage:
		return fmt.Errorf("%d page keys for a prompt of %d full pages", len(req.PageKeys), req.PromptTokens/tokensPerPage)
	case len(req.Adapter) > MaxIDLen:
		return fmt.Errorf("adapter ID of %d bytes, want at most %d", len(req.Adapter), MaxIDLen)
	}
	return nil
}

// PageKeys appends to dst the keys of the full pages of tokens as tenant's
// requests would derive them now (in its current domain, under adapter),
// so that an engine can hash a prompt once, ahead of admission, and pass
// the keys in Request.PageKeys.
func (p *Pool) PageKeys(tenant, adapter string, tokens []int32, dst []BlockKey) ([]BlockKey, error) {
	if len(adapter) > MaxIDLen {
		return dst, fmt.Errorf("%w: adapter ID of %d bytes, want at most %d", ErrInvalidArgument, len(adapter), MaxIDLen)
	}
	p.mu.Lock()
	t, err := p.mu.tenants.Lookup(tenant)
	var domain string
	if err == nil {
		domain = t.Domain.Name
	}
	p.mu.Unlock()
	if err != nil {
		return dst, err
	}
	return appendPageKeys(dst, prefixRoot(domain, adapter), p.geom.TokensPerPage, tokens), nil
}

// TenantDomain returns the name of the sharing domain tenant is in now:
// where its next admission looks up and publishes pages, and the domain an
// import for it must come from. Leases keep the domain they were admitted
// in (Lease.Domain).
func (p *Pool) TenantDomain(tenant string) (string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.closed {
		return "", ErrPoolClosed
	}
	t, err := p.mu.tenants.Lookup(tenant)
	if err != nil {
		return "", err
	}
	return t.Domain.Name, nil
}

// AttachTokens gives a lease admitted without prefix material (an imported
// decode lease, typically) its prompt's token IDs, computed under adapter,
// so that CachePrefix can publish its prompt pages. The keys are derived in
// the lease's own domain (Lease.Domain), not the tenant's current one: the
// pages belong to the domain they were admitted in. Like TokenIDs given to
// Admit, the tokens are the engine's word for what its pages hold. It
// refuses (ErrInvalidArgument) a lease that already has prefix material
// and tokens that are not exactly the prompt; with prefix caching
// disabled it does nothing.
func (l *Lease) AttachTokens(adapter string, tokens []int32) error {
	if err := l.live(); err != nil {
		return err
	}
	p := l.pool
	if p.prefixDisabled {
		return nil
	}
	if len(tokens) == 0 {
		return fmt.Errorf("%w: lease %q: no tokens to attach", ErrInvalidArgument, l.id)
	}
	if err := validatePrefix(Request{PromptTokens: l.prompt, TokenIDs: tokens, Adapter: adapter}, p.geom.TokensPerPage); err != nil {
		return fmt.Errorf("%w: lease %q: %w", ErrInvalidArgument, l.id, err)
	}
	// Hashed outside Pool.mu; the domain never changes while l lives.
	keys := appendPageKeys(nil, prefixRoot(l.Domain(), adapter), p.geom.TokensPerPage, tokens)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.closed {
		return ErrPoolClosed
	}
	if err := l.live(); err != nil {
		return err
	}
	if len(l.keys) > 0 || l.published > 0 {
		return fmt.Errorf("%w: lease %q already has prefix material", ErrInvalidArgument, l.id)
	}
	l.keys, l.keysFor = keys, l.domain
	return nil
}

// planPrefix derives l's page keys if the request carries tokens and the
// tenant's domain changed since they were derived (hashing runs outside
// the lock), and returns how many of need pages must come from the free
// pool once the cached prefix is shared. A request over its tenant's quota
// claims nothing, so that it evicts nothing: admitLocked refuses it.
func (p *Pool) planPrefix(req Request, need int, l *Lease) (fresh int, err error) {
	for {
		p.mu.Lock()
		t, err := p.mu.tenants.Lookup(req.Tenant)
		if err != nil {
			p.mu.Unlock()
			return 0, err
		}
		dom := t.Domain
		if p.prefixOff(req) || len(req.TokenIDs) == 0 || l.keysFor == dom {
			c := &p.mu.prefix
			c.matched = c.matched[:0]
			if !p.prefixOff(req) {
				p.matchLocked(dom, l.keys, maxHitPages(req, p.geom.TokensPerPage))
			}
			fresh = need - len(c.matched)
			newToTenant, _ := p.chargeForMatchLocked(t)
			if t.Used+fresh+newToTenant > t.Quota {
				fresh = 0
			}
			c.matched = c.matched[:0]
			p.mu.Unlock()
			return fresh, nil
		}
		p.mu.Unlock()
		l.keys = appendPageKeys(l.keys[:0], prefixRoot(dom.Name, req.Adapter), p.geom.TokensPerPage, req.TokenIDs)
		l.keysFor = dom
	}
}

// prefixOff reports whether req takes no part in prefix sharing.
func (p *Pool) prefixOff(req Request) bool {
	return p.prefixDisabled || (len(req.TokenIDs) == 0 && len(req.PageKeys) == 0)
}

// matchLocked finds the longest run of leading keys cached in dom (at most
// limit pages) and leaves its entries in c.matched.
func (p *Pool) matchLocked(dom *isolation.Domain, keys []BlockKey, limit int) int {
	c := &p.mu.prefix
	c.matched = c.matched[:0]
	for _, k := range keys[:min(limit, len(keys))] {
		e := c.lookup(dom, k)
		if e == nil {
			break
		}
		if info, _ := p.mu.alloc.Info(e.page); info.Refs >= allocator.MaxRefs {
			break // shared as often as a page can be; the rest is computed afresh
		}
		c.matched = append(c.matched, e)
	}
	return len(c.matched)
}

// claimPages takes fresh pages from the free-page semaphore. When free
// pages are short it evicts least recently used cached pages (of any
// domain) and waits for their scrub; a waiting admission also wakes up
// when pages become evictable.
func (p *Pool) claimPages(ctx context.Context, req Request, fresh int, l *Lease, wait bool) error {
	if fresh == 0 {
		return nil // all shared, or refused by quota in admitLocked
	}
	for {
		if p.freePages.TryAcquire(int64(fresh)) {
			return nil
		}
		evicted, err := p.evictFor(req, fresh, l)
		if err != nil {
			return err
		}
		if evicted > 0 {
			continue
		}
		if !wait {
			return p.refuseExhausted(req, fresh, nil)
		}
		p.mu.Lock()
		if p.mu.prefix.parked == nil {
			p.mu.prefix.parked = make(chan struct{})
		}
		parked := p.mu.prefix.parked
		p.mu.Unlock()
		attempt, cancel := context.WithCancel(ctx)
		go func() {
			select {
			case <-parked:
				cancel()
			case <-attempt.Done():
			}
		}()
		err = p.freePages.Acquire(attempt, int64(fresh))
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return p.refuseWaitEnded(req, fresh, err)
		}
		// Pages became evictable: go round and evict them.
	}
}

// evictFor evicts enough cached pages for an admission short of fresh free
// pages, scrubs them and waits for the scrub, so that they are clean free
// pages when it returns. It evicts nothing if eviction could not make the
// admission fit, and never the pages the admission is about to share.
func (p *Pool) evictFor(req Request, fresh int, l *Lease) (int, error) {
	p.mu.Lock()
	if err := p.stateErrLocked(); err != nil {
		p.mu.Unlock()
		return 0, err
	}
	c := &p.mu.prefix
	if c.lruLen == 0 {
		p.mu.Unlock()
		return 0, nil
	}
	if !p.prefixOff(req) {
		if t, err := p.mu.tenants.Lookup(req.Tenant); err == nil {
			p.matchLocked(t.Domain, l.keys, maxHitPages(req, p.geom.TokensPerPage))
		}
	}
	pinned := 0
	for _, e := range c.matched {
		e.pinned = true
		if e.inLRU {
			pinned++
		}
	}
	free := p.mu.alloc.Count(allocator.Free)
	evictable := c.lruLen - pinned
	want := fresh - free
	if want <= 0 {
		// Free pages exist but others have claimed them or queue for
		// them first: make room for this admission on top.
		want = fresh
	}
	var pages []int32
	if fresh <= free+evictable {
		pages = p.evictLocked(nil, min(want, evictable))
	}
	for _, e := range c.matched {
		e.pinned = false
	}
	c.matched = c.matched[:0]
	p.mu.Unlock()
	if len(pages) == 0 {
		return 0, nil
	}
	if err := p.scrubAndWait(pages); err != nil {
		return 0, err
	}
	return len(pages), nil
}

// evictLocked evicts up to n unpinned cached pages, least recently used
// first, appends them to pages and counts them in flight in the
// quarantine. The caller must scrub them.
func (p *Pool) evictLocked(pages []int32, n int) []int32 {
	c := &p.mu.prefix
	start := len(pages)
	var removed []KVEvent
	for e := c.lruHead; e != nil && len(pages)-start < n; {
		next := e.next
		if !e.pinned {
			c.lruRemove(e)
			c.drop(e)
			c.counters(e.dom).evictedPages++
			pages = append(pages, e.page)
			if c.events.enabled() {
				if k := len(removed) - 1; k >= 0 && removed[k].Domain == e.dom.Name {
					removed[k].Keys = append(removed[k].Keys, e.key)
					removed[k].Tokens += p.geom.TokensPerPage
				} else {
					removed = append(removed, KVEvent{Kind: KVRemoved, Domain: e.dom.Name, Keys: []BlockKey{e.key}, Tokens: p.geom.TokensPerPage})
				}
			}
		}
		e = next
	}
	if err := p.mu.alloc.Evict(pages[start:]); err != nil {
		panic(fmt.Sprintf("kvcache: evicting cached pages: %v", err)) // every LRU page is Cached
	}
	p.q.BeginLocked(len(pages) - start)
	for _, ev := range removed {
		c.events.emitLocked(ev)
	}
	return pages
}

// scrubAndWait fills evicted pages and waits for the fill, so that the
// caller finds them free when it returns.
func (p *Pool) scrubAndWait(pages []int32) error {
	slices.Sort(pages)
	fence, err := p.q.Issue(pages, cudaops.Ordering{})
	if err == nil {
		err = fence.Wait()
	}
	return p.finishScrub(pages, err)
}

// shareMatchedLocked retains the matched prefix for a lease of t and
// appends its handles. It runs after every check and cannot fail.
func (p *Pool) shareMatchedLocked(t *isolation.Tenant, handles []allocator.Handle) []allocator.Handle {
	c := &p.mu.prefix
	for _, e := range c.matched {
		h, err := p.mu.alloc.Retain(e.page, e.dom.ID)
		if err != nil {
			panic(fmt.Sprintf("kvcache: retaining matched page %d: %v", e.page, err))
		}
		if e.inLRU {
			c.lruRemove(e)
		}
		if r := e.ref(t); r != nil {
			r.refs++
		} else {
			e.tenants = append(e.tenants, tenantRef{t: t, refs: 1})
		}
		handles = append(handles, h)
	}
	return handles
}

// chargeForMatchLocked returns how many matched pages t holds no other
// lease on (it is charged for those) and how many of them are Cached.
func (p *Pool) chargeForMatchLocked(t *isolation.Tenant) (newToTenant, cached int) {
	for _, e := range p.mu.prefix.matched {
		if e.ref(t) == nil {
			newToTenant++
		}
		if e.inLRU {
			cached++
		}
	}
	return newToTenant, cached
}

// countMatchLocked records an admission's lookup in its domain's stats.
func (p *Pool) countMatchLocked(req Request, dom *isolation.Domain, keys int) {
	if p.prefixOff(req) {
		return
	}
	c := p.mu.prefix.counters(dom)
	hits := len(p.mu.prefix.matched)
	looked := min(keys, maxHitPages(req, p.geom.TokensPerPage))
	c.hitPages += uint64(hits)
	c.missPages += uint64(looked - hits)
	c.hitTokens += uint64(hits * p.geom.TokensPerPage)
}

// releasePagesLocked drops l's references: published pages whose last
// reference goes are kept as Cached (LRU), the others are quarantined and
// appended to pages. Tenants are uncharged once per page they no longer
// hold.
func (p *Pool) releasePagesLocked(l *Lease, pages []int32) []int32 {
	c := &p.mu.prefix
	owner := l.domain.ID
	private := 0
	// Shared pages are released one by one, last page first, so that a
	// prompt's deepest pages become the least recently used and are
	// evicted before the pages its other prompts share.
	for i := len(l.handles) - 1; i >= 0; i-- {
		h := l.handles[i]
		e := c.byPage[h.Page]
		if e == nil {
			continue
		}
		r := e.ref(l.tenant)
		if r == nil {
			panic(fmt.Sprintf("kvcache: lease %q holds shared page %d without a tenant reference", l.id, h.Page))
		}
		if r.refs--; r.refs == 0 {
			last := len(e.tenants) - 1
			*r = e.tenants[last]
			e.tenants = e.tenants[:last]
			p.mu.tenants.Uncharge(l.tenant, 1)
		}
		var err error
		if e.detached {
			before := len(pages)
			if pages, err = p.mu.alloc.Release(pages, l.handles[i:i+1], owner); err == nil && len(pages) > before {
				c.drop(e)
			}
		} else {
			var parked []int32
			if parked, err = p.mu.alloc.Park(c.parkScratch()[:0], l.handles[i:i+1], owner); err == nil && len(parked) > 0 {
				c.lruPush(e)
				c.wakeParked()
			}
		}
		if err != nil {
			panic(fmt.Sprintf("kvcache: lease %q held shared page %d the allocator refuses: %v", l.id, h.Page, err))
		}
		l.handles[i].Page = -1 // done; the page may have left the index
	}
	// Private pages go in one batch; compact them to the front first.
	for _, h := range l.handles {
		if h.Page >= 0 {
			l.handles[private] = h
			private++
		}
	}
	p.mu.tenants.Uncharge(l.tenant, private)
	pages, err := p.mu.alloc.Release(pages, l.handles[:private], owner)
	if err != nil {
		panic(fmt.Sprintf("kvcache: lease %q held pages the allocator refuses: %v", l.id, err))
	}
	l.handles = l.handles[:0]
	return pages
}

// parkScratch is a one-page buffer for Park's output; used under Pool.mu.
func (c *prefixCache) parkScratch() []int32 { return c.parkBuf[:] }

// clearLocked drops the whole cache: Cached pages are evicted (appended to
// pages, counted in flight), pages still held by leases leave the key
// index and are scrubbed when their last lease ends.
func (p *Pool) clearLocked(pages []int32) []int32 {
	c := &p.mu.prefix
	pages = p.evictLocked(pages, c.lruLen)
	for _, e := range c.byPage {
		if e != nil && !e.detached {
			c.unindex(e)
		}
	}
	c.events.emitLocked(KVEvent{Kind: KVCleared})
	return pages
}

// ClearPrefixCache drops every domain's prefix cache, as after a model
// weight update. Cached pages are scrubbed; pages live leases share stay
// theirs and are scrubbed when the last of them ends.
func (p *Pool) ClearPrefixCache() error {
	p.mu.Lock()
	if p.mu.closed {
		p.mu.Unlock()
		return ErrPoolClosed
	}
	pages := p.clearLocked(nil)
	p.mu.Unlock()
	return p.scrub(pages, cudaops.Ordering{})
}

// publishLocked publishes l's full prompt pages [l.published, upTo) to its
// domain, emitting one KVStored event per run of newly published pages.
func (p *Pool) publishLocked(l *Lease, upTo int) {
	c := &p.mu.prefix
	tpp := p.geom.TokensPerPage
	var stored *KVEvent
	flush := func() {
		if stored != nil {
			c.events.emitLocked(*stored)
			stored = nil
		}
	}
	for i := l.published; i < upTo; i++ {
		page := l.table[i]
		if c.byPage[page] != nil || c.lookup(l.domain, l.keys[i]) != nil {
			// Already shared (a hit), or another lease published the same
			// content first: this page stays private to l.
			flush()
			continue
		}
		e := &cacheEntry{key: l.keys[i], dom: l.domain, page: page, tenants: []tenantRef{{t: l.tenant, refs: 1}}}
		if i > 0 {
			e.parent = l.keys[i-1]
		}
		c.insert(e)
		c.counters(l.domain).storedPages++
		if c.events.enabled() {
			if stored == nil {
				stored = &KVEvent{Kind: KVStored, Domain: l.domain.Name, Parent: e.parent}
			}
			stored.Keys = append(stored.Keys, e.key)
			stored.Tokens += tpp
		}
	}
	flush()
	l.published = max(l.published, upTo)
}

// CachePrefix publishes the lease's full prompt pages that hold its first
// n tokens to its sharing domain's prefix cache, where later requests of
// the domain's tenants share them. n must not pass the written watermark
// (Commit) or the prompt: only computed prompt KV is shared. A published
// page is immutable: the engine must not write it again. It returns the
// number of prompt tokens of the lease that are now shared or published
// (a multiple of the page size). With prefix caching disabled, or for a
// request that carried no tokens or keys, it publishes nothing and
// returns 0.
func (l *Lease) CachePrefix(n int) (int, error) {
	if err := l.live(); err != nil {
		return 0, err
	}
	p := l.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.closed {
		return 0, ErrPoolClosed
	}
	if err := l.live(); err != nil {
		return 0, err
	}
	switch w := l.Written(); {
	case n < 0 || n > w:
		return 0, fmt.Errorf("%w: CachePrefix(%d) with %d tokens written", ErrInvalidArgument, n, w)
	case n > l.prompt:
		return 0, fmt.Errorf("%w: CachePrefix(%d) past the prompt of %d tokens", ErrInvalidArgument, n, l.prompt)
	}
	if p.prefixDisabled || len(l.keys) == 0 {
		return 0, nil
	}
	upTo := min(n/p.geom.TokensPerPage, len(l.keys))
	p.publishLocked(l, upTo)
	return l.published * p.geom.TokensPerPage, nil
}

// HitTokens is how many leading prompt tokens the lease shares from the
// prefix cache: their KV is already in its first pages, and the engine
// starts prefill after them.
func (l *Lease) HitTokens() int {
	if l.pool == nil {
		return 0
	}
	return l.hitPages * l.pool.geom.TokensPerPage
}

// Domain returns the name of the sharing domain the lease was admitted in.
func (l *Lease) Domain() string {
	if l.domain == nil {
		return ""
	}
	return l.domain.Name
}

// DomainStats is one sharing domain's prefix-cache counters. Hits and
// misses count full prompt pages looked up by admitted requests.
type DomainStats struct {
	Name         string
	Shared       bool // declared by name, not a tenant's own
	Tenants      int
	IndexedPages int // published pages still in the cache, shared or cached
	CachedPages  int // indexed pages no lease holds: evictable
	HitPages     uint64
	MissPages    uint64
	HitTokens    uint64
	StoredPages  uint64
	EvictedPages uint64
}

// PrefixStats summarises the prefix cache.
type PrefixStats struct {
	Enabled       bool
	Domains       []DomainStats // every domain, in creation order
	EventsSent    uint64
	EventsDropped uint64
}

func (p *Pool) prefixStatsLocked() PrefixStats {
	c := &p.mu.prefix
	s := PrefixStats{Enabled: !c.disabled, EventsSent: c.events.sent, EventsDropped: c.events.dropped}
	for _, d := range p.mu.tenants.Domains() {
		k := c.counters(d)
		s.Domains = append(s.Domains, DomainStats{
			Name: d.Name, Shared: d.Shared, Tenants: d.Tenants,
			IndexedPages: k.entries, CachedPages: k.cachedPages,
			HitPages: k.hitPages, MissPages: k.missPages, HitTokens: k.hitTokens,
			StoredPages: k.storedPages, EvictedPages: k.evictedPages,
		})
	}
	return s
}

// checkSharingLocked verifies the leases, refcounts, tenant charges and
// the cache index against the allocator:
//
//   - every lease page is in use by the lease's domain at the lease's
//     generation, and its table matches its handles;
//   - each page's refcount is the number of live leases holding it;
//   - a page without an entry is held by at most one lease;
//   - each entry's per-tenant counts are its leases' tenants, and each
//     tenant is charged once per page it holds;
//   - every indexed page is owned by its entry's domain, Cached exactly
//     when it is on the LRU list, and found under its key; every Cached
//     page has an entry.
func (p *Pool) checkSharingLocked() error {
	a, c := p.mu.alloc, &p.mu.prefix
	refs := make([]int, p.total)
	charged := make(map[*isolation.Tenant]int)
	type tp struct {
		t    *isolation.Tenant
		page int32
	}
	entryRefs := make(map[tp]int)
	for id, l := range p.mu.leases {
		if l.id != id || l.state.Load() != leaseLive {
			return fmt.Errorf("kvcache: lease table entry %q holds lease %q in state %d", id, l.id, l.state.Load())
		}
		if len(l.table) != len(l.handles) {
			return fmt.Errorf("kvcache: lease %q has %d handles, %d table entries", id, len(l.handles), len(l.table))
		}
		for i, h := range l.handles {
			info, err := a.Info(h.Page)
			if err != nil {
				return err
			}
			if info.State != allocator.InUse || info.Owner != l.domain.ID || info.Gen != h.Gen || l.table[i] != h.Page {
				return fmt.Errorf("kvcache: lease %q page %d: %+v, want in use by domain %q at generation %d",
					id, h.Page, info, l.domain.Name, h.Gen)
			}
			refs[h.Page]++
			if e := c.byPage[h.Page]; e != nil {
				if entryRefs[tp{l.tenant, h.Page}]++; entryRefs[tp{l.tenant, h.Page}] == 1 {
					charged[l.tenant]++
				}
			} else {
				charged[l.tenant]++
			}
		}
	}
	lru := 0
	for e := c.lruHead; e != nil; e = e.next {
		if !e.inLRU || (e.next != nil && e.next.prev != e) || (e.next == nil && c.lruTail != e) {
			return fmt.Errorf("kvcache: LRU list broken at page %d", e.page)
		}
		if lru++; lru > p.total {
			return fmt.Errorf("kvcache: LRU list cycles")
		}
	}
	if lru != c.lruLen || lru != a.Count(allocator.Cached) {
		return fmt.Errorf("kvcache: LRU holds %d pages, counter %d, allocator has %d cached", lru, c.lruLen, a.Count(allocator.Cached))
	}
	indexed := 0
	for page := range int32(p.total) {
		info, _ := a.Info(page)
		if info.Refs != refs[page] {
			return fmt.Errorf("kvcache: page %d has %d references, %d live leases hold it", page, info.Refs, refs[page])
		}
		e := c.byPage[page]
		if e == nil {
			if info.State == allocator.Cached {
				return fmt.Errorf("kvcache: page %d is cached without an index entry", page)
			}
			if refs[page] > 1 {
				return fmt.Errorf("kvcache: unpublished page %d held by %d leases", page, refs[page])
			}
			continue
		}
		if e.page != page || info.Owner != e.dom.ID {
			return fmt.Errorf("kvcache: index entry of page %d names page %d of domain %q, page owner is %d", page, e.page, e.dom.Name, info.Owner)
		}
		switch {
		case info.State == allocator.Cached && !e.inLRU,
			info.State == allocator.InUse && e.inLRU,
			info.State != allocator.Cached && info.State != allocator.InUse,
			e.detached && info.State != allocator.InUse:
			return fmt.Errorf("kvcache: indexed page %d is %s (LRU %v, detached %v)", page, info.State, e.inLRU, e.detached)
		}
		total := 0
		for _, r := range e.tenants {
			if r.refs <= 0 || entryRefs[tp{r.t, page}] != r.refs {
				return fmt.Errorf("kvcache: page %d counts %d leases of tenant %q, %d hold it", page, r.refs, r.t.Name, entryRefs[tp{r.t, page}])
			}
			total += r.refs
		}
		if total != refs[page] {
			return fmt.Errorf("kvcache: page %d tenant counts sum to %d, %d leases hold it", page, total, refs[page])
		}
		if !e.detached {
			indexed++
			if c.lookup(e.dom, e.key) != e {
				return fmt.Errorf("kvcache: page %d not found under its key in domain %q", page, e.dom.Name)
			}
		}
	}
	chained := 0
	for _, head := range c.byKey {
		for e := head; e != nil; e = e.chain {
			if chained++; chained > p.total || e.detached || c.byPage[e.page] != e {
				return fmt.Errorf("kvcache: key index holds a stale entry for page %d", e.page)
			}
		}
	}
	if chained != indexed {
		return fmt.Errorf("kvcache: key index holds %d entries, %d pages are indexed", chained, indexed)
	}
	for _, t := range p.mu.tenants.Tenants() {
		if t.Used != charged[t] {
			return fmt.Errorf("kvcache: tenant %q charged %d pages, holds %d", t.Name, t.Used, charged[t])
		}
	}
	return nil
}
