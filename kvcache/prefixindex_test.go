package kvcache

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/isolation"
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
	k        indexKey
	detached bool
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
	domains := []*isolation.Domain{{ID: 1, Name: "d1"}, {ID: 2, Name: "d2"}, {ID: 3, Name: "d3"}}
	var x prefixIndex
	x.init(pages)
	m := &indexModel{byKey: map[indexKey]int32{}, pages: map[int32]modelEntry{}}
	entries := map[int32]*cacheEntry{}
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
			x.insert(e)
			entries[page] = e
			m.byKey[k] = page
			m.pages[page] = modelEntry{k: k}
			m.epoch++
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
		default: // a lease shares an LRU page again
			if len(m.lru) > 0 {
				i := rng.IntN(len(m.lru))
				x.lruRemove(entries[m.lru[i]])
				m.lru = append(m.lru[:i], m.lru[i+1:]...)
			}
		}
		var c checker
		x.check(&c)
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
	d := &isolation.Domain{ID: 1, Name: "d"}
	for name, corrupt := range map[string]func(x *prefixIndex, e *cacheEntry){
		"lru length":       func(x *prefixIndex, e *cacheEntry) { x.lruLen++ },
		"domain counter":   func(x *prefixIndex, e *cacheEntry) { x.domains[0].entries++ },
		"detached in lru":  func(x *prefixIndex, e *cacheEntry) { e.detached = true },
		"page mismatch":    func(x *prefixIndex, e *cacheEntry) { x.byPage[3], x.byPage[e.page] = e, nil },
		"lost from chains": func(x *prefixIndex, e *cacheEntry) { clear(x.byKey) },
	} {
		t.Run(name, func(t *testing.T) {
			var x prefixIndex
			x.init(8)
			e := &cacheEntry{key: BlockKey{1}, dom: d, page: 1}
			x.insert(e)
			x.lruPush(e)
			var ok checker
			x.check(&ok)
			require.NoError(t, ok.err())
			corrupt(&x, e)
			var c checker
			x.check(&c)
			require.ErrorIs(t, c.err(), ErrCorrupt)
		})
	}
}
