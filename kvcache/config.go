package kvcache

import (
	"context"
	"fmt"
	"log/slog"
	"math"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/internal/sysmem"
	"github.com/kvfence/kvfence/isolation"
)

// Re-exported so that engines configure a pool from this package alone.
type (
	// DType is the KV element type.
	DType = isolation.DType
	// ScrubPolicy says how freed pages are cleaned.
	ScrubPolicy = isolation.ScrubPolicy
	// ScrubKind selects zero, poison or canary scrubbing.
	ScrubKind = isolation.ScrubKind
	// TenantConfig declares a tenant's quota and reservation.
	TenantConfig = isolation.TenantConfig
	// Sizing says how much of a request's output budget admission
	// reserves: all of it, or the prompt plus a headroom (the lease grows).
	Sizing = isolation.Sizing
	// SizingMode selects full or on-demand sizing.
	SizingMode = isolation.SizingMode
)

const (
	FP8E4M3 = isolation.FP8E4M3
	FP8E5M2 = isolation.FP8E5M2
	FP16    = isolation.FP16
	BF16    = isolation.BF16
	FP32    = isolation.FP32

	ScrubZero   = isolation.ScrubZero
	ScrubPoison = isolation.ScrubPoison
	ScrubCanary = isolation.ScrubCanary

	SizeInherit  = isolation.SizeInherit
	SizeFull     = isolation.SizeFull
	SizeOnDemand = isolation.SizeOnDemand
)

// Geometry is the shape of one page: TokensPerPage tokens of K and V for
// every layer. Page p occupies, in each of the 2×Layers regions (layer l's
// K is region 2l, its V region 2l+1), TokensPerPage × KVHeads × HeadDim
// elements of DType.
type Geometry struct {
	TokensPerPage int
	Layers        int
	KVHeads       int
	HeadDim       int
	DType         DType
}

// Limits beyond which a geometry is taken for a mistake.
const (
	MaxTokensPerPage = 1 << 16
	MaxLayers        = 1 << 12
	MaxKVHeads       = 1 << 12
	MaxHeadDim       = 1 << 16
	maxRegionPage    = 1 << 30 // bytes of one page in one region
)

// Validate checks every dimension.
func (g Geometry) Validate() error {
	check := func(name string, v, limit int) error {
		if v < 1 || v > limit {
			return fmt.Errorf("%w: geometry %s = %d, want 1..%d", ErrInvalidConfig, name, v, limit)
		}
		return nil
	}
	for _, err := range []error{
		check("TokensPerPage", g.TokensPerPage, MaxTokensPerPage),
		check("Layers", g.Layers, MaxLayers),
		check("KVHeads", g.KVHeads, MaxKVHeads),
		check("HeadDim", g.HeadDim, MaxHeadDim),
	} {
		if err != nil {
			return err
		}
	}
	if !g.DType.Valid() {
		return fmt.Errorf("%w: geometry DType %v", ErrInvalidConfig, g.DType)
	}
	b := int64(g.TokensPerPage) * int64(g.KVHeads) * int64(g.HeadDim) * int64(g.DType.Size())
	if b > maxRegionPage {
		return fmt.Errorf("%w: one page of one layer's K would be %d bytes, above %d", ErrInvalidConfig, b, maxRegionPage)
	}
	if b%4 != 0 {
		return fmt.Errorf("%w: one page of one layer's K is %d bytes, not a multiple of 4", ErrInvalidConfig, b)
	}
	return nil
}

// Regions is the number of physical regions: K and V per layer.
func (g Geometry) Regions() int { return 2 * g.Layers }

// RegionPageBytes is the size of one page in one region.
func (g Geometry) RegionPageBytes() int64 {
	return int64(g.TokensPerPage) * int64(g.KVHeads) * int64(g.HeadDim) * int64(g.DType.Size())
}

// PageBytes is the size of one page over all regions.
func (g Geometry) PageBytes() int64 { return g.RegionPageBytes() * int64(g.Regions()) }

