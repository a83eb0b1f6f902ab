package kvcache

import (
	"fmt"
	"slices"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
)

// chainOf lists a bucket's chain, for Check.
func chainOf(e *cacheEntry) []*cacheEntry {
	var out []*cacheEntry
	for ; e != nil; e = e.sib {
		out = append(out, e)
	}
	return out
}

// prefixIndex is the pool's index of published pages, in two forms over
// the same entries:
//
//   - a trie of token IDs per sharing domain and adapter: a root, then one
//     entry per full page whose tokens follow its parent's. Admission
//     walks it comparing the tokens themselves, so a match needs no hash
//     of the prompt and cannot collide, and a walk touches only its own
//     path, however many other pages the index holds;
//   - full-page keys (the SHA-256 chain of BlockKey, derived once per
//     published page) to the one page that holds that content, for
//     requests that bring keys (Request.PageKeys), events and anything
//     that leaves the process. A page published without tokens (its lease
//     had keys only) is in this index alone; while a domain has such pages
//     (domainCounters.keyOnly) its token requests match by keys too.
//
// and an LRU list of the indexed pages no lease holds (Cached, so
// evictable). It knows entries and pages only; the pool keeps it in step
// with the allocator and the leases (prefix.go), and Pool.Check verifies
// the two agree.
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
//     entries, and keyOnly counts its indexed entries without tokens;
//   - every child of a trie node (a root or an entry's own node) is an
//     indexed entry with tokens that names that node as its own (in), once;
//     an entry out of the trie (unindexed, or whose parent was) names none;
//   - epoch changes whenever a key enters or leaves the index, so a match
//     made at one epoch is still valid at the same epoch;
//   - an entry on the spare list (dropped, waiting for reuse) is cleared
//     and reachable from none of the above.
//
// Guarded by Pool.mu.
type prefixIndex struct {
	byKey  map[uint64]*cacheEntry // index64 → chain of entries
	byPage []*cacheEntry          // page → its entry, nil for private pages
	roots  map[trieRoot]*trieNode // where a domain's pages under an adapter start
	seed   uint64                 // of pageHash, random per pool
	// orphans are indexed entries with tokens whose parent content has no
	// entry in a trie node (it was evicted, or published by keys only),
	// by index64 of their parent's key: the next entry published with
	// that key adopts them, so a page is found by a walk exactly when the
	// pages before it are, as a lookup by keys would find it.
	orphans map[uint64]*cacheEntry
	// The LRU list, least recently used first.
	lruHead, lruTail *cacheEntry
	lruLen           int
	epoch            uint64
	domains          []domainCounters // index = domain ID - 1, grown on demand
	// spare is the entries dropped from the index, kept for newEntry to
	// reuse with their token, tenant and child arrays (linked through
	// chain, spareLen of them, at most maxSpareEntries): a published page
	// then costs no allocation once the cache churns. See recycle for why
	// a reused entry cannot be reached by what pointed at it before.
	spare    *cacheEntry
	spareLen int
	// adapters are the adapter names entries were published under, by
	// adapterID (adapters[0] is ""), adapterIDs the way back: a pool
	// keeps every name it was given, as few as the engine's adapters.
	adapters   []string
	adapterIDs map[string]adapterID
	// parking and parked are releasePagesLocked's scratch: the shared
	// pages of a release, in the order they are parked, and those that
	// became Cached.
	parking []allocator.Handle
	parked  []int32
}

// maxSpareEntries bounds the spare entries: what one eviction of a few
// long prompts frees, without keeping a whole cleared cache's worth.
const maxSpareEntries = 1 << 16

