package kvcache

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
	"github.com/stretchr/testify/require"
)

// indexModel is the reference for prefixIndex: what it must answer, in
// maps and a slice.
type indexModel struct {
	byKey map[indexKey]int32 // indexed (domain, key) → page
	pages map[int32]modelEntry
	lru   []int32 // least recently used first
	epoch uint64
}

type indexKey struct {
	dom uint32
	key BlockKey
}

type modelEntry struct {
	k         indexKey
	detached  bool
	hasTokens bool
	tokens    [2]int32
	parent    int32    // the page before it in the trie; -1: its domain's root
	parentKey BlockKey // the key of the content before it
	inTrie    bool     // in a trie node (false: key-only, detached, or an orphan)
}

func (m *indexModel) lruIndex(page int32) int {
	for i, p := range m.lru {
		if p == page {
			return i
		}
	}
	return -1
}

// TestPrefixIndexAgainstReferenceModel drives a prefixIndex and the model
// through random inserts, lookups, unindexing, drops and LRU moves, with
// keys forced into few map buckets so that chains are long, and checks
// after every step that both agree and that check finds nothing.
func TestPrefixIndexAgainstReferenceModel(t *testing.T) {
	for seed := range uint64(8) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { runIndexModel(t, seed, 3000) })
	}
}

func runIndexModel(t *testing.T, seed uint64, steps int) {
	const pages = 32
	rng := rand.New(rand.NewPCG(seed, 7))
	domains := []*tenancy.Domain{{ID: 1, Name: "d1"}, {ID: 2, Name: "d2"}, {ID: 3, Name: "d3"}}
	var x prefixIndex
	x.init(pages, seed)
	m := &indexModel{byKey: map[indexKey]int32{}, pages: map[int32]modelEntry{}}
	entries := map[int32]*cacheEntry{}
	// A parent in dom: its root (-1), or a page in the trie there.
	randParent := func(dom *tenancy.Domain) int32 {
		var cands []int32
		for page, me := range m.pages {
			if me.inTrie && me.k.dom == uint32(dom.ID) {
				cands = append(cands, page)
			}
		}
		slices.Sort(cands)
		if len(cands) == 0 || rng.IntN(3) == 0 {
			return -1
		}
		return cands[rng.IntN(len(cands))]
	}
	nodeOf := func(dom *tenancy.Domain, parent int32) *trieNode {
		if parent < 0 {
			return x.root(dom, "", true)
		}
		return &entries[parent].node
	}
	// modelChild is the page under parent whose tokens are toks, or -1.
	modelChild := func(dom *tenancy.Domain, parent int32, toks [2]int32) int32 {
		for page, me := range m.pages {
			if me.inTrie && me.k.dom == uint32(dom.ID) && me.parent == parent && me.tokens == toks {
				return page
			}
		}
		return -1
	}
	orphan := func(page int32) { // the page leaves the trie, and so do the pages under it
		me := m.pages[page]
		me.inTrie = false
		m.pages[page] = me
		for q, c := range m.pages {
			if c.inTrie && c.parent == page {
				c.inTrie = false
				m.pages[q] = c
			}
		}
	}
	randTokens := func() [2]int32 { return [2]int32{int32(rng.IntN(6)), int32(rng.IntN(6))} }
	// Keys share their first 8 bytes a lot: few buckets, long chains, and
	// the same key in several domains.
	randKey := func() BlockKey {
		var k BlockKey
		binary.LittleEndian.PutUint64(k[:8], uint64(rng.IntN(3)))
		k[31] = byte(rng.IntN(6))
		return k
	}
	for step := range steps {
		dom := domains[rng.IntN(len(domains))]
		switch op := rng.IntN(10); {
		case op < 3: // insert on a page without an entry, a key not indexed in dom
			page := int32(rng.IntN(pages))
			k := indexKey{uint32(dom.ID), randKey()}
			if _, taken := m.pages[page]; taken {
				break
			}
			if _, dup := m.byKey[k]; dup {
				break
			}
			e := &cacheEntry{key: k.key, dom: dom, page: page}
			me := modelEntry{k: k, parent: -1}
			var parent *trieNode
			if rng.IntN(5) != 0 { // with tokens, under a parent; else by key only
				me.parent, me.tokens, me.hasTokens = randParent(dom), randTokens(), true
				if modelChild(dom, me.parent, me.tokens) >= 0 {
					break // the pool never publishes the same content twice
				}
				parent, me.inTrie = nodeOf(dom, me.parent), true
				e.tokens = me.tokens[:]
				if me.parent >= 0 {
					e.parent = entries[me.parent].key
				}
				me.parentKey = e.parent
			}
			x.insert(e, parent)
			entries[page] = e
			m.byKey[k] = page
			m.pages[page] = me
			m.epoch++
			if me.hasTokens { // it adopts the orphans that wait for its key
				for q, o := range m.pages {
					if q != page && o.hasTokens && !o.inTrie && !o.detached && o.k.dom == k.dom && o.parentKey == k.key {
						o.inTrie, o.parent = true, page
						m.pages[q] = o
					}
				}
			}
		case op < 5: // lookup
			k := indexKey{uint32(dom.ID), randKey()}
			got := x.lookup(dom, k.key)
			page, ok := m.byKey[k]
			if !ok {
				require.Nil(t, got, "step %d: lookup of a key not indexed in %s", step, dom.Name)
			} else {
				require.NotNil(t, got, "step %d", step)
				require.Equal(t, page, got.page, "step %d", step)
			}
		case op < 6: // unindex (ClearPrefixCache while leases hold the page)
			for page, me := range m.pages {
				if me.detached || m.lruIndex(page) >= 0 {
					continue
				}
				x.unindex(entries[page])
				delete(m.byKey, me.k)
				orphan(page)
				me = m.pages[page]
				me.detached = true
				m.pages[page] = me
				m.epoch++
				break
			}
		case op < 7: // drop (the page leaves the cache)
			for page, me := range m.pages {
				if i := m.lruIndex(page); i >= 0 {
					x.lruRemove(entries[page])
					m.lru = append(m.lru[:i], m.lru[i+1:]...)
				}
				x.drop(entries[page])
				if !me.detached {
					delete(m.byKey, me.k)
					orphan(page)
					m.epoch++
				}
				delete(m.pages, page)
				delete(entries, page)
				break
			}
		case op < 9: // the last lease lets go of an indexed page: LRU tail
			for page, me := range m.pages {
				if me.detached || m.lruIndex(page) >= 0 {
					continue
				}
				x.lruPush(entries[page])
				m.lru = append(m.lru, page)
				break
			}
		case op < 10: // a lease shares an LRU page again
			if len(m.lru) > 0 {
				i := rng.IntN(len(m.lru))
				x.lruRemove(entries[m.lru[i]])
				m.lru = append(m.lru[:i], m.lru[i+1:]...)
			}
		}
		// A walk step from a random parent, checked against the model.
		if dom := domains[rng.IntN(len(domains))]; true {
			parent, toks := randParent(dom), randTokens()
			want := modelChild(dom, parent, toks)
			got := nodeOf(dom, parent).child(toks[:], dom, x.seed)
			if want < 0 {
				require.Nil(t, got, "step %d: child %v under %d in %s", step, toks, parent, dom.Name)
			} else {
				require.NotNil(t, got, "step %d: child %v under %d in %s", step, toks, parent, dom.Name)
				require.Equal(t, want, got.page, "step %d", step)
			}
			// Another domain's root never leads to it.
			other := domains[(int(dom.ID))%len(domains)]
			if got := x.root(other, "", true).child(toks[:], dom, x.seed); got != nil {
				require.Equal(t, other.ID, got.dom.ID, "step %d: a walk crossed domains", step)
			}
		}
		var c checker
		x.check(&c, nil)
		require.NoError(t, c.err(), "step %d", step)
		require.Equal(t, m.epoch, x.epoch, "step %d: epoch", step)
		require.Equal(t, len(m.lru), x.lruLen, "step %d", step)
		i := 0
		for e := x.lruHead; e != nil; e = e.next {
			require.Equal(t, m.lru[i], e.page, "step %d: LRU order", step)
			i++
		}
		for page := range int32(pages) {
			_, want := m.pages[page]
			require.Equal(t, want, x.byPage[page] != nil, "step %d page %d", step, page)
		}
	}
}