// TokenBytes is the KV size of one token over all layers.
func (g Geometry) TokenBytes() int64 { return g.PageBytes() / int64(g.TokensPerPage) }

// PagesForMemory is how many pages fit in free device bytes after keeping
// headroom for the engine's weights, activations and workspace (for
// example free from cudaops/gpuinfo.Probe). Set Config.Pages to it, and
// New refuses the pool if those pages cannot hold MaxContextTokens.
func (g Geometry) PagesForMemory(free, headroom int64) (int, error) {
	if err := g.Validate(); err != nil {
		return 0, err
	}
	return cudaops.PagesForMemory(free, headroom, g.PageBytes())
}

// PagesFor returns the pages that hold tokens tokens.
func (g Geometry) PagesFor(tokens int) int {
	return int((int64(tokens) + int64(g.TokensPerPage) - 1) / int64(g.TokensPerPage))
}

// Config describes a pool.
type Config struct {
	// Geometry is the page shape of a grouped-query-attention model (K
	// and V per layer). Cache, instead, describes any model's caches as
	// groups of regions (see CacheSpec); set exactly one.
	Geometry Geometry
	Cache    CacheSpec
	// Pages is the pool size in pages (of the per-token group).
	// Alternatively PoolBytes gives the memory over all regions of all
	// groups and the pages are derived; set exactly one.
	Pages     int
	PoolBytes int64
	// MaxLeases is the most leases live at once. A spec with a sliding
	// window or a state group needs it: it sizes them (MaxLeases slots,
	// MaxLeases window rings, and Prefix.CheckpointSlots more of each for
	// state checkpoints), and an admission beyond them is refused like
	// one beyond any group's capacity. Without such groups it must be 0.
	MaxLeases int
	// MaxContextTokens is the longest prompt + output the engine serves
	// (its context window). Required. A pool whose pages cannot hold it is
	// refused unless AllowUndersizedPool is set; then longer requests are
	// refused at admission with ErrExceedsCapacity.
	MaxContextTokens    int
	AllowUndersizedPool bool
	// Tenants registered at creation; more can be added with AddTenant.
	Tenants []TenantConfig
	// Scrub is the policy for freed pages; the zero value zeroes them.
	Scrub ScrubPolicy
	// Prefix configures prefix sharing; the zero value enables it without
	// events. A pool with a sliding-window or a state group shares no
	// prefixes (see CacheSpec).
	Prefix PrefixConfig
	// Sizing is how leases are sized at admission unless a tenant
	// (TenantConfig.Sizing) or a request (Request.Sizing) says otherwise;
	// the zero value is full sizing: prompt + max new tokens.
	Sizing Sizing
	// GrowthWatermark is the share of the pool's pages in service that new
	// admissions leave free for the growth of running leases (Lease.Grow),
	// as vLLM's watermark does: an admission that would cut into it is
	// refused, retryably (ErrPoolExhausted, cause ErrKeptForGrowth).
	// 0 (the default) keeps nothing; at most MaxGrowthWatermark.
	GrowthWatermark float64
	// HostTier is a second page space in host memory under the pool
	// (tier.go): cached pages the device's LRU evicts are kept there
	// instead of dropped and copied back into admissions whose prefix
	// continues there, and Preempt swaps a request's private pages to it.
	// The zero value has none. In a pool with sliding-window or state
	// groups it also keeps the state checkpoints the device evicts
	// (HostTierConfig.Checkpoints). A device that cannot copy pages to
	// host memory cannot have one (ErrTierUnsupported; the Host and CUDA
	// devices can: cudaops.HostCopier).
	HostTier HostTierConfig
	// Device holds the pages. Nil means a new Host device owned (and
	// closed) by the pool. A device with no regions gets the spec's
	// regions allocated by the pool, or adopted from the engine memory
	// the spec names (CacheRegion.Memory). A device that already has
	// regions (adopted by the caller) must have exactly the spec's
	// regions in order (per-token group first), each of the region's page
	// size and at least its group's pages. A caller-supplied device is not
	// closed by the pool.
	Device cudaops.Device
	// Logger receives the events an operator must see, each logged once
	// with its numbers: a configuration New refuses, a failed fill (its
	// pages retired, the pool faulted) and a canary mismatch. Nothing is
	// logged per admission or release. Nil logs nothing.
	Logger *slog.Logger
}

