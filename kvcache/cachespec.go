package kvcache

import (
	"fmt"
	"math"
	"strings"
)

// Cache specs: what a model caches, as groups of regions.
//
// Grouped-query attention caches a K and a V per layer per token, which
// Geometry describes. Other models cache other things, and each of them
// holds a tenant's data exactly like KV does:
//
//   - Multi-head Latent Attention (DeepSeek-V3, the GLM-5 family) caches
//     one compressed latent per token per layer (kv_lora_rank +
//     qk_rope_head_dim elements; in fp8 with per-tile scales in
//     DeepSeek's serving format);
//   - DeepSeek-style sparse attention adds an indexer key cache per token
//     per layer (fp8 keys and an fp32 scale);
//   - linear-attention and state-space layers (Gated DeltaNet, Kimi Delta
//     Attention, Mamba2) keep one fixed-size state per request: a
//     convolution window and a recurrent state per layer, which
//     summarises the whole prompt;
//   - sliding-window layers (gpt-oss, Gemma) need only the pages of the
//     last window.
//
// A CacheSpec lists cache groups. Every group has its own regions and
// its own page (or slot) IDs [0, N_g), numbered by its own allocator; a
// lease takes what the request needs in every group or nothing, and one
// fill scrubs what a release frees in all of them (cudaops.FillSpans).
//
//   - The per-token group (GroupPerToken, exactly one, listed first)
//     holds every cache that grows with the request's tokens: K and V,
//     latents, indexer keys, per-page scales. Its regions may differ in
//     bytes per page; a page ID names the same tokens in all of them. The
//     prefix cache shares its pages, leases grow in it, and handoffs move
//     it.
//   - A sliding-window group (GroupSlidingWindow) holds per-token pages
//     of layers that attend to the last WindowTokens tokens only. A lease
//     holds at most ceil(WindowTokens/TokensPerPage)+1 of its pages, used
//     as a ring: Lease.SlideWindows scrubs the pages that slid out of the
//     window before the ring reuses them for the next tokens.
//   - A state group (GroupState) holds one slot per lease: every byte of
//     state the request's linear-attention layers keep.
//
// Sizing. Config.Pages (or PoolBytes) sizes the per-token group; window
// and state groups are sized by Config.MaxLeases, the most leases live
// at once: MaxLeases slots of a state group, MaxLeases rings of a window
// group.
//
// Quotas and reservations are shares of the pool. A tenant's QuotaPages
// and ReservedPages count pages of the per-token group; in every other
// group they stand for the same share of that group's pages or slots,
// rounded up (CacheSpec.share). A tenant allowed a tenth of the pool's
// pages may hold a tenth of its state slots, and a tenant that reserves
// a tenth of the pages is kept a tenth of the slots.
//
// A handoff moves every group: the prompt's per-token pages, each
// window's pages at the prompt's end, each state slot (units.go). Pools
// with a window or a state group share no prefixes yet: a prefix hit
// would need the state (or the window) at the prefix's end.

// GroupKind says how a cache group's memory follows a request.
type GroupKind uint8

const (
	// GroupPerToken: pages of TokensPerPage tokens, as many as the
	// request's tokens need.
	GroupPerToken GroupKind = iota + 1
	// GroupSlidingWindow: pages of TokensPerPage tokens of layers that
	// attend to the last WindowTokens tokens; a lease holds a ring of
	// ceil(WindowTokens/TokensPerPage)+1 of them at most.
	GroupSlidingWindow
	// GroupState: one slot per lease.
	GroupState
)

var groupKindNames = [...]string{"", "per_token", "sliding_window", "state"}

func (k GroupKind) String() string {
	if k >= GroupPerToken && int(k) < len(groupKindNames) {
		return groupKindNames[k]
	}
	return fmt.Sprintf("GroupKind(%d)", uint8(k))
}

// ParseGroupKind accepts the names String returns.
func ParseGroupKind(s string) (GroupKind, error) {
	for k := GroupPerToken; int(k) < len(groupKindNames); k++ {
		if strings.EqualFold(s, k.String()) {
			return k, nil
		}
	}
	return 0, fmt.Errorf("%w: unknown cache group kind %q (want per_token, sliding_window or state)", ErrInvalidConfig, s)
}