// cacheEntry is one published page: full, immutable, in one domain.
//
// A walk down the trie reads, per page, the node's first child, the
// child's domain and its tokens: they come first, and in the usual case
// (one child, a page of at most inlineTokens tokens) they live in the
// entry itself, so that a step costs one cache miss instead of three
// (the entry, its child array, its token array): a 2,048-page walk is a
// chain of dependent loads, and each miss is paid in full.
type cacheEntry struct {
	// The trie: its own children, the pages that follow it (node.kids is
	// kid0 until a second child arrives); the page's token IDs (nil if
	// published by keys only; tok while they fit), the node it is a child
	// of (nil: not in the trie) and its bucket in that node's map.
	node   trieNode
	kid0   [1]*cacheEntry
	dom    *tenancy.Domain
	tokens []int32
	tok    [inlineTokens]int32
	in     *trieNode
	sib    *cacheEntry
	hash   uint64
	orphan bool // in orphans, chained through sib
	spare  bool // on the spare list: in no index, held by nobody

	key      BlockKey
	parent   BlockKey // zero for a prompt's first page
	page     int32    // on the device; -1 while only the host tier holds it (tier)
	detached bool     // out of the key index (ClearPrefixCache) while leases still hold it
	inLRU    bool
	pinned   bool // scratch: matched by the admission now evicting
	// adapter is the adapter it was published under (prefixIndex.adapters),
	// for the events of its moves between the device and the host tier;
	// tier is the tier's item that holds (or is writing) the page, nil if
	// none (tier.go).
	adapter adapterID
	tier    *tierItem

	prev, next *cacheEntry // LRU links while the page is Cached
	chain      *cacheEntry // next entry with the same index64

	// leases is the number of live leases holding the page (its allocator
	// refcount), and tenants counts them per tenant: each tenant is charged
	// once for the page, whatever its number of leases.
	leases  int
	tenants []tenantRef

	// ckpt is the state checkpoint at the end of this page, if any, and
	// pins the checkpoints whose prefix includes it (checkpoint.go): a
	// page pins > 0 that no lease holds is Cached but off the LRU list.
	ckpt *checkpoint
	pins int32
}

// cacheEntrySize is the most bytes a cacheEntry may take: a size class of
// whole cache lines (5), so that every entry, allocated on its own,
// starts on a line and its first 64 bytes, which a trie walk reads, take
// one miss. A test holds it (the host tier's fields cost 7 % of a walk
// while they pushed it to the next class, of 352 bytes).
const cacheEntrySize = 320

// adapterID names an adapter in prefixIndex.adapters (0: none), in 4
// bytes of an entry rather than a string's 16.
type adapterID uint32

// inlineTokens is the most token IDs an entry keeps in itself: vLLM's
// default page of 16 tokens fits; larger pages get an array of their own.
const inlineTokens = 16

// setTokens makes tokens the entry's token IDs, copied into its own array
// (the inline one while they fit).
func (e *cacheEntry) setTokens(tokens []int32) {
	if e.tokens == nil && len(tokens) <= len(e.tok) {
		e.tokens = e.tok[:0:len(e.tok)]
	}
	e.tokens = append(e.tokens[:0], tokens...)
}

// trieRoot names where a domain's pages under one adapter start.
type trieRoot struct {
	dom     *tenancy.Domain
	adapter string
}

// trieNode holds a node's children. A few are compared in turn; from
// trieFanout on, they are found by pageHash, chained through sib. Either
// way the tokens are compared in full: the hash only narrows the search.
type trieNode struct {
	kids []*cacheEntry
	many map[uint64]*cacheEntry
}

// trieFanout is the number of children a node compares in turn before it
// indexes them by hash: most nodes of a prompt's path have one.
const trieFanout = 8

// pageHash mixes a page's token IDs with the pool's seed (random, so that
// nobody can aim tokens at one bucket). It narrows a search in a node with
// many children and never decides one.
func pageHash(tokens []int32, seed uint64) uint64 {
	h := seed ^ uint64(len(tokens))*0x9e3779b97f4a7c15
	for i := 0; i+1 < len(tokens); i += 2 {
		h = (h ^ (uint64(uint32(tokens[i])) | uint64(uint32(tokens[i+1]))<<32)) * 0xbf58476d1ce4e5b9
		h ^= h >> 31
	}
	if len(tokens)%2 == 1 {
		h = (h ^ uint64(uint32(tokens[len(tokens)-1]))) * 0x94d049bb133111eb
		h ^= h >> 29
	}
	return h
}

