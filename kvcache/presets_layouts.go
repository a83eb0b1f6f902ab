package kvcache

import (
	"fmt"
	"strconv"
	"strings"
)

// Layouts the model presets need beyond cachespec.go's region
// constructors, and Miniature, which shrinks a spec for tests and demos.

// PooledIndexerKeys returns the indexer key cache of a sparse-attention
// model whose indexer scores pools of tokensPerEntry tokens instead of
// single tokens (GLM-5.3-Flash's index_kpool): per layer one entry of
// headDim fp8 elements and one fp32 scale per 128 of them for every
// tokensPerEntry tokens ("layer.L.indexer"), the layout of vLLM's
// Glm5NextIndexerCache (one indexer state per index_kpool tokens). A
// page of tokensPerPage tokens holds tokensPerPage/tokensPerEntry
// entries, so tokensPerPage must be a multiple of tokensPerEntry: an
// entry never straddles two pages, which two tenants could hold.
func PooledIndexerKeys(layers []int, headDim, tokensPerEntry, tokensPerPage int) ([]CacheRegion, error) {
	switch {
	case headDim < 1 || headDim > MaxHeadDim:
		return nil, fmt.Errorf("%w: pooled indexer head dim %d, want 1..%d", ErrInvalidConfig, headDim, MaxHeadDim)
	case tokensPerEntry < 1 || tokensPerPage < 1:
		return nil, fmt.Errorf("%w: pooled indexer of %d tokens per entry and %d per page, want both positive", ErrInvalidConfig, tokensPerEntry, tokensPerPage)
	case tokensPerPage%tokensPerEntry != 0:
		return nil, fmt.Errorf("%w: pooled indexer entries of %d tokens do not tile pages of %d tokens", ErrInvalidConfig, tokensPerEntry, tokensPerPage)
	}
	perEntry := int64(headDim) + 4*int64((headDim+127)/128)
	pb := int64(tokensPerPage/tokensPerEntry) * perEntry
	rs := make([]CacheRegion, 0, len(layers))
	for _, l := range layers {
		rs = append(rs, CacheRegion{Name: fmt.Sprintf("layer.%d.indexer", l), DType: FP8E4M3,
			AlsoHolds: []DType{FP32}, PageBytes: pb})
	}
	return rs, nil
}

// Miniature is s at a reduced size, for tests and demos that run a real
// model's layout in host memory: a GLM-5 pool of the incident's 681,280
// tokens needs 68 GB at the model's size. Every group keeps its name,
// kind, page size in tokens, window and place; of its regions it keeps
// those of its first layers layers (named "layer.L.…", in the order they
// appear; regions named otherwise are all kept), each with PageBytes
// divided by shrink and rounded up to a multiple of 4. Region names and
// element types stay, so the pool scrubs the same dtype mix.
//
// What a pool of the miniature admits and refuses, in pages, slots and
// tokens, is what a pool of s with the same Pages and MaxLeases would;
// only its bytes are smaller. Report bytes from s itself (TokenBytes,
// BytesFor), never from the miniature. A spec that adopts engine memory
// has no miniature: the engine's tensors have the full size.
func (s CacheSpec) Miniature(layers, shrink int) (CacheSpec, error) {
	if layers < 1 || shrink < 1 {
		return CacheSpec{}, fmt.Errorf("%w: miniature of %d layers per group at 1/%d size, want both at least 1", ErrInvalidConfig, layers, shrink)
	}
	if err := s.Validate(); err != nil {
		return CacheSpec{}, err
	}
	const suffix = " (miniature)"
	m := CacheSpec{Model: s.Model, Groups: make([]CacheGroup, 0, len(s.Groups)), Shard: s.Shard}
	if len(s.Model)+len(suffix) <= maxCacheNameLen {
		m.Model += suffix
	}
	for _, g := range s.Groups {
		kept := make(map[int]bool, layers)
		mg := g
		mg.Regions = nil
		for _, r := range g.Regions {
			if r.Memory != nil {
				return CacheSpec{}, fmt.Errorf("%w: region %q adopts engine memory: a miniature allocates its own", ErrInvalidConfig, r.Name)
			}
			if l, ok := regionLayer(r.Name); ok && !kept[l] {
				if len(kept) == layers {
					continue // a layer after the first layers ones
				}
				kept[l] = true
			}
			mr := r
			mr.AlsoHolds = append([]DType(nil), r.AlsoHolds...)
			mr.PageBytes = roundUp4((r.PageBytes + int64(shrink) - 1) / int64(shrink))
			mg.Regions = append(mg.Regions, mr)
		}
		m.Groups = append(m.Groups, mg)
	}
	return m, m.Validate()
}

// regionLayer is L of a region named "layer.L.…".
func regionLayer(name string) (int, bool) {
	rest, ok := strings.CutPrefix(name, "layer.")
	if !ok {
		return 0, false
	}
	num, _, ok := strings.Cut(rest, ".")
	if !ok {
		return 0, false
	}
	l, err := strconv.Atoi(num)
	return l, err == nil && l >= 0
}