// check finds a broken index: a stale chain entry, a wrong counter, an
// LRU list that lies.
func TestPrefixIndexCheckFindsCorruption(t *testing.T) {
	d := &tenancy.Domain{ID: 1, Name: "d"}
	for name, corrupt := range map[string]func(x *prefixIndex, e *cacheEntry){
		"lru length":         func(x *prefixIndex, e *cacheEntry) { x.lruLen++ },
		"domain counter":     func(x *prefixIndex, e *cacheEntry) { x.domains[0].entries++ },
		"detached in lru":    func(x *prefixIndex, e *cacheEntry) { e.detached = true },
		"page mismatch":      func(x *prefixIndex, e *cacheEntry) { x.byPage[3], x.byPage[e.page] = e, nil },
		"lost from chains":   func(x *prefixIndex, e *cacheEntry) { clear(x.byKey) },
		"lost from the trie": func(x *prefixIndex, e *cacheEntry) { x.root(d, "", false).kids = nil },
		"key-only counter":   func(x *prefixIndex, e *cacheEntry) { x.domains[0].keyOnly++ },
	} {
		t.Run(name, func(t *testing.T) {
			var x prefixIndex
			x.init(8, 1)
			e := &cacheEntry{key: BlockKey{1}, dom: d, page: 1, tokens: []int32{7}}
			x.insert(e, x.root(d, "", true))
			x.lruPush(e)
			var ok checker
			x.check(&ok, nil)
			require.NoError(t, ok.err())
			corrupt(&x, e)
			var c checker
			x.check(&c, nil)
			require.ErrorIs(t, c.err(), ErrCorrupt)
		})
	}
}