// child returns n's child whose tokens are tokens, in domain dom, or nil.
func (n *trieNode) child(tokens []int32, dom *tenancy.Domain, seed uint64) *cacheEntry {
	if n.many == nil {
		for _, e := range n.kids {
			if e.tokens[0] == tokens[0] && e.dom == dom && tokensEqual(e.tokens, tokens) {
				return e
			}
		}
		return nil
	}
	for e := n.many[pageHash(tokens, seed)]; e != nil; e = e.sib {
		if e.dom == dom && tokensEqual(e.tokens, tokens) {
			return e
		}
	}
	return nil
}

// add makes e a child of n.
func (n *trieNode) add(e *cacheEntry, seed uint64) {
	e.in, e.sib = n, nil
	if n.many == nil && len(n.kids) < trieFanout {
		n.kids = append(n.kids, e)
		return
	}
	if n.many == nil { // the node branches widely: index its children
		n.many = make(map[uint64]*cacheEntry, 2*trieFanout)
		for _, k := range n.kids {
			n.hashIn(k, seed)
		}
		n.kids = nil
	}
	n.hashIn(e, seed)
}

func (n *trieNode) hashIn(e *cacheEntry, seed uint64) {
	e.hash = pageHash(e.tokens, seed)
	e.sib = n.many[e.hash]
	n.many[e.hash] = e
}

// remove takes child e out of n.
func (n *trieNode) remove(e *cacheEntry) {
	e.in = nil
	if n.many == nil {
		if i := slices.Index(n.kids, e); i >= 0 {
			n.kids = slices.Delete(n.kids, i, i+1)
		}
		return
	}
	if head := n.many[e.hash]; head == e {
		if e.sib == nil {
			delete(n.many, e.hash)
		} else {
			n.many[e.hash] = e.sib
		}
	} else {
		for pp := head; pp != nil; pp = pp.sib {
			if pp.sib == e {
				pp.sib = e.sib
				break
			}
		}
	}
	e.sib = nil
}

// each calls f on every child of n.
func (n *trieNode) each(f func(*cacheEntry)) {
	for _, e := range n.kids {
		f(e)
	}
	for _, head := range n.many {
		for e := head; e != nil; e = e.sib {
			f(e)
		}
	}
}

// root returns the trie root of dom and adapter, creating it if asked.
func (x *prefixIndex) root(dom *tenancy.Domain, adapter string, create bool) *trieNode {
	k := trieRoot{dom, adapter}
	n := x.roots[k]
	if n == nil && create {
		n = new(trieNode)
		x.roots[k] = n
	}
	return n
}

type tenantRef struct {
	t    *tenancy.Tenant
	refs int
}

// ref returns the count for t, or nil.
func (e *cacheEntry) ref(t *tenancy.Tenant) *tenantRef {
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
	entries                        int // entries whose page the device holds now, cached, in use or detached
	keyOnly                        int // indexed entries without tokens (see prefixIndex)
}

func (x *prefixIndex) init(pages int, seed uint64) {
	x.byKey = make(map[uint64]*cacheEntry)
	x.byPage = make([]*cacheEntry, pages)
	x.roots = make(map[trieRoot]*trieNode)
	x.orphans = make(map[uint64]*cacheEntry)
	x.seed = seed
	x.adapters = []string{""}
	x.adapterIDs = map[string]adapterID{"": 0}
}

// adapterID returns name's ID, new if the pool has not seen it.
func (x *prefixIndex) adapterID(name string) adapterID {
	if name == "" {
		return 0
	}
	id, ok := x.adapterIDs[name]
	if !ok {
		id = adapterID(len(x.adapters))
		x.adapters = append(x.adapters, name)
		x.adapterIDs[name] = id
	}
	return id
}

func (x *prefixIndex) counters(d *tenancy.Domain) *domainCounters {
	for int(d.ID) > len(x.domains) {
		x.domains = append(x.domains, domainCounters{})
	}
	return &x.domains[d.ID-1]
}

