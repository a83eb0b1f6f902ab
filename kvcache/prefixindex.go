package kvcache

import (
	"github.com/kvfence/kvfence/isolation"
)

// prefixIndex is the pool's index of published pages: per sharing domain,
// full-page keys to the one page that holds that content, and an LRU list
// of the indexed pages no lease holds (Cached, so evictable). It knows
// entries and pages only; the pool keeps it in step with the allocator and
// the leases (prefix.go), and Pool.Check verifies the two agree.
//
// Invariants (check):
//
//   - byPage[e.page] == e for every entry e; an entry is either indexed
//     (found by lookup(e.dom, e.key)) or detached (out of the key index,
//     still held by leases, dropped when the last one ends);
//   - every key chain holds only indexed entries, each once;
//   - the LRU list is a well-linked list of exactly the entries with inLRU
//     set, lruLen long, and none of them is detached;
//   - each domain's counters of indexed and cached entries match the
//     entries;
//   - epoch changes whenever a key enters or leaves the index, so a match
//     made at one epoch is still valid at the same epoch.
//
// Guarded by Pool.mu.
type prefixIndex struct {
	byKey  map[uint64]*cacheEntry // index64 → chain of entries
	byPage []*cacheEntry          // page → its entry, nil for private pages
	// The LRU list, least recently used first.
	lruHead, lruTail *cacheEntry
	lruLen           int
	epoch            uint64
	domains          []domainCounters // index = domain ID - 1, grown on demand
}

// cacheEntry is one published page: full, immutable, in one domain.
type cacheEntry struct {
	key      BlockKey
	parent   BlockKey // zero for a prompt's first page
	dom      *isolation.Domain
	page     int32
	detached bool // out of the key index (ClearPrefixCache) while leases still hold it

	prev, next *cacheEntry // LRU links while the page is Cached
	inLRU      bool
	pinned     bool        // scratch: matched by the admission now evicting
	chain      *cacheEntry // next entry with the same index64

	// leases is the number of live leases holding the page (its allocator
	// refcount), and tenants counts them per tenant: each tenant is charged
	// once for the page, whatever its number of leases.
	leases  int
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
	entries                        int // entries now, cached, in use or detached
}

func (x *prefixIndex) init(pages int) {
	x.byKey = make(map[uint64]*cacheEntry)
	x.byPage = make([]*cacheEntry, pages)
}

func (x *prefixIndex) counters(d *isolation.Domain) *domainCounters {
	for int(d.ID) > len(x.domains) {
		x.domains = append(x.domains, domainCounters{})
	}
	return &x.domains[d.ID-1]
}

// lookup returns the indexed entry of key k in domain d, or nil. The
// domain is part of the match: no key, forged or colliding, reaches
// another domain's entry.
func (x *prefixIndex) lookup(d *isolation.Domain, k BlockKey) *cacheEntry {
	for e := x.byKey[k.index64(uint32(d.ID))]; e != nil; e = e.chain {
		if e.key == k && e.dom == d {
			return e
		}
	}
	return nil
}

// insert indexes a new entry; its page must have none.
func (x *prefixIndex) insert(e *cacheEntry) {
	i := e.key.index64(uint32(e.dom.ID))
	e.chain = x.byKey[i]
	x.byKey[i] = e
	x.byPage[e.page] = e
	x.counters(e.dom).entries++
	x.epoch++
}

// unindex takes e out of the key index; it stays in byPage, detached.
func (x *prefixIndex) unindex(e *cacheEntry) {
	i := e.key.index64(uint32(e.dom.ID))
	if head := x.byKey[i]; head == e {
		x.byKey[i] = e.chain
	} else {
		for pp := head; pp != nil; pp = pp.chain {
			if pp.chain == e {
				pp.chain = e.chain
				break
			}
		}
	}
	if x.byKey[i] == nil {
		delete(x.byKey, i)
	}
	e.chain = nil
	e.detached = true
	x.epoch++
}

// drop forgets e entirely: its page is leaving the cache.
func (x *prefixIndex) drop(e *cacheEntry) {
	if !e.detached {
		x.unindex(e)
	}
	x.byPage[e.page] = nil
	x.counters(e.dom).entries--
}

func (x *prefixIndex) lruPush(e *cacheEntry) {
	e.prev, e.next, e.inLRU = x.lruTail, nil, true
	if x.lruTail != nil {
		x.lruTail.next = e
	} else {
		x.lruHead = e
	}
	x.lruTail = e
	x.lruLen++
	x.counters(e.dom).cachedPages++
}

func (x *prefixIndex) lruRemove(e *cacheEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		x.lruHead = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		x.lruTail = e.prev
	}
	e.prev, e.next, e.inLRU = nil, nil, false
	x.lruLen--
	x.counters(e.dom).cachedPages--
}

// check verifies the index's own invariants (see the type's doc) and
// reports every problem to c.
func (x *prefixIndex) check(c *checker) {
	lru := 0
	for e := x.lruHead; e != nil; e = e.next {
		if !e.inLRU || e.detached || (e.next != nil && e.next.prev != e) || (e.next == nil && x.lruTail != e) {
			c.failf("prefix index: LRU list broken at page %d", e.page)
			break
		}
		if lru++; lru > len(x.byPage) {
			c.failf("prefix index: LRU list cycles")
			break
		}
	}
	if lru != x.lruLen {
		c.failf("prefix index: LRU list holds %d entries, counter says %d", lru, x.lruLen)
	}
	entries := make([]int, len(x.domains))
	cached := make([]int, len(x.domains))
	indexed, inLRU := 0, 0
	for page, e := range x.byPage {
		if e == nil {
			continue
		}
		if int(e.page) != page {
			c.failf("prefix index: page %d holds the entry of page %d", page, e.page)
			continue
		}
		if d := int(e.dom.ID) - 1; d < len(entries) {
			entries[d]++
			if e.inLRU {
				cached[d]++
			}
		} else {
			c.failf("prefix index: page %d is in domain %q, which has no counters", page, e.dom.Name)
		}
		if e.inLRU {
			inLRU++
		}
		if !e.detached {
			indexed++
			if x.lookup(e.dom, e.key) != e {
				c.failf("prefix index: page %d not found under its key in domain %q", page, e.dom.Name)
			}
		}
	}
	if inLRU != lru {
		c.failf("prefix index: %d entries are marked as in the LRU list, it holds %d", inLRU, lru)
	}
	chained := 0
	for _, head := range x.byKey {
		for e := head; e != nil; e = e.chain {
			if chained++; chained > len(x.byPage) {
				c.failf("prefix index: key chains cycle")
				return
			}
			if e.detached || int(e.page) >= len(x.byPage) || x.byPage[e.page] != e {
				c.failf("prefix index: key chains hold a stale entry for page %d", e.page)
			}
		}
	}
	if chained != indexed {
		c.failf("prefix index: key chains hold %d entries, %d pages are indexed", chained, indexed)
	}
	for d, k := range x.domains {
		if k.entries != entries[d] || k.cachedPages != cached[d] {
			c.failf("prefix index: domain %d counts %d entries (%d cached), has %d (%d cached)",
				d+1, k.entries, k.cachedPages, entries[d], cached[d])
		}
	}
}