// logger returns the configured logger, or one that discards everything,
// so that the rare paths that log need no nil checks.
func (c *Config) logger() *slog.Logger {
	if c.Logger != nil {
		return c.Logger
	}
	return slog.New(slog.DiscardHandler)
}

// logRefused logs a configuration New refused. The error's text carries
// the numbers (pages, bytes, tokens); the attributes repeat the ones an
// operator filters on.
func (c *Config) logRefused(err error) {
	if c.Logger == nil {
		return
	}
	c.Logger.LogAttrs(context.Background(), slog.LevelError, "kvcache: pool configuration refused",
		slog.Int("pages", c.Pages), slog.Int64("pool_bytes", c.PoolBytes),
		slog.Int("tokens_per_page", c.Geometry.TokensPerPage), slog.Int("max_context_tokens", c.MaxContextTokens),
		slog.Any("error", err))
}

// spec returns the pool's cache spec (Geometry's, or Cache) and its
// layout.
func (c *Config) spec() (*layout, error) {
	switch {
	case !c.Cache.IsZero() && c.Geometry != (Geometry{}):
		return nil, fmt.Errorf("%w: set Geometry or Cache, not both", ErrInvalidConfig)
	case c.Cache.IsZero():
		if err := c.Geometry.Validate(); err != nil {
			return nil, err
		}
		return GeometrySpec(c.Geometry).layout()
	}
	return c.Cache.layout()
}

// sizes derives and validates the pool size: the pages (slots) of every
// group, the per-token group's first.
func (c *Config) sizes(lay *layout) (pages []int, err error) {
	switch {
	case c.Pages != 0 && c.PoolBytes != 0:
		return nil, fmt.Errorf("%w: set Pages (%d) or PoolBytes (%d), not both", ErrInvalidConfig, c.Pages, c.PoolBytes)
	case c.Pages < 0 || c.PoolBytes < 0:
		return nil, fmt.Errorf("%w: negative pool size (Pages %d, PoolBytes %d)", ErrInvalidConfig, c.Pages, c.PoolBytes)
	case c.Pages == 0 && c.PoolBytes == 0:
		return nil, fmt.Errorf("%w: pool size missing: set Pages or PoolBytes", ErrInvalidConfig)
	case !lay.perLeaseGroups() && c.MaxLeases != 0:
		return nil, fmt.Errorf("%w: MaxLeases = %d, but the pool has no sliding-window or state group for it to size", ErrInvalidConfig, c.MaxLeases)
	case lay.perLeaseGroups() && (c.MaxLeases < 1 || c.MaxLeases > maxLeasesLimit):
		return nil, fmt.Errorf("%w: MaxLeases = %d, want 1..%d: it sizes the %s group(s)", ErrInvalidConfig, c.MaxLeases, maxLeasesLimit, lay.perLeaseNames())
	case !lay.perLeaseGroups() && c.Prefix.CheckpointSlots != 0:
		return nil, fmt.Errorf("%w: Prefix.CheckpointSlots = %d, but the pool has no sliding-window or state group to checkpoint", ErrInvalidConfig, c.Prefix.CheckpointSlots)
	case c.Prefix.CheckpointSlots < 0 || c.Prefix.CheckpointSlots > maxLeasesLimit-c.MaxLeases:
		return nil, fmt.Errorf("%w: Prefix.CheckpointSlots = %d, want 0..%d beside MaxLeases %d", ErrInvalidConfig, c.Prefix.CheckpointSlots, maxLeasesLimit-c.MaxLeases, c.MaxLeases)
	}
	slots := c.MaxLeases + c.Prefix.CheckpointSlots
	var sideBytes int64
	pages = make([]int, len(lay.groups))
	for i, g := range lay.groups {
		if i == 0 {
			continue // sized by Pages or PoolBytes, below
		}
		n := g.groupPages(slots)
		if n > allocator.MaxPages {
			return nil, fmt.Errorf("%w: group %q needs %d pages for %d leases and checkpoints, more than the %d an allocator addresses",
				ErrInvalidConfig, g.name, n, slots, allocator.MaxPages)
		}
		pages[i] = n
		sideBytes = satAdd(sideBytes, satMul(int64(n), g.pageBytes)) // 2^31 pages of 2^44 bytes overflow
	}
	n := int64(c.Pages)
	if c.PoolBytes != 0 {
		left := c.PoolBytes - sideBytes
		n = left / lay.groups[0].pageBytes
		if left <= 0 || n == 0 {
			return nil, fmt.Errorf("%w: PoolBytes %d holds no page of %d bytes beside %d bytes for the %s group(s)",
				ErrInvalidConfig, c.PoolBytes, lay.groups[0].pageBytes, sideBytes, lay.perLeaseNames())
		}
	}
	if n > allocator.MaxPages {
		return nil, fmt.Errorf("%w: %d pages, more than the %d a block table can address", ErrInvalidConfig, n, allocator.MaxPages)
	}
	pages[0] = int(n)
	return pages, nil
}