// lookup returns the indexed entry of key k in domain d, or nil. The
// domain is part of the match: no key, forged or colliding, reaches
// another domain's entry.
func (x *prefixIndex) lookup(d *tenancy.Domain, k BlockKey) *cacheEntry {
	for e := x.byKey[k.index64(uint32(d.ID))]; e != nil; e = e.chain {
		if e.key == k && e.dom == d {
			return e
		}
	}
	return nil
}

// insert indexes a new entry; its page must have none. With tokens, it
// joins the trie under parent (the node of the page before it: a root or
// an entry's node), or, when that page has none, waits as an orphan for
// it; and it adopts the orphans that wait for it. Without tokens it is a
// key-only entry.
func (x *prefixIndex) insert(e *cacheEntry, parent *trieNode) {
	i := e.key.index64(uint32(e.dom.ID))
	e.chain = x.byKey[i]
	x.byKey[i] = e
	x.byPage[e.page] = e
	c := x.counters(e.dom)
	c.entries++
	switch {
	case e.tokens == nil:
		c.keyOnly++
	case parent != nil:
		parent.add(e, x.seed)
	default:
		x.addOrphan(e)
	}
	if e.tokens != nil {
		for _, o := range x.orphansOf(e) {
			x.removeOrphan(o)
			e.node.add(o, x.seed)
		}
	}
	x.epoch++
}

func (x *prefixIndex) orphanIndex(dom *tenancy.Domain, parentKey BlockKey) uint64 {
	return parentKey.index64(uint32(dom.ID))
}

func (x *prefixIndex) addOrphan(e *cacheEntry) {
	i := x.orphanIndex(e.dom, e.parent)
	e.in, e.orphan, e.sib = nil, true, x.orphans[i]
	x.orphans[i] = e
}

func (x *prefixIndex) removeOrphan(e *cacheEntry) {
	i := x.orphanIndex(e.dom, e.parent)
	if head := x.orphans[i]; head == e {
		if e.sib == nil {
			delete(x.orphans, i)
		} else {
			x.orphans[i] = e.sib
		}
	} else {
		for pp := head; pp != nil; pp = pp.sib {
			if pp.sib == e {
				pp.sib = e.sib
				break
			}
		}
	}
	e.orphan, e.sib = false, nil
}

// orphansOf lists the orphans that wait for e: of its domain, whose
// parent's key is e's.
func (x *prefixIndex) orphansOf(e *cacheEntry) []*cacheEntry {
	var out []*cacheEntry
	for o := x.orphans[x.orphanIndex(e.dom, e.key)]; o != nil; o = o.sib {
		if o.dom == e.dom && o.parent == e.key {
			out = append(out, o)
		}
	}
	return out
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
	switch {
	case e.in != nil:
		e.in.remove(e)
	case e.orphan:
		x.removeOrphan(e)
	}
	// Its children are out of reach now (no walk gets past a page that
	// is not there, and no key lookup either): they wait as orphans for
	// the next entry of the same content.
	var kids []*cacheEntry
	e.node.each(func(c *cacheEntry) { kids = append(kids, c) })
	clear(e.node.kids)
	e.node = trieNode{kids: e.node.kids[:0]} // the array, for the entry's reuse
	for _, c := range kids {
		c.sib = nil
		x.addOrphan(c)
	}
	if e.tokens == nil {
		x.counters(e.dom).keyOnly--
	}
	x.epoch++
}

// drop forgets e entirely: its page is leaving the cache. e goes to the
// spare list.
func (x *prefixIndex) drop(e *cacheEntry) {
	if !e.detached {
		x.unindex(e)
	}
	if e.page >= 0 {
		x.byPage[e.page] = nil
		x.counters(e.dom).entries--
	}
	x.recycle(e)
}

// detachPage takes e's device page from it (evicted, and the host tier
// holds or writes the page: e stays indexed, see tier.go). e must not be
// on the LRU list.
func (x *prefixIndex) detachPage(e *cacheEntry) {
	x.byPage[e.page] = nil
	x.counters(e.dom).entries--
	e.page = -1
	x.epoch++ // a match taking e for a device page is stale
}