// CacheSpec describes every cache of a model as groups of regions.
type CacheSpec struct {
	// Model names what the spec describes (a preset's name); it is only
	// reported.
	Model  string
	Groups []CacheGroup
	// Shard says which tensor-parallel shard of the model's caches the
	// regions hold: rank Rank of Size (heads split across Size ranks).
	// The zero Shard is the whole model (a pool over one GPU, or over
	// every rank of a tensor-parallel group side by side). Two ranks'
	// shards have the same shapes and different heads: a handoff moves
	// KV only between pools of the same shard.
	Shard Shard
}

// Shard is a tensor-parallel shard: rank Rank of Size ranks; the zero
// Shard is unsharded.
type Shard struct{ Rank, Size int }

// maxShardSize bounds Shard.Size.
const maxShardSize = 1 << 16

func (s Shard) String() string {
	if s.Size == 0 {
		return "unsharded"
	}
	return fmt.Sprintf("tensor-parallel rank %d of %d", s.Rank, s.Size)
}

// CacheGroup is one cache group: regions whose pages (or slots) share one
// ID space.
type CacheGroup struct {
	// Name identifies the group in refusals, stats and block tables.
	Name string
	Kind GroupKind
	// TokensPerPage is the page size of a per-token or sliding-window
	// group; 0 for a state group.
	TokensPerPage int
	// WindowTokens is a sliding-window group's window; 0 otherwise.
	WindowTokens int
	Regions      []CacheRegion
}

// CacheRegion is one tensor of a group: PageBytes per page (or slot).
type CacheRegion struct {
	// Name identifies the region (for example "layer.3.latent"); unique
	// in the spec.
	Name string
	// DType is the element type; AlsoHolds lists others stored in the
	// same bytes (the fp32 scales beside fp8 keys). A scrub pattern must
	// be a finite number read as every one of them.
	DType     DType
	AlsoHolds []DType
	// PageBytes is one page's (or slot's) length in this region, a
	// multiple of 4.
	PageBytes int64
	// Memory, if set, is engine-owned memory the pool adopts as this
	// region instead of allocating it. Every region of a spec is adopted
	// or none is.
	Memory *RegionMemory
}

// RegionMemory is where an adopted region's pages are: page p at
// address Base + p×Stride (or Host[p×Stride:]), PageBytes long.
type RegionMemory struct {
	// Base is the device address of page 0 on a CUDA pool.
	Base uint64
	// Host is the memory of a host pool's region, from page 0 on.
	Host []byte
	// Stride is the distance in bytes from page p to p+1; 0 means
	// PageBytes. A stride smaller than a page is refused.
	Stride int64
	// Pages is how many pages (slots) the memory holds; 0 means exactly
	// as many as the group has. Fewer than the group has is refused.
	Pages int
}

// Limits beyond which a spec is taken for a mistake.
const (
	MaxCacheGroups   = 16
	MaxCacheRegions  = 1 << 14
	MaxWindowTokens  = 1 << 24
	maxCacheNameLen  = 128
	maxLeasesLimit   = 1 << 24
	maxSlotBytes     = 1 << 34 // one state slot over all its regions: 16 GiB
	maxWindowPages   = 1 << 16 // ring pages per lease
	defaultGroupName = "kv"
)

// IsZero reports whether s describes nothing (Config uses Geometry then).
func (s CacheSpec) IsZero() bool { return s.Model == "" && len(s.Groups) == 0 }

// Validate checks the spec on its own: names, kinds, sizes, element types
// and adopted memory descriptions. Each problem gets its own error
// wrapping ErrInvalidConfig.
func (s CacheSpec) Validate() error {
	_, err := s.layout()
	return err
}

// TokensPerPage is the per-token group's page size (0 for an invalid
// spec).
func (s CacheSpec) TokensPerPage() int {
	if len(s.Groups) == 0 {
		return 0
	}
	return s.Groups[0].TokensPerPage
}

// PageBytes is the size of one page of the per-token group over all its
// regions.
func (s CacheSpec) PageBytes() int64 {
	if len(s.Groups) == 0 {
		return 0
	}
	return s.Groups[0].bytes()
}

// TokenBytes is the per-token group's size of one token.
func (s CacheSpec) TokenBytes() int64 {
	if tpp := s.TokensPerPage(); tpp > 0 {
		return s.PageBytes() / int64(tpp)
	}
	return 0
}

