package kvcache

import (
	"fmt"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
)

// This file holds the pool's side of the prefix cache: admission's
// matching and eviction, publication (CachePrefix), release of shared
// pages, clearing, and the stats that cover them. The index itself is
// prefixIndex (prefixindex.go). See the package doc for the model.

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
		return fmt.Errorf("%w: request carries both TokenIDs and PageKeys; give one", ErrInvalidRequest)
	case len(req.TokenIDs) > 0 && len(req.TokenIDs) != req.PromptTokens:
		return fmt.Errorf("%w: %d prompt tokens given, PromptTokens = %d", ErrInvalidRequest, len(req.TokenIDs), req.PromptTokens)
	case len(req.PageKeys) > req.PromptTokens/tokensPerPage:
		return fmt.Errorf("%w: %d page keys for a prompt of %d full pages", ErrInvalidRequest, len(req.PageKeys), req.PromptTokens/tokensPerPage)
	case req.Adapter != "" && isolation.NameProblem(req.Adapter, MaxIDLen) != "":
		return fmt.Errorf("%w: adapter ID %q: %s (want at most %d bytes of UTF-8 without a NUL)",
			ErrInvalidRequest, req.Adapter, isolation.NameProblem(req.Adapter, MaxIDLen), MaxIDLen)
	}
	return validatePageExtra(req, tokensPerPage)
}