// attachPage makes page, which has no entry, e's device page again: e was
// only in the host tier, and page holds its content now.
func (x *prefixIndex) attachPage(e *cacheEntry, page int32) {
	e.page = page
	x.byPage[page] = e
	x.counters(e.dom).entries++
	x.epoch++
}

// recycle puts e, just dropped, on the spare list, cleared but for its
// arrays' capacity.
//
// Nothing can reach e afterwards: drop took it out of byPage, and
// unindex (now, or when a ClearPrefixCache detached it) out of the key
// chains, the trie (its own children became orphans) and the orphans;
// an entry leaves the LRU list before it is dropped; and no lease holds
// its page any more. Events carry keys, never entries. What remains is
// admissions' matches (Lease.match), which hold entries between
// attempts: every unindex advances the index's epoch, so a match that
// could hold e is stale, and matchLocked makes it again before anything
// reads it. Check proves all of it (prefixIndex.check, checkMatches):
// no spare entry is reachable from the index or from a match still
// valid.
func (x *prefixIndex) recycle(e *cacheEntry) {
	if x.spareLen >= maxSpareEntries {
		return
	}
	tenants, tokens, kids := e.tenants[:0], e.tokens[:0], e.node.kids[:0]
	clear(e.tenants[:cap(e.tenants)]) // no tenant kept alive by a spare
	*e = cacheEntry{page: -1, spare: true, chain: x.spare, tenants: tenants, tokens: tokens}
	e.node.kids = kids
	x.spare = e
	x.spareLen++
}