// PagesFor returns the per-token pages that hold tokens tokens.
func (s CacheSpec) PagesFor(tokens int) int {
	tpp := s.TokensPerPage()
	if tpp <= 0 {
		return 0
	}
	return int((int64(tokens) + int64(tpp) - 1) / int64(tpp))
}

// LeaseBytes is what one live lease of tokens tokens holds in every
// group but the per-token one (its state slot and window rings),
// saturating at math.MaxInt64.
func (s CacheSpec) LeaseBytes(tokens int) int64 {
	var b int64
	for _, g := range s.Groups[min(1, len(s.Groups)):] {
		b = satAdd(b, satMul(int64(g.perLease(tokens)), g.bytes()))
	}
	return b
}

// BytesFor is the memory a pool of pages per-token pages and maxLeases
// leases needs over all groups, saturating at math.MaxInt64: a valid spec
// can need more than int64 counts (2^24 leases of a ring of 2^16 pages of
// 2^44 bytes).
func (s CacheSpec) BytesFor(pages, maxLeases int) int64 {
	b := satMul(int64(pages), s.PageBytes())
	for _, g := range s.Groups[min(1, len(s.Groups)):] {
		b = satAdd(b, satMul(satMul(int64(maxLeases), int64(g.perLease(math.MaxInt32))), g.bytes()))
	}
	return b
}

// PagesForMemory is how many per-token pages fit in free device bytes
// after keeping headroom for the engine, once every other group has its
// memory for maxLeases leases: set Config.Pages to it (and
// Config.MaxLeases to maxLeases).
func (s CacheSpec) PagesForMemory(free, headroom int64, maxLeases int) (int, error) {
	lay, err := s.layout()
	if err != nil {
		return 0, err
	}
	if lay.perLeaseGroups() && (maxLeases < 1 || maxLeases > maxLeasesLimit) {
		return 0, fmt.Errorf("%w: MaxLeases = %d, want 1..%d: it sizes the %s group", ErrInvalidConfig, maxLeases, maxLeasesLimit, lay.groups[1].name)
	}
	side := s.BytesFor(0, maxLeases)
	if free < 0 || headroom < 0 {
		return 0, fmt.Errorf("%w: free %d and headroom %d bytes must not be negative", ErrInvalidConfig, free, headroom)
	}
	left := free - headroom // no overflow: both are ≥ 0
	if left < side || left-side < s.PageBytes() {
		return 0, fmt.Errorf("%w: %d free bytes less %d headroom and %d for %d leases' %s leave no page of %d bytes",
			ErrUndersizedPool, free, headroom, side, maxLeases, lay.perLeaseNames(), s.PageBytes())
	}
	return int(min((left-side)/s.PageBytes(), int64(math.MaxInt32))), nil
}

// bytes is one page (slot) of the group over all its regions.
func (g CacheGroup) bytes() int64 {
	var b int64
	for _, r := range g.Regions {
		b += r.PageBytes
	}
	return b
}

// windowPages is a sliding-window group's ring: the most pages a lease
// holds.
func (g CacheGroup) windowPages() int {
	return (g.WindowTokens+g.TokensPerPage-1)/g.TokensPerPage + 1
}

// perLease is what a lease of tokens tokens holds in a window or state
// group.
func (g CacheGroup) perLease(tokens int) int {
	switch g.Kind {
	case GroupState:
		return 1
	case GroupSlidingWindow:
		need := (int64(tokens) + int64(g.TokensPerPage) - 1) / int64(g.TokensPerPage)
		return int(min(need, int64(g.windowPages())))
	}
	return 0
}

// layout is a validated spec in the form a pool uses: regions in device
// order (the per-token group's first, then each other group's), and per
// group where its regions are.
type layout struct {
	spec    CacheSpec
	tpp     int
	groups  []groupLayout // the per-token group first
	regions []CacheRegion // all, device order
	dtypes  []DType       // distinct, the per-token group's first region's first
	adopted bool
}

type groupLayout struct {
	name         string
	kind         GroupKind
	first, count int   // device regions [first, first+count)
	pageBytes    int64 // over the group's regions
	tpp, window  int
	group        CacheGroup
}

// perLeaseGroups reports whether the spec has groups beyond the
// per-token one: groups sized per lease (Config.MaxLeases).
func (l *layout) perLeaseGroups() bool { return len(l.groups) > 1 }