// validated is a checked Config: its layout and group sizes.
type validated struct {
	lay       *layout
	pages     []int // each group's pages (slots), the per-token group's first
	tierSlots int   // the host tier's page slots, 0 for none
	tierCkpts int   // its checkpoint slots
}

// validate checks everything but the device.
func (c *Config) validate() (validated, error) {
	lay, err := c.spec()
	if err != nil {
		return validated{}, err
	}
	pages, err := c.sizes(lay)
	if err != nil {
		return validated{}, err
	}
	if err := c.Prefix.validate(); err != nil {
		return validated{}, err
	}
	if err := c.Sizing.Validate(); err != nil {
		return validated{}, fmt.Errorf("%w: Sizing: %w", ErrInvalidConfig, err)
	}
	if !(c.GrowthWatermark >= 0 && c.GrowthWatermark <= MaxGrowthWatermark) { // NaN fails too
		return validated{}, fmt.Errorf("%w: GrowthWatermark = %v, want 0..%v", ErrInvalidConfig, c.GrowthWatermark, MaxGrowthWatermark)
	}
	if _, err := c.Scrub.FillSpecFor(lay.dtypes...); err != nil {
		return validated{}, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if c.MaxContextTokens <= 0 {
		return validated{}, fmt.Errorf("%w: MaxContextTokens = %d, want the engine's context window (> 0)", ErrInvalidConfig, c.MaxContextTokens)
	}
	capTokens := int64(pages[0]) * int64(lay.tpp)
	if int64(c.MaxContextTokens) > capTokens && !c.AllowUndersizedPool {
		return validated{}, fmt.Errorf("%w: pool holds %d tokens (%d pages of %d), max context is %d tokens; "+
			"enlarge the pool, lower MaxContextTokens, or set AllowUndersizedPool to refuse longer requests at admission",
			ErrUndersizedPool, capTokens, pages[0], lay.tpp, c.MaxContextTokens)
	}
	for _, g := range lay.groups {
		if g.kind == GroupSlidingWindow && g.window > c.MaxContextTokens {
			return validated{}, fmt.Errorf("%w: group %q has a window of %d tokens, longer than the max context of %d: it is a per-token group",
				ErrInvalidConfig, g.name, g.window, c.MaxContextTokens)
		}
	}
	v := validated{lay: lay, pages: pages}
	if c.HostTier.enabled() {
		if v.tierSlots, v.tierCkpts, err = c.HostTier.slots(lay); err != nil {
			return validated{}, err
		}
	}
	if err := c.checkHostMemory(v); err != nil {
		return validated{}, err
	}
	return v, nil
}

// MaxGrowthWatermark bounds Config.GrowthWatermark: a pool that keeps more
// than half its pages from new admissions is a mistake.
const MaxGrowthWatermark = 0.5

// metadataBytesPerPage is the host memory a pool keeps per page whatever
// its device: the allocator's record (16 bytes), the prefix index's page
// slot (8) and Check's per-page count (8).
const metadataBytesPerPage = 32

// availableMemory is sysmem.Available; tests replace it.
var availableMemory = sysmem.Available

// checkHostMemory refuses, before anything is allocated, a pool whose host
// memory (page metadata, and the page memory itself when the pool makes
// its own host device) exceeds what this process can still use: an
// allocation that large would end the process with an out-of-memory
// fault, which no caller could handle.
func (c *Config) checkHostMemory(v validated) error {
	avail, ok := availableMemory()
	if !ok {
		return nil // cannot tell (not Linux): the allocations will say
	}
	var pages, host int64
	for i, g := range v.lay.groups {
		pages += int64(v.pages[i])
		// Saturating: a page can span 2^43 bytes, pages × that overflows.
		host = satAdd(host, satMul(int64(v.pages[i]), g.pageBytes))
	}
	meta := pages * metadataBytesPerPage
	if c.Device != nil || v.lay.adopted {
		host = 0 // the page memory is not the pool's to allocate here
	}
	// The host tier is host memory whatever the device (page-locked on
	// CUDA), with its slots' metadata.
	host = satAdd(host, satMul(int64(v.tierSlots), v.lay.groups[0].pageBytes))
	host = satAdd(host, satMul(int64(v.tierCkpts), checkpointSlotBytes(v.lay)))
	meta += int64(v.tierSlots+v.tierCkpts) * metadataBytesPerPage
	host = min(host, math.MaxInt64-meta)
	if need := meta + host; need > avail {
		return fmt.Errorf("%w: a pool of %d pages needs %d bytes of host memory (%d for page metadata, %d for host page memory), "+
			"this process can use %d more", ErrInvalidConfig, pages, need, meta, host, avail)
	}
	return nil
}

func satMul(a, b int64) int64 {
	if b != 0 && a > math.MaxInt64/b {
		return math.MaxInt64
	}
	return a * b
}

func satAdd(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// setupDevice returns the device to use, allocating or adopting regions
// if needed, and whether the pool owns it.
func (c *Config) setupDevice(v validated) (dev cudaops.Device, owned bool, err error) {
	lay := v.lay
	dev = c.Device
	if dev == nil {
		dev, owned = cudaops.NewHost(), true
	}
	fail := func(err error) (cudaops.Device, bool, error) {
		if owned {
			dev.Close()
		}
		return nil, false, err
	}
	groupPages := func(ri int) int {
		for i, g := range lay.groups {
			if ri >= g.first && ri < g.first+g.count {
				return v.pages[i]
			}
		}
		panic(fmt.Sprintf("kvcache: region %d in no group", ri))
	}
	regions := dev.Regions()
	if len(regions) == 0 {
		if err := checkAdoption(lay, groupPages); err != nil {
			return fail(err)
		}
		for ri, r := range lay.regions {
			if _, err := addRegion(dev, r, groupPages(ri)); err != nil {
				return fail(fmt.Errorf("%w: region %d (%q) of %d pages × %d bytes on %s: %w",
					ErrInvalidConfig, ri, r.Name, groupPages(ri), r.PageBytes, dev.Name(), err))
			}
		}
		return dev, owned, nil
	}
	if lay.adopted {
		return fail(fmt.Errorf("%w: the cache spec adopts engine memory, but the device already has %d regions", ErrInvalidConfig, len(regions)))
	}
	if len(regions) != len(lay.regions) {
		return fail(fmt.Errorf("%w: device has %d regions, the cache spec has %d", ErrInvalidConfig, len(regions), len(lay.regions)))
	}
	for i, r := range regions {
		want := lay.regions[i]
		if r.PageBytes != want.PageBytes || r.Pages < groupPages(i) {
			return fail(fmt.Errorf("%w: device region %d has %d pages of %d bytes, region %q needs %d pages of %d",
				ErrInvalidConfig, i, r.Pages, r.PageBytes, want.Name, groupPages(i), want.PageBytes))
		}
	}
	return dev, owned, nil
}

// checkAdoption refuses, before any region is added to the device, adopted
// memory that is too small for its group or whose pages share bytes with
// another region's: an engine's tensors described with a wrong shape.
func checkAdoption(lay *layout, groupPages func(region int) int) error {
	if !lay.adopted {
		return nil
	}
	described := make([]cudaops.Region, len(lay.regions))
	for ri, r := range lay.regions {
		m := r.Memory
		stride, pages := m.Stride, m.Pages
		if stride == 0 {
			stride = r.PageBytes
		}
		if pages == 0 {
			pages = groupPages(ri)
		}
		if pages < groupPages(ri) {
			return fmt.Errorf("%w: region %d (%q): adopted memory holds %d pages, its group has %d", ErrInvalidConfig, ri, r.Name, pages, groupPages(ri))
		}
		d := cudaops.Region{Base: m.Base, Stride: stride, PageBytes: r.PageBytes, Pages: pages}
		if m.Host != nil {
			d = cudaops.HostRegion(m.Host, pages, stride, r.PageBytes)
			if int64(len(m.Host)) < d.Bytes() {
				return fmt.Errorf("%w: region %d (%q): adopted host buffer of %d bytes, %d pages of stride %d need %d",
					ErrInvalidConfig, ri, r.Name, len(m.Host), pages, stride, d.Bytes())
			}
		}
		if err := d.Validate(); err != nil {
			return fmt.Errorf("%w: region %d (%q): %w", ErrInvalidConfig, ri, r.Name, err)
		}
		for oi, o := range described[:ri] {
			if cudaops.Overlap(o, d) {
				return fmt.Errorf("%w: adopted region %d (%q) shares bytes with region %d (%q): the engine's tensors overlap as described",
					ErrInvalidConfig, ri, r.Name, oi, lay.regions[oi].Name)
			}
		}
		described[ri] = d
	}
	return nil
}

// addRegion allocates region r on dev for pages pages, or adopts the
// engine memory it names.
func addRegion(dev cudaops.Device, r CacheRegion, pages int) (int, error) {
	m := r.Memory
	if m == nil {
		return dev.AllocRegion(pages, r.PageBytes)
	}
	stride := m.Stride
	if stride == 0 {
		stride = r.PageBytes
	}
	have := m.Pages
	if have == 0 {
		have = pages
	}
	if have < pages {
		return 0, fmt.Errorf("%w: adopted memory holds %d pages, the group has %d", cudaops.ErrInvalidArgument, have, pages)
	}
	switch d := dev.(type) {
	case interface {
		AdoptRegion(mem []byte, pages int, stride, pageBytes int64) (int, error)
	}:
		if m.Host == nil {
			return 0, fmt.Errorf("%w: a host device adopts host memory (RegionMemory.Host), not the address %#x", cudaops.ErrInvalidArgument, m.Base)
		}
		return d.AdoptRegion(m.Host, have, stride, r.PageBytes)
	case interface {
		AdoptRegion(base uint64, pages int, stride, pageBytes int64) (int, error)
	}:
		if m.Base == 0 {
			return 0, fmt.Errorf("%w: %s adopts device memory (RegionMemory.Base), not a host buffer", cudaops.ErrInvalidArgument, dev.Name())
		}
		return d.AdoptRegion(m.Base, have, stride, r.PageBytes)
	}
	return 0, fmt.Errorf("%w: %s cannot adopt engine memory", cudaops.ErrInvalidArgument, dev.Name())
}
