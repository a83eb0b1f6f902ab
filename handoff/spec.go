package handoff

import (
	"encoding/binary"
	"fmt"

	"github.com/kvfence/kvfence/kvcache"
)

// The cache spec as a manifest carries it: what makes two pools' units
// mean the same bytes, and nothing else. All integers little-endian.
//
//	shard rank u32, shard size u32
//	per group:  kind u8, regions u32, tokens per page u32, window tokens u32
//	  per region:  bytes per page u64, dtype u8, also-holds count u8, also-holds dtypes
//
// Names (of the model, groups and regions) are left out: a preset and a
// hand-written spec of the same shapes interoperate. The group count is
// in the manifest's header.
const (
	specShardLen  = 8
	specGroupLen  = 13
	specRegionLen = 10
	// maxSpecBytes bounds a spec's encoding: every region of a spec at
	// the limit, each with a few element types beside its own.
	maxSpecBytes = specShardLen + kvcache.MaxCacheGroups*specGroupLen + kvcache.MaxCacheRegions*(specRegionLen+4)
)

func specLen(s kvcache.CacheSpec) int {
	n := specShardLen
	for _, g := range s.Groups {
		n += specGroupLen
		for _, r := range g.Regions {
			n += specRegionLen + len(r.AlsoHolds)
		}
	}
	return n
}

func appendSpec(dst []byte, s kvcache.CacheSpec) []byte {
	le := binary.LittleEndian
	dst = le.AppendUint32(dst, uint32(s.Shard.Rank))
	dst = le.AppendUint32(dst, uint32(s.Shard.Size))
	for _, g := range s.Groups {
		dst = append(dst, byte(g.Kind))
		dst = le.AppendUint32(dst, uint32(len(g.Regions)))
		dst = le.AppendUint32(dst, uint32(g.TokensPerPage))
		dst = le.AppendUint32(dst, uint32(g.WindowTokens))
		for _, r := range g.Regions {
			dst = le.AppendUint64(dst, uint64(r.PageBytes))
			dst = append(dst, byte(r.DType), byte(len(r.AlsoHolds)))
			for _, d := range r.AlsoHolds {
				dst = append(dst, byte(d))
			}
		}
	}
	return dst
}

// parseSpec decodes a spec's encoding and names its groups and regions
// by position ("group.0", "group.0.region.3"), so that it validates as a
// spec; the caller checks it.
func parseSpec(b []byte) (kvcache.CacheSpec, error) {
	bad := func(format string, args ...any) (kvcache.CacheSpec, error) {
		return kvcache.CacheSpec{}, fmt.Errorf("%w: cache spec: "+format, append([]any{ErrMalformedManifest}, args...)...)
	}
	le := binary.LittleEndian
	if len(b) < specShardLen {
		return bad("%d bytes", len(b))
	}
	s := kvcache.CacheSpec{Shard: kvcache.Shard{Rank: int(le.Uint32(b)), Size: int(le.Uint32(b[4:]))}}
	b = b[specShardLen:]
	regions := 0
	for len(b) > 0 {
		if len(b) < specGroupLen || len(s.Groups) == kvcache.MaxCacheGroups {
			return bad("group %d truncated, or more than %d groups", len(s.Groups), kvcache.MaxCacheGroups)
		}
		gi := len(s.Groups)
		g := kvcache.CacheGroup{Name: fmt.Sprintf("group.%d", gi), Kind: kvcache.GroupKind(b[0]),
			TokensPerPage: int(le.Uint32(b[5:])), WindowTokens: int(le.Uint32(b[9:]))}
		n := int64(le.Uint32(b[1:]))
		b = b[specGroupLen:]
		if n > int64(kvcache.MaxCacheRegions-regions) {
			return bad("group %d has %d regions, more than a spec may", gi, n)
		}
		for ri := range int(n) {
			if len(b) < specRegionLen || len(b) < specRegionLen+int(b[9]) {
				return bad("group %d region %d truncated", gi, ri)
			}
			pb := le.Uint64(b)
			if pb > 1<<50 {
				return bad("group %d region %d has %d bytes per page", gi, ri, pb)
			}
			r := kvcache.CacheRegion{Name: fmt.Sprintf("group.%d.region.%d", gi, ri), PageBytes: int64(pb), DType: kvcache.DType(b[8])}
			for _, d := range b[specRegionLen : specRegionLen+int(b[9])] {
				r.AlsoHolds = append(r.AlsoHolds, kvcache.DType(d))
			}
			b = b[specRegionLen+len(r.AlsoHolds):]
			g.Regions = append(g.Regions, r)
		}
		regions += int(n)
		s.Groups = append(s.Groups, g)
	}
	if err := s.Validate(); err != nil {
		return kvcache.CacheSpec{}, fmt.Errorf("%w: %w", ErrMalformedManifest, err)
	}
	return s, nil
}

