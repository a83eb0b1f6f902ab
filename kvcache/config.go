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
	Geometry Geometry
	// Pages is the pool size in pages. Alternatively PoolBytes gives the
	// memory over all regions and the pages are derived; set exactly one.
	Pages     int
	PoolBytes int64
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
	// events.
	Prefix PrefixConfig
	// Device holds the pages. Nil means a new Host device owned (and
	// closed) by the pool. A device with no regions gets 2×Layers regions
	// allocated by the pool; a device that already has regions (adopted
	// engine memory) must have exactly 2×Layers, each of the geometry's
	// page size and at least Pages pages. A caller-supplied device is not
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

// pages derives and validates the pool size.
func (c *Config) pages() (int, error) {
	switch {
	case c.Pages != 0 && c.PoolBytes != 0:
		return 0, fmt.Errorf("%w: set Pages (%d) or PoolBytes (%d), not both", ErrInvalidConfig, c.Pages, c.PoolBytes)
	case c.Pages < 0 || c.PoolBytes < 0:
		return 0, fmt.Errorf("%w: negative pool size (Pages %d, PoolBytes %d)", ErrInvalidConfig, c.Pages, c.PoolBytes)
	case c.Pages == 0 && c.PoolBytes == 0:
		return 0, fmt.Errorf("%w: pool size missing: set Pages or PoolBytes", ErrInvalidConfig)
	}
	n := int64(c.Pages)
	if c.PoolBytes != 0 {
		n = c.PoolBytes / c.Geometry.PageBytes()
		if n == 0 {
			return 0, fmt.Errorf("%w: PoolBytes %d holds no page of %d bytes", ErrInvalidConfig, c.PoolBytes, c.Geometry.PageBytes())
		}
	}
	if n > allocator.MaxPages {
		return 0, fmt.Errorf("%w: %d pages, more than the %d a block table can address", ErrInvalidConfig, n, allocator.MaxPages)
	}
	return int(n), nil
}

// validate checks everything but the device and returns the page count.
func (c *Config) validate() (int, error) {
	if err := c.Geometry.Validate(); err != nil {
		return 0, err
	}
	pages, err := c.pages()
	if err != nil {
		return 0, err
	}
	if err := c.Prefix.validate(); err != nil {
		return 0, err
	}
	if _, err := c.Scrub.FillSpec(c.Geometry.DType); err != nil {
		return 0, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if c.MaxContextTokens <= 0 {
		return 0, fmt.Errorf("%w: MaxContextTokens = %d, want the engine's context window (> 0)", ErrInvalidConfig, c.MaxContextTokens)
	}
	capTokens := int64(pages) * int64(c.Geometry.TokensPerPage)
	if int64(c.MaxContextTokens) > capTokens && !c.AllowUndersizedPool {
		return 0, fmt.Errorf("%w: pool holds %d tokens (%d pages of %d), max context is %d tokens; "+
			"enlarge the pool, lower MaxContextTokens, or set AllowUndersizedPool to refuse longer requests at admission",
			ErrUndersizedPool, capTokens, pages, c.Geometry.TokensPerPage, c.MaxContextTokens)
	}
	if err := c.checkHostMemory(pages); err != nil {
		return 0, err
	}
	return pages, nil
}

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
func (c *Config) checkHostMemory(pages int) error {
	avail, ok := availableMemory()
	if !ok {
		return nil // cannot tell (not Linux): the allocations will say
	}
	meta := int64(pages) * metadataBytesPerPage
	var host int64
	if c.Device == nil {
		// Saturating: a page can span 2^43 bytes, pages × that overflows.
		if pb := c.Geometry.PageBytes(); int64(pages) > (math.MaxInt64-meta)/pb {
			host = math.MaxInt64 - meta
		} else {
			host = int64(pages) * pb
		}
	}
	if need := meta + host; need > avail {
		return fmt.Errorf("%w: a pool of %d pages needs %d bytes of host memory (%d for page metadata, %d for host page memory), "+
			"this process can use %d more", ErrInvalidConfig, pages, need, meta, host, avail)
	}
	return nil
}

// setupDevice returns the device to use, allocating regions if needed, and
// whether the pool owns it.
func (c *Config) setupDevice(pages int) (dev cudaops.Device, owned bool, err error) {
	g := c.Geometry
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
	regions := dev.Regions()
	if len(regions) == 0 {
		for range g.Regions() {
			if _, err := dev.AllocRegion(pages, g.RegionPageBytes()); err != nil {
				return fail(fmt.Errorf("%w: allocating %d regions of %d pages × %d bytes on %s: %w",
					ErrInvalidConfig, g.Regions(), pages, g.RegionPageBytes(), dev.Name(), err))
			}
		}
		return dev, owned, nil
	}
	if len(regions) != g.Regions() {
		return fail(fmt.Errorf("%w: device has %d regions, geometry needs %d (K and V for %d layers)",
			ErrInvalidConfig, len(regions), g.Regions(), g.Layers))
	}
	for i, r := range regions {
		if r.PageBytes != g.RegionPageBytes() || r.Pages < pages {
			return fail(fmt.Errorf("%w: device region %d has %d pages of %d bytes, pool needs %d pages of %d",
				ErrInvalidConfig, i, r.Pages, r.PageBytes, pages, g.RegionPageBytes()))
		}
	}
	return dev, owned, nil
}