// newEntry returns a cleared entry, a spare one if there is one.
func (x *prefixIndex) newEntry() *cacheEntry {
	e := x.spare
	if e == nil {
		e = new(cacheEntry)
	} else {
		x.spare, x.spareLen = e.chain, x.spareLen-1
		e.chain, e.spare = nil, false
	}
	if e.node.kids == nil {
		e.node.kids = e.kid0[:0] // the first child in the entry itself
	}
	return e
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
// reports every problem to c. tierOnly are the entries only the host
// tier holds (page −1, in no byPage slot): indexed like the others.
func (x *prefixIndex) check(c *checker, tierOnly []*cacheEntry) {
	lru := 0
	for e := x.lruHead; e != nil; e = e.next {
		if e.spare || !e.inLRU || e.detached || (e.next != nil && e.next.prev != e) || (e.next == nil && x.lruTail != e) {
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
	keyOnly := make([]int, len(x.domains))
	indexed, inLRU, inTrie := 0, 0, 0
	each := func(page int, e *cacheEntry) {
		if e.spare {
			c.failf("prefix index: page %d holds a spare entry", page)
			return
		}
		if int(e.page) != page {
			c.failf("prefix index: page %d holds the entry of page %d", page, e.page)
			return
		}
		d := int(e.dom.ID) - 1
		if d >= len(entries) {
			c.failf("prefix index: page %d is in domain %q, which has no counters", page, e.dom.Name)
			return
		}
		if page >= 0 {
			entries[d]++
			if e.inLRU {
				cached[d]++
			}
		} else if e.inLRU || e.detached || e.leases != 0 || len(e.tenants) != 0 {
			c.failf("prefix index: an entry only the host tier holds is on the LRU list (%v), detached (%v) or held (%d)", e.inLRU, e.detached, e.leases)
		}
		if e.inLRU {
			inLRU++
		}
		if !e.detached {
			indexed++
			if x.lookup(e.dom, e.key) != e {
				c.failf("prefix index: page %d not found under its key in domain %q", page, e.dom.Name)
			}
			if e.tokens == nil {
				keyOnly[d]++
			}
		} else if e.in != nil || e.orphan {
			c.failf("prefix index: detached page %d is still in the trie", page)
		}
		switch {
		case e.in != nil && e.orphan:
			c.failf("prefix index: page %d is both in a node and an orphan", page)
		case e.in != nil:
			inTrie++
		case e.orphan:
			if !slices.Contains(chainOf(x.orphans[x.orphanIndex(e.dom, e.parent)]), e) {
				c.failf("prefix index: orphan page %d is not where orphans wait", page)
			}
		case !e.detached && e.tokens != nil:
			c.failf("prefix index: page %d has tokens but is neither in the trie nor an orphan", page)
		}
	}
	for page, e := range x.byPage {
		if e != nil {
			each(page, e)
		}
	}
	for _, e := range tierOnly {
		each(-1, e)
	}
	// live is an indexed or held entry: what the orphans, the trie and the
	// key chains may hold.
	live := func(e *cacheEntry) bool {
		if e.page >= 0 {
			return int(e.page) < len(x.byPage) && x.byPage[e.page] == e
		}
		return e.tier != nil && e.tier.entry == e
	}
	orphans := 0
	for _, head := range x.orphans {
		for o := head; o != nil; o = o.sib {
			if orphans++; orphans > len(x.byPage)+len(tierOnly) || o.spare || !o.orphan || !live(o) {
				c.failf("prefix index: the orphans hold a stale entry for page %d", o.page)
				break
			}
		}
	}
	children := 0
	checkNode := func(n *trieNode, what string) {
		n.each(func(k *cacheEntry) {
			children++
			switch {
			case k.spare:
				c.failf("prefix index: a spare entry is a child of %s", what)
			case k.in != n:
				c.failf("prefix index: page %d is a child of %s but names another node", k.page, what)
			case k.detached || k.tokens == nil || !live(k):
				c.failf("prefix index: trie child page %d of %s is not an indexed entry with tokens", k.page, what)
			case n.many != nil && (k.hash != pageHash(k.tokens, x.seed) || !slices.Contains(chainOf(n.many[k.hash]), k)):
				c.failf("prefix index: page %d is in the wrong bucket of %s", k.page, what)
			}
		})
	}
	for r, n := range x.roots {
		checkNode(n, "the root of domain "+r.dom.Name)
	}
	for _, e := range x.byPage {
		if e != nil {
			checkNode(&e.node, fmt.Sprintf("page %d", e.page))
		}
	}
	for _, e := range tierOnly {
		checkNode(&e.node, "an entry in the host tier")
	}
	if children != inTrie {
		c.failf("prefix index: the trie holds %d children, %d entries name a node", children, inTrie)
	}
	if inLRU != lru {
		c.failf("prefix index: %d entries are marked as in the LRU list, it holds %d", inLRU, lru)
	}
	chained := 0
	for _, head := range x.byKey {
		for e := head; e != nil; e = e.chain {
			if chained++; chained > len(x.byPage)+len(tierOnly) {
				c.failf("prefix index: key chains cycle")
				return
			}
			if e.spare || e.detached || !live(e) {
				c.failf("prefix index: key chains hold a stale entry for page %d", e.page)
			}
		}
	}
	if chained != indexed {
		c.failf("prefix index: key chains hold %d entries, %d pages are indexed", chained, indexed)
	}
	spares := 0
	for e := x.spare; e != nil; e = e.chain {
		if spares++; spares > x.spareLen || spares > maxSpareEntries {
			c.failf("prefix index: the spare list holds more than the %d entries it counts", x.spareLen)
			break
		}
		if !e.spare || e.page != -1 || e.in != nil || e.orphan || e.inLRU || e.detached || e.leases != 0 ||
			len(e.tenants) != 0 || len(e.node.kids) != 0 || e.node.many != nil || e.dom != nil || e.tier != nil {
			c.failf("prefix index: spare entry %d of %d is not a cleared spare (page %d)", spares, x.spareLen, e.page)
		}
	}
	if spares != x.spareLen {
		c.failf("prefix index: the spare list holds %d entries, counter says %d", spares, x.spareLen)
	}
	for d, k := range x.domains {
		if k.entries != entries[d] || k.cachedPages != cached[d] || k.keyOnly != keyOnly[d] {
			c.failf("prefix index: domain %d counts %d entries (%d cached, %d by key only), has %d (%d, %d)",
				d+1, k.entries, k.cachedPages, k.keyOnly, entries[d], cached[d], keyOnly[d])
		}
	}
}