// SpecDifference names the first way two cache specs' units would mean
// different bytes, or returns "" when they match: the group count, then
// group by group its kind, page size, window and region count, then
// region by region its bytes per page and element types. Names and
// adopted memory are not compared, nor the shard (ShardDifference).
func SpecDifference(sent, here kvcache.CacheSpec) string {
	if len(sent.Groups) != len(here.Groups) {
		return fmt.Sprintf("%d cache groups sent, %d here", len(sent.Groups), len(here.Groups))
	}
	for gi, g := range sent.Groups {
		h := here.Groups[gi]
		what := fmt.Sprintf("cache group %d (%q here)", gi, h.Name)
		switch {
		case g.Kind != h.Kind:
			return fmt.Sprintf("%s is %v in the sender's spec, %v here", what, g.Kind, h.Kind)
		case g.TokensPerPage != h.TokensPerPage:
			return fmt.Sprintf("%s has pages of %d tokens in the sender's spec, %d here", what, g.TokensPerPage, h.TokensPerPage)
		case g.WindowTokens != h.WindowTokens:
			return fmt.Sprintf("%s has a window of %d tokens in the sender's spec, %d here", what, g.WindowTokens, h.WindowTokens)
		case len(g.Regions) != len(h.Regions):
			return fmt.Sprintf("%s has %d regions in the sender's spec, %d here", what, len(g.Regions), len(h.Regions))
		}
		for ri, r := range g.Regions {
			hr := h.Regions[ri]
			rwhat := fmt.Sprintf("%s region %d (%q here)", what, ri, hr.Name)
			switch {
			case r.PageBytes != hr.PageBytes:
				return fmt.Sprintf("%s has %d bytes per page in the sender's spec, %d here", rwhat, r.PageBytes, hr.PageBytes)
			case r.DType != hr.DType:
				return fmt.Sprintf("%s holds %v in the sender's spec, %v here", rwhat, r.DType, hr.DType)
			case !equalDTypes(r.AlsoHolds, hr.AlsoHolds):
				return fmt.Sprintf("%s also holds %v in the sender's spec, %v here", rwhat, r.AlsoHolds, hr.AlsoHolds)
			}
		}
	}
	return ""
}

// ShardDifference names a difference between two specs' tensor-parallel
// shards, or returns "" when they are the same shard.
func ShardDifference(sent, here kvcache.CacheSpec) string {
	if sent.Shard == here.Shard {
		return ""
	}
	return fmt.Sprintf("the sender's pages hold %v, this pool's %v", sent.Shard, here.Shard)
}

func equalDTypes(a, b []kvcache.DType) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// wireSpec is s as a manifest carries it: names and adopted memory left
// out, so that a decoded manifest compares equal to the one encoded.
func wireSpec(s kvcache.CacheSpec) kvcache.CacheSpec {
	w := kvcache.CacheSpec{Shard: s.Shard, Groups: make([]kvcache.CacheGroup, len(s.Groups))}
	for gi, g := range s.Groups {
		wg := kvcache.CacheGroup{Name: fmt.Sprintf("group.%d", gi), Kind: g.Kind, TokensPerPage: g.TokensPerPage,
			WindowTokens: g.WindowTokens, Regions: make([]kvcache.CacheRegion, len(g.Regions))}
		for ri, r := range g.Regions {
			wg.Regions[ri] = kvcache.CacheRegion{Name: fmt.Sprintf("group.%d.region.%d", gi, ri), DType: r.DType,
				PageBytes: r.PageBytes}
			if len(r.AlsoHolds) > 0 {
				wg.Regions[ri].AlsoHolds = append([]kvcache.DType(nil), r.AlsoHolds...)
			}
		}
		w.Groups[gi] = wg
	}
	return w
}