// PageKeys appends to dst the keys of the full pages of tokens as tenant's
// requests would derive them now (in its current domain, under adapter),
// so that an engine can hash a prompt once, ahead of admission, and pass
// the keys in Request.PageKeys.
func (p *Pool) PageKeys(tenant, adapter string, tokens []int32, dst []BlockKey) ([]BlockKey, error) {
	if adapter != "" && isolation.NameProblem(adapter, MaxIDLen) != "" {
		return dst, fmt.Errorf("%w: adapter ID %q: %s (want at most %d bytes of UTF-8 without a NUL)",
			ErrInvalidArgument, adapter, isolation.NameProblem(adapter, MaxIDLen), MaxIDLen)
	}
	p.mu.Lock()
	t, err := p.tenantsLocked().Lookup(tenant)
	var domain string
	if err == nil {
		domain = t.Domain.Name
	}
	p.mu.Unlock()
	if err != nil {
		return dst, err
	}
	return appendPageKeys(dst, prefixRoot(domain, adapter), p.tpp, tokens), nil
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
	t, err := p.tenantsLocked().Lookup(tenant)
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
	if err := validatePrefix(Request{PromptTokens: l.prompt, TokenIDs: tokens, Adapter: adapter}, p.tpp); err != nil {
		return fmt.Errorf("%w: lease %q: %w", ErrInvalidArgument, l.id, err)
	}
	// Hashed outside Pool.mu, in the domain of the incarnation it reads
	// under the lock (which never changes while that incarnation lives):
	// the lease may end and be admitted into again meanwhile, and the
	// keys are then the old incarnation's.
	p.mu.Lock()
	seq, dom := l.seq, l.Domain()
	p.mu.Unlock()
	keys := appendPageKeys(nil, prefixRoot(dom, adapter), p.tpp, tokens)
	if testHookAttachTokensHashed != nil {
		testHookAttachTokensHashed()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.closed {
		return ErrPoolClosed
	}
	if err := l.live(); err != nil {
		return err
	}
	if l.seq != seq {
		return ErrLeaseReleased
	}
	if len(l.keys) > 0 || len(l.tokens) > 0 || l.published > 0 {
		return fmt.Errorf("%w: lease %q already has prefix material", ErrInvalidArgument, l.id)
	}
	if l.importing() {
		return fmt.Errorf("%w: lease %q is still being imported", ErrLeasePhase, l.id)
	}
	l.keys, l.keysFor, l.adapter = keys, l.domain, adapter
	l.tokens = append(l.tokens[:0], tokens...)
	return nil
}

// testHookAttachTokensHashed, if set (by tests only), runs in
// AttachTokens once the keys are derived, before it takes Pool.mu.
var testHookAttachTokensHashed func()

// matchLocked finds the longest run of l's leading pages cached in dom
// under adapter (at most limit pages) and leaves their entries in l.match:
// by walking the trie with l's tokens, or, byKeys, by looking up l's keys.
// A match made at the index's current epoch, in the same domain, is reused
// as it is: the index has not changed since, so neither has the answer.
func (p *Pool) matchLocked(l *Lease, dom *tenancy.Domain, adapter string, limit int, byKeys bool) {
	p.assertHeld()
	x, m := &p.mu.prefix, &l.match
	if m.valid && m.epoch == x.epoch && m.domain == dom {
		return
	}
	m.entries = m.entries[:0]
	if byKeys {
		for _, k := range l.keys[:min(limit, len(l.keys))] {
			e := x.lookup(dom, k)
			if e == nil || !e.matchable() {
				break
			}
			m.entries = append(m.entries, e)
		}
	} else {
		tpp := p.tpp
		node := x.root(dom, adapter, false)
		for i := 0; node != nil && i < limit; i++ {
			e := node.child(l.tokens[i*tpp:(i+1)*tpp], dom, x.seed)
			if e == nil || !e.matchable() {
				break
			}
			m.entries = append(m.entries, e)
			node = &e.node
		}
	}
	m.ckpt, m.cut = nil, 0
	if p.hybrid() {
		p.matchCheckpointLocked(l)
	}
	m.epoch, m.domain, m.valid = x.epoch, dom, true
}

// weighMatchLocked returns how many of l's matched pages tenant t holds no
// other lease on (it is charged for those), how many of them are Cached
// (no lease holds them: on the LRU list, or pinned by checkpoints), and
// how many only the host tier holds (onload: the lease takes a fresh page
// for each, see tier_onload.go). A page shared as often as a page can be
// ends the match: the rest is computed afresh (in a hybrid pool, from the
// checkpoint before it).
func (p *Pool) weighMatchLocked(l *Lease, t *tenancy.Tenant) (newToTenant, cached, onload int) {
	p.assertHeld()
	for i, e := range l.match.entries {
		if e.leases >= allocator.MaxRefs {
			l.match.entries = l.match.entries[:i]
			if p.hybrid() {
				p.matchCheckpointLocked(l)
				return p.weighMatchLocked(l, t)
			}
			break
		}
		if e.page < 0 {
			onload++
			continue
		}
		if e.ref(t) == nil {
			newToTenant++
		}
		if e.leases == 0 {
			cached++
		}
	}
	return newToTenant, cached, onload
}

// evictLocked evicts for n free units of group gi, least recently used
// first, of any domain but never one of keep (the pages the evicting
// admission is about to share, and the checkpoint at their end): cached
// pages of the per-token group, and, in a hybrid pool, state checkpoints
// (checkpoint.go) for their units, or for the pages they pin once the
// LRU list has none left. What it evicts, in any group, is appended to b
// and counted in flight in the quarantine; it returns the units of gi
// freed, which may be fewer than n. The caller must scrub b (p.fills.Add(1)
// first), after it has run off, the offload of the pages the host tier
// takes (offerLocked: their entries stay in the index); with off nil (the
// cache is being cleared) every evicted entry leaves the index.
func (p *Pool) evictLocked(gi int, b *scrubBatch, n int, keep []*cacheEntry, off *tierWrite) (freed int) {
	p.assertHeld()
	x := &p.mu.prefix
	for _, e := range keep {
		e.pinned = true
	}
	defer func() {
		for _, e := range keep {
			e.pinned = false
		}
	}()
	if gi != 0 {
		freed = p.evictCheckpointsLocked(b, gi, n, off)
		if p.tier != nil && off != nil {
			p.placeOffloadLocked(off) // while keep is pinned: the tier evicts none of it
		}
		return freed
	}
	pages := b.spaces[0]
	start := len(pages)
	for {
		for e := x.lruHead; e != nil && len(pages)-start < n; {
			next := e.next
			if !e.pinned {
				x.lruRemove(e)
				x.counters(e.dom).evictedPages++
				pages = append(pages, e.page)
				// Removed from the device now, unless the tier is about to
				// store it: then after the store (finishTierWriteLocked),
				// so that a router always finds the page's parent
				// somewhere.
				inTier := e.tier != nil
				if kept := p.offerLocked(e, off); !kept || inTier {
					if p.mu.events.enabled() {
						p.mu.events.gatherRemovedLocked(e.dom.Name, e.key, MediumDevice)
					}
					if !kept {
						x.drop(e) // last: e is a spare from here on
					}
				}
			}
			e = next
		}
		// Short still, with pages pinned by checkpoints: evict one, whose
		// pages join the LRU list, and go again.
		if len(pages)-start >= n || p.mu.ckpts.pinnedCached == 0 {
			break
		}
		b.spaces[0] = pages
		if p.evictCheckpointLocked(b, off) == nil {
			break
		}
		pages = b.spaces[0]
	}
	if p.tier != nil && off != nil {
		p.placeOffloadLocked(off) // while keep is pinned: the tier evicts none of it
	}
	if err := p.groups[0].alloc.Evict(pages[start:]); err != nil {
		panic(fmt.Sprintf("kvcache: evicting cached pages: %v", err)) // every LRU page is Cached
	}
	p.q.BeginLocked(0, len(pages)-start)
	p.mu.events.emitRemovedLocked(p.tpp)
	b.spaces[0] = pages
	return len(pages) - start
}

// shareMatchedLocked retains, in group gi, l's matched prefix for a
// lease of t and appends its handles, and its pages to table. It runs
// after every check and cannot fail. Matches are of the per-token group:
// in any other, it shares nothing.
func (p *Pool) shareMatchedLocked(l *Lease, t *tenancy.Tenant, gi int, handles []allocator.Handle, table []int32) ([]allocator.Handle, []int32) {
	p.assertHeld()
	if gi != 0 {
		return handles, table
	}
	x := &p.mu.prefix
	if l.onload != nil {
		l.onload.reset()
	}
	m := l.match.entries
	for i := 0; i < len(m); i++ {
		e := m[i]
		if e.page < 0 { // a run only the host tier holds: fresh pages
			j := i + 1
			for j < len(m) && m[j].page < 0 {
				j++
			}
			handles, table = p.onloadRunLocked(l, m[i:j], t.Domain.ID, handles, table)
			i = j - 1
			continue
		}
		h, err := p.groups[0].alloc.Retain(e.page, e.dom.ID)
		if err != nil {
			panic(fmt.Sprintf("kvcache: retaining matched page %d: %v", e.page, err))
		}
		if e.inLRU {
			x.lruRemove(e)
		} else if e.leases == 0 { // pinned by checkpoints
			p.mu.ckpts.pinnedCached--
		}
		e.leases++
		if r := e.ref(t); r != nil {
			r.refs++
		} else {
			e.tenants = append(e.tenants, tenantRef{t: t, refs: 1})
		}
		handles = append(handles, h)
		table = append(table, h.Page)
	}
	return handles, table
}

// countMatchLocked records an admission's lookup in its domain's stats.
func (p *Pool) countMatchLocked(req *Request, dom *tenancy.Domain, keys, hits int) {
	p.assertHeld()
	c := p.mu.prefix.counters(dom)
	looked := min(keys, maxHitPages(*req, p.tpp))
	c.hitPages += uint64(hits)
	c.missPages += uint64(looked - hits)
	c.hitTokens += uint64(hits * p.tpp)
}

// releasePagesLocked drops l's references to its pages of group gi:
// published pages whose last reference goes are kept as Cached (LRU),
// the others are quarantined and appended to pages. Tenants are uncharged
// once per page they no longer hold.
//
// Only the lease's first l.published pages of the per-token group can be
// in the index (its hits, and what CachePrefix or Preempt published: both
// count from the front), so only they are looked up; Check proves that no
// page past them is. The private pages among them are moved up to meet
// the rest, and all private pages go in one batch.
func (p *Pool) releasePagesLocked(l *Lease, gi int, pages []int32) []int32 {
	p.assertHeld()
	x, g := &p.mu.prefix, &p.groups[gi]
	owner := l.domain.ID
	hs := l.holds[gi].handles
	front := 0
	if gi == 0 {
		front = min(l.published, len(hs))
	}
	w := front // hs[w:] are the private pages found so far, then the rest
	// Shared pages are parked last page first, so that a prompt's deepest
	// pages become the least recently used and are evicted before the
	// pages its other prompts share: in one batch (one call, where a call
	// per page cost a warm admission a tenth of its time), and the pages
	// that became Cached join the LRU list in that order.
	parking := x.parking[:0]
	for i := front - 1; i >= 0; i-- {
		h := hs[i]
		e := x.byPage[h.Page]
		if e == nil {
			w--
			hs[w] = h
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
			g.tenants.Uncharge(l.tenant, 1)
		}
		e.leases--
		if !e.detached {
			parking = append(parking, h)
			continue
		}
		before := len(pages)
		var err error
		if pages, err = g.alloc.Release(pages, hs[i:i+1], owner); err != nil {
			panic(fmt.Sprintf("kvcache: lease %q held shared page %d the allocator refuses: %v", l.id, h.Page, err))
		}
		if len(pages) > before {
			x.drop(e) // e is a spare from here on
		}
	}
	if len(parking) > 0 {
		parked, err := g.alloc.Park(x.parked[:0], parking, owner)
		if err != nil {
			panic(fmt.Sprintf("kvcache: lease %q held shared pages the allocator refuses: %v", l.id, err))
		}
		for _, pg := range parked {
			if e := x.byPage[pg]; e.pins == 0 {
				x.lruPush(e)
			} else {
				p.mu.ckpts.pinnedCached++ // Cached, off the LRU list while pinned
			}
		}
		if len(parked) > 0 {
			p.wakePagesLocked() // evictable pages are pages for whoever waits
		}
		x.parking, x.parked = parking[:0], parked[:0]
	}
	private := hs[w:]
	g.tenants.Uncharge(g.mirror(l.tenant), len(private))
	pages, err := g.alloc.Release(pages, private, owner)
	if err != nil {
		panic(fmt.Sprintf("kvcache: lease %q held pages of group %q the allocator refuses: %v", l.id, g.name, err))
	}
	return pages
}

// clearLocked drops the whole cache: Cached pages are evicted (appended to
// pages, counted in flight), pages still held by leases leave the key
// index and are scrubbed when their last lease ends.
func (p *Pool) clearLocked(b *scrubBatch) {
	p.assertHeld()
	x := &p.mu.prefix
	if t := p.tier; t != nil {
		t.pending = p.clearTierLocked(t.pending) // first: no entry is left in the tier
	}
	// The checkpoints first: their units are scrubbed (one being restored
	// into an admitted lease once its restore ends), and the pages they
	// pinned join the LRU list.
	for c := p.mu.ckpts.lruHead; c != nil; {
		next := c.next
		p.dropCheckpointLocked(c, b, nil)
		p.mu.ckpts.stats.Evicted++
		c = next
	}
	// Those being taken let their pages go now (their copy ends in a
	// race, and scrubs their units), so that no page this clear detaches
	// is pinned with no lease to release it.
	for c := range p.mu.ckpts.loose {
		if c.copying && !c.dropped {
			p.unpinChainLocked(c)
			c.dropped = true
		}
	}
	p.evictLocked(0, b, x.lruLen, nil, nil)
	for _, e := range x.byPage {
		if e != nil && !e.detached {
			x.unindex(e)
		}
	}
	p.mu.events.emitLocked(KVEvent{Kind: KVCleared})
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
	b := scrubBatch{}.batchFor(p)
	p.clearLocked(&b)
	fill := p.takeTierPendingLocked()
	p.fills.Add(1)
	p.mu.Unlock()
	p.scrubTier(fill)
	return p.scrub(b, cudaops.Ordering{})
}

// publishLocked publishes l's full pages [l.published, upTo) to its
// domain, under the keys in l.keys and, when l has their tokens, in the
// trie under the page before each (an orphan, if that page's content has
// no trie node now), emitting one KVStored event per run of newly
// published pages. A page already shared or already published by another
// lease stays private to l.
func (p *Pool) publishLocked(l *Lease, upTo int) {
	p.assertHeld()
	x := &p.mu.prefix
	tpp := p.tpp
	withTokens := len(l.tokens) >= upTo*tpp && len(l.extra) == 0 // the trie compares tokens only
	// A KVStored event per run of newly published pages l.keys[run:i],
	// emitted when the run ends; run < 0 while there is none.
	events := p.mu.events.enabled()
	run := -1
	flush := func(i int) {
		if run >= 0 {
			keys := append(p.mu.events.keysLocked(i-run), l.keys[run:i]...)
			var parent BlockKey
			if run > 0 {
				parent = l.keys[run-1]
			}
			ev := KVEvent{Kind: KVStored, Domain: l.domain.Name, Adapter: l.adapter, Parent: parent, Keys: keys, Tokens: len(keys) * tpp}
			if withTokens {
				ev.TokenIDs = p.mu.events.tokensLocked(l.tokens[run*tpp : i*tpp])
			}
			p.mu.events.emitLocked(ev)
			run = -1
		}
	}
	var parent *trieNode
	if withTokens {
		parent = p.contentNodeLocked(l, l.published-1)
	}
	adapter := x.adapterID(l.adapter)
	i := l.published
	for ; i < upTo; i++ {
		page := l.holds[0].pages[i]
		e := x.byPage[page] // a hit, or published before
		if e == nil {
			e = x.lookup(l.domain, l.keys[i]) // the same content, published by another lease first
		}
		if e != nil {
			if e.page < 0 && e.dom == l.domain {
				// Only the host tier holds this content: the lease's page,
				// which holds it too, is its device page from now on.
				p.attachOnloadedLocked(l, e, page)
			}
			flush(i)
			parent = trieNodeOf(e)
			continue
		}
		e = x.newEntry()
		e.key, e.dom, e.page, e.leases, e.adapter = l.keys[i], l.domain, page, 1, adapter
		e.tenants = append(e.tenants, tenantRef{t: l.tenant, refs: 1})
		if i > 0 {
			e.parent = l.keys[i-1]
		}
		if withTokens {
			e.setTokens(l.tokens[i*tpp : (i+1)*tpp])
		} else {
			e.tokens = nil // a key-only entry
		}
		x.insert(e, parent)
		parent = trieNodeOf(e)
		x.counters(l.domain).storedPages++
		if events && run < 0 {
			run = i
		}
	}
	flush(i)
	l.published = max(l.published, i)
}

// contentNodeLocked is the trie node of the content of l's page j: where
// page j+1 is published. For j < 0 it is the root of l's domain and
// adapter; nil if that content is not in the trie.
func (p *Pool) contentNodeLocked(l *Lease, j int) *trieNode {
	x := &p.mu.prefix
	if j < 0 {
		return x.root(l.domain, l.adapter, true)
	}
	if e := x.byPage[l.holds[0].pages[j]]; e != nil {
		return trieNodeOf(e)
	}
	if j < len(l.keys) {
		if e := x.lookup(l.domain, l.keys[j]); e != nil {
			return trieNodeOf(e)
		}
	}
	return nil
}

// trieNodeOf is e's own node, where its successors are, if e is in the
// trie.
func trieNodeOf(e *cacheEntry) *trieNode {
	if e.in == nil {
		return nil
	}
	return &e.node
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
//
// In a pool with window or state groups a page is worth sharing only
// with the state at a checkpoint after it (checkpoint.go): CachePrefix(n)
// there is CheckpointState(n) after all the context's work (n must be a
// multiple of TokensPerPage, and the engine's state must reflect exactly
// n tokens), and it returns the tokens up to the lease's deepest
// checkpoint, which later requests can use. An n within a page publishes
// nothing more.
func (l *Lease) CachePrefix(n int) (int, error) {
	if err := l.live(); err != nil {
		return 0, err
	}
	p := l.pool
	if p.hybrid() {
		return l.cacheHybridPrefix(n)
	}
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
	if p.prefixDisabled || (len(l.keys) == 0 && len(l.tokens) == 0) {
		return 0, nil
	}
	tpp := p.tpp
	upTo := n / tpp
	if have := len(l.keys); have < upTo && len(l.tokens) > 0 {
		// Keys of the pages to publish, once per page, derived outside
		// Pool.mu: chained on from the last key the lease knows (its
		// domain and adapter never change while it lives).
		seq, tokens := l.seq, l.tokens
		var parent BlockKey
		if have > 0 {
			parent = l.keys[have-1]
		}
		p.mu.Unlock()
		if have == 0 {
			parent = prefixRoot(l.Domain(), l.adapter)
		}
		extra := l.appendLeaseKeys(nil, parent, tpp, have, tokens[have*tpp:upTo*tpp])
		p.mu.Lock()
		if p.mu.closed {
			return 0, ErrPoolClosed
		}
		if l.state.Load() != leaseLive || l.seq != seq {
			return 0, ErrLeaseReleased
		}
		if len(l.keys) == have {
			l.keys = append(l.keys, extra...)
		}
	}
	p.publishLocked(l, min(upTo, len(l.keys)))
	return l.published * tpp, nil
}

// HitTokens is how many leading prompt tokens the lease shares from the
// prefix cache (the device's or the host tier's), or, for a request
// preempted and admitted again, its swap restored: their KV is already
// in its first pages, and the engine starts prefill after them. A swap
// restores at most all prompt tokens but the last, whose logits the
// engine needs.
func (l *Lease) HitTokens() int {
	if l == nil || l.pool == nil {
		return 0
	}
	return max(l.hitPages*l.pool.tpp, l.restored)
}

// Domain returns the name of the sharing domain the lease was admitted in.
func (l *Lease) Domain() string {
	if l == nil || l.domain == nil {
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
	// The host tier's part (zero without one): the slots the domain holds
	// there now and the most it may (TenantConfig.TierPages), pages
	// admissions onloaded from it (counted in HitPages too, as hits),
	// pages offloaded into it and evicted from it; in a hybrid pool, the
	// state checkpoints it holds there and the most it may (the same
	// share of the checkpoint slots), those stored, restored by hits and
	// evicted.
	TierPages              int
	TierBound              int
	TierHitPages           uint64
	TierHitTokens          uint64
	TierStoredPages        uint64
	TierEvictedPages       uint64
	TierCheckpoints        int
	TierCheckpointBound    int
	TierCheckpointsStored  uint64
	TierCheckpointHits     uint64
	TierCheckpointsEvicted uint64
}

// PrefixStats summarises the prefix cache.
type PrefixStats struct {
	Enabled       bool
	Domains       []DomainStats // every domain, in creation order
	EventsSent    uint64
	EventsDropped uint64
}

func (p *Pool) prefixStatsLocked() PrefixStats {
	p.assertHeld()
	x, ev := &p.mu.prefix, &p.mu.events
	doms := p.tenantsLocked().Domains()
	s := PrefixStats{Enabled: !p.prefixDisabled, EventsSent: ev.sent, EventsDropped: ev.dropped,
		Domains: make([]DomainStats, 0, len(doms))} // sized once: this runs under the lock a scrape waits on
	for _, d := range doms {
		k := x.counters(d)
		s.Domains = append(s.Domains, DomainStats{
			Name: d.Name, Shared: d.Shared, Tenants: d.Tenants,
			IndexedPages: k.entries, CachedPages: k.cachedPages,
			HitPages: k.hitPages, MissPages: k.missPages, HitTokens: k.hitTokens,
			StoredPages: k.storedPages, EvictedPages: k.evictedPages,
		})
		p.tierDomainStatsLocked(d, &s.Domains[len(s.Domains)-1])
	}
	return s
}