// perLeaseNames lists the groups sized per lease, quoted.
func (l *layout) perLeaseNames() string {
	names := make([]string, 0, len(l.groups)-1)
	for _, g := range l.groups[1:] {
		names = append(names, fmt.Sprintf("%q", g.name))
	}
	return strings.Join(names, ", ")
}

// groupPages is the size of a window or state group g for maxLeases
// leases.
func (g groupLayout) groupPages(maxLeases int) int {
	return maxLeases * g.group.perLease(math.MaxInt32)
}

func (s CacheSpec) layout() (*layout, error) {
	bad := func(format string, args ...any) (*layout, error) {
		return nil, fmt.Errorf("%w: cache spec: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	switch {
	case len(s.Groups) == 0:
		return bad("no cache groups")
	case len(s.Groups) > MaxCacheGroups:
		return bad("%d cache groups, at most %d", len(s.Groups), MaxCacheGroups)
	case s.Groups[0].Kind != GroupPerToken:
		return bad("group 0 (%q) is %v: the first group must be the per-token one", s.Groups[0].Name, s.Groups[0].Kind)
	case len(s.Model) > maxCacheNameLen:
		return bad("model name of %d bytes, at most %d", len(s.Model), maxCacheNameLen)
	case s.Shard.Size < 0 || s.Shard.Size > maxShardSize || s.Shard.Rank < 0 || (s.Shard.Size == 0 && s.Shard.Rank != 0) ||
		(s.Shard.Size > 0 && s.Shard.Rank >= s.Shard.Size):
		return bad("shard rank %d of %d (want rank 0..size-1 of size 1..%d, or the zero shard)", s.Shard.Rank, s.Shard.Size, maxShardSize)
	}
	l := &layout{spec: s, tpp: s.Groups[0].TokensPerPage}
	groupNames := map[string]bool{}
	regionNames := map[string]bool{}
	seenDType := map[DType]bool{}
	adopted, allocated := 0, 0
	for gi, g := range s.Groups {
		what := fmt.Sprintf("group %d (%q)", gi, g.Name)
		switch {
		case g.Name == "" || len(g.Name) > maxCacheNameLen:
			return bad("group %d has a name of %d bytes, want 1..%d", gi, len(g.Name), maxCacheNameLen)
		case groupNames[g.Name]:
			return bad("two groups named %q", g.Name)
		case g.Kind < GroupPerToken || g.Kind > GroupState:
			return bad("%s has kind %v", what, g.Kind)
		case gi > 0 && g.Kind == GroupPerToken:
			return bad("%s is a second per-token group: put its regions in group 0 (regions may differ in bytes per page)", what)
		case len(g.Regions) == 0:
			return bad("%s has no regions (zero layers?)", what)
		case len(l.regions)+len(g.Regions) > MaxCacheRegions:
			return bad("more than %d regions", MaxCacheRegions)
		}
		groupNames[g.Name] = true
		switch g.Kind {
		case GroupPerToken, GroupSlidingWindow:
			if g.TokensPerPage < 1 || g.TokensPerPage > MaxTokensPerPage {
				return bad("%s has TokensPerPage = %d, want 1..%d", what, g.TokensPerPage, MaxTokensPerPage)
			}
			if g.Kind == GroupPerToken && g.WindowTokens != 0 {
				return bad("%s is per-token but has WindowTokens = %d (use a sliding_window group)", what, g.WindowTokens)
			}
			if g.Kind == GroupSlidingWindow {
				if g.WindowTokens < 1 || g.WindowTokens > MaxWindowTokens {
					return bad("%s has WindowTokens = %d, want 1..%d", what, g.WindowTokens, MaxWindowTokens)
				}
				if g.windowPages() > maxWindowPages {
					return bad("%s has a ring of %d pages, at most %d", what, g.windowPages(), maxWindowPages)
				}
			}
		case GroupState:
			if g.TokensPerPage != 0 || g.WindowTokens != 0 {
				return bad("%s is a state group: TokensPerPage (%d) and WindowTokens (%d) must be 0", what, g.TokensPerPage, g.WindowTokens)
			}
		}
		gl := groupLayout{name: g.Name, kind: g.Kind, first: len(l.regions), count: len(g.Regions),
			tpp: g.TokensPerPage, window: g.WindowTokens, group: g}
		for ri, r := range g.Regions {
			rwhat := fmt.Sprintf("%s region %d (%q)", what, ri, r.Name)
			switch {
			case r.Name == "" || len(r.Name) > maxCacheNameLen:
				return bad("%s region %d has a name of %d bytes, want 1..%d", what, ri, len(r.Name), maxCacheNameLen)
			case regionNames[r.Name]:
				return bad("two regions named %q", r.Name)
			case !r.DType.Valid():
				return bad("%s has dtype %v", rwhat, r.DType)
			case r.PageBytes <= 0 || r.PageBytes%4 != 0:
				return bad("%s has %d bytes per page, want a positive multiple of 4 (fills write 32-bit words)", rwhat, r.PageBytes)
			case r.PageBytes > maxRegionPage:
				return bad("%s has %d bytes per page, above %d", rwhat, r.PageBytes, int64(maxRegionPage))
			}
			for _, d := range r.AlsoHolds {
				if !d.Valid() {
					return bad("%s also holds dtype %v", rwhat, d)
				}
			}
			regionNames[r.Name] = true
			for _, d := range append([]DType{r.DType}, r.AlsoHolds...) {
				if !seenDType[d] {
					seenDType[d] = true
					l.dtypes = append(l.dtypes, d)
				}
			}
			if r.Memory != nil {
				if err := r.Memory.validate(r.PageBytes); err != nil {
					return nil, fmt.Errorf("cache spec: %s: %w", rwhat, err)
				}
				adopted++
			} else {
				allocated++
			}
			gl.pageBytes += r.PageBytes
			l.regions = append(l.regions, r)
		}
		if g.Kind == GroupState && gl.pageBytes > maxSlotBytes {
			return bad("%s has slots of %d bytes, above %d", what, gl.pageBytes, int64(maxSlotBytes))
		}
		l.groups = append(l.groups, gl)
	}
	if adopted > 0 && allocated > 0 {
		return bad("%d regions adopt engine memory and %d do not: adopt all or none", adopted, allocated)
	}
	l.adopted = adopted > 0
	return l, nil
}

func (m *RegionMemory) validate(pageBytes int64) error {
	stride := m.Stride
	if stride == 0 {
		stride = pageBytes
	}
	switch {
	case stride < pageBytes:
		return fmt.Errorf("%w: adopted stride %d is smaller than a page of %d bytes", ErrInvalidConfig, m.Stride, pageBytes)
	case stride%4 != 0:
		return fmt.Errorf("%w: adopted stride %d is not a multiple of 4", ErrInvalidConfig, m.Stride)
	case m.Pages < 0:
		return fmt.Errorf("%w: adopted memory of %d pages", ErrInvalidConfig, m.Pages)
	case m.Host != nil && m.Base != 0:
		return fmt.Errorf("%w: adopted memory gives both a host buffer and a device address %#x", ErrInvalidConfig, m.Base)
	case m.Host == nil && m.Base == 0:
		return fmt.Errorf("%w: adopted memory gives neither a host buffer nor a device address", ErrInvalidConfig)
	}
	return nil
}

// GeometrySpec is the cache spec a Geometry describes: one per-token
// group named "kv" with a K and a V region per layer ("layer.L.k",
// "layer.L.v"), region 2L and 2L+1.
func GeometrySpec(g Geometry) CacheSpec {
	return CacheSpec{Groups: []CacheGroup{{
		Name: defaultGroupName, Kind: GroupPerToken, TokensPerPage: g.TokensPerPage,
		Regions: AttentionKV(g.Layers, g.KVHeads, g.HeadDim, g.DType, g.TokensPerPage),
	}}}
}

// AttentionKV returns K and V regions for layers layers of kvHeads heads
// of headDim elements (SGLang's per-layer k_buffer and v_buffer, vLLM's
// per-layer KV cache), named "layer.L.k" and "layer.L.v".
func AttentionKV(layers, kvHeads, headDim int, dtype DType, tokensPerPage int) []CacheRegion {
	return AttentionKVOf(layerRange(layers), kvHeads, headDim, dtype, tokensPerPage)
}

// AttentionKVOf is AttentionKV for the listed layers only (the
// full-attention layers of a hybrid model).
func AttentionKVOf(layers []int, kvHeads, headDim int, dtype DType, tokensPerPage int) []CacheRegion {
	pb := int64(tokensPerPage) * int64(kvHeads) * int64(headDim) * int64(dtype.Size())
	rs := make([]CacheRegion, 0, 2*len(layers))
	for _, l := range layers {
		rs = append(rs,
			CacheRegion{Name: fmt.Sprintf("layer.%d.k", l), DType: dtype, PageBytes: pb},
			CacheRegion{Name: fmt.Sprintf("layer.%d.v", l), DType: dtype, PageBytes: pb})
	}
	return rs
}

// MLALatent returns one latent region per listed layer for Multi-head
// Latent Attention: kvLoraRank + ropeDim elements of dtype per token
// ("layer.L.latent"), the layout of vLLM's and SGLang's bf16 MLA caches.
func MLALatent(layers []int, kvLoraRank, ropeDim int, dtype DType, tokensPerPage int) []CacheRegion {
	pb := int64(tokensPerPage) * int64(kvLoraRank+ropeDim) * int64(dtype.Size())
	rs := make([]CacheRegion, 0, len(layers))
	for _, l := range layers {
		rs = append(rs, CacheRegion{Name: fmt.Sprintf("layer.%d.latent", l), DType: dtype, PageBytes: pb})
	}
	return rs
}

// MLALatentFP8 is MLALatent in DeepSeek's fp8 serving format (vLLM's
// fp8_ds_mla, FlashMLA's): per token the latent in fp8, one fp32 scale
// per 128 latent elements, and the rope part in bf16, in one region:
// kvLoraRank + 4·kvLoraRank/128 + 2·ropeDim bytes (656 for 512 + 64).
func MLALatentFP8(layers []int, kvLoraRank, ropeDim int, tokensPerPage int) []CacheRegion {
	perToken := int64(kvLoraRank) + 4*int64((kvLoraRank+127)/128) + 2*int64(ropeDim)
	rs := make([]CacheRegion, 0, len(layers))
	for _, l := range layers {
		rs = append(rs, CacheRegion{Name: fmt.Sprintf("layer.%d.latent", l), DType: FP8E4M3,
			AlsoHolds: []DType{FP32, BF16}, PageBytes: int64(tokensPerPage) * perToken})
	}
	return rs
}

// IndexerKeys returns the key cache of DeepSeek-style sparse attention's
// indexer for the listed layers: per token headDim fp8 elements and one
// fp32 scale per 128 of them ("layer.L.indexer"), as vLLM stores it.
func IndexerKeys(layers []int, headDim, tokensPerPage int) []CacheRegion {
	perToken := int64(headDim) + 4*int64((headDim+127)/128)
	rs := make([]CacheRegion, 0, len(layers))
	for _, l := range layers {
		rs = append(rs, CacheRegion{Name: fmt.Sprintf("layer.%d.indexer", l), DType: FP8E4M3,
			AlsoHolds: []DType{FP32}, PageBytes: int64(tokensPerPage) * perToken})
	}
	return rs
}

// LinearAttentionState returns the state-slot regions of the listed
// linear-attention layers: a convolution window of convDim channels ×
// (convKernel − 1) positions in convDType ("layer.L.conv") and a
// recurrent state of heads × keyDim × valueDim in stateDType
// ("layer.L.state"), the shapes of Gated DeltaNet and Kimi Delta
// Attention caches in vLLM and SGLang.
func LinearAttentionState(layers []int, convDim, convKernel int, convDType DType, heads, keyDim, valueDim int, stateDType DType) []CacheRegion {
	conv := roundUp4(int64(convDim) * int64(convKernel-1) * int64(convDType.Size()))
	state := roundUp4(int64(heads) * int64(keyDim) * int64(valueDim) * int64(stateDType.Size()))
	rs := make([]CacheRegion, 0, 2*len(layers))
	for _, l := range layers {
		rs = append(rs,
			CacheRegion{Name: fmt.Sprintf("layer.%d.conv", l), DType: convDType, PageBytes: conv},
			CacheRegion{Name: fmt.Sprintf("layer.%d.state", l), DType: stateDType, PageBytes: state})
	}
	return rs
}

func roundUp4(n int64) int64 { return (n + 3) &^ 3 }

// layerRange is [0, n).
func layerRange(n int) []int {
	ls := make([]int, max(n, 0))
	for i := range ls {
		ls[i] = i
	}
	return ls
}

// Layers lists the layers in [0, n) for which keep is true: the
// full-attention or the linear-attention layers of a hybrid model.
func Layers(n int, keep func(layer int) bool) []int {
	var ls []int
	for l := range n {
		if keep(l) {
			ls = append(ls, l)
		}
	}
	return ls
}
