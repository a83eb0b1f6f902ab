package bridge

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"

	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

// ConfigJSON is the JSON form of kvcache.Config that kvf_pool_create
// takes. Field for field it is the Go Config; the dtype and scrub kind are
// names, and the scrub pattern is a number or a string in any Go integer
// syntax ("0x8000"). Unknown fields are an error. Device selects where
// the pages live: host memory (the default) or a CUDA device's memory,
// allocated by the pool; the bridge owns the device and closes it after
// the pool.
type ConfigJSON struct {
	Geometry            GeometryJSON   `json:"geometry,omitzero"`
	Cache               *CacheSpecJSON `json:"cache,omitempty"`  // instead of geometry
	Preset              string         `json:"preset,omitempty"` // instead of geometry and cache: kvcache.Preset
	MaxLeases           int            `json:"max_leases,omitempty"`
	Pages               int            `json:"pages,omitempty"`
	PoolBytes           int64          `json:"pool_bytes,omitempty"`
	MaxContextTokens    int            `json:"max_context_tokens"`
	AllowUndersizedPool bool           `json:"allow_undersized_pool,omitempty"`
	Tenants             []TenantJSON   `json:"tenants,omitempty"`
	Scrub               ScrubJSON      `json:"scrub,omitzero"`
	Prefix              PrefixJSON     `json:"prefix,omitzero"`
	Device              DeviceJSON     `json:"device,omitzero"`
	Sizing              SizingJSON     `json:"sizing,omitzero"`
	GrowthWatermark     float64        `json:"growth_watermark,omitempty"`
	HostTier            HostTierJSON   `json:"host_tier,omitzero"` // since ABI 12
}

// HostTierJSON is kvcache.HostTierConfig: the host tier's size in pages
// or bytes (omitted: none), the state checkpoints it holds in a pool with
// window or state groups (since ABI 13; required there), and whether
// preemption swaps to it.
type HostTierJSON struct {
	Pages       int   `json:"pages,omitempty"`
	Bytes       int64 `json:"bytes,omitempty"`
	Checkpoints int   `json:"checkpoints,omitempty"`
	NoSwap      bool  `json:"no_swap,omitempty"`
}

// SizingJSON is kvcache.Sizing with the mode by name: "full",
// "on_demand", or omitted to inherit (a pool's default is full).
type SizingJSON struct {
	Mode           string `json:"mode,omitempty"`
	HeadroomTokens int    `json:"headroom_tokens,omitempty"`
}

// sizing parses the mode; a bad name wraps isolation.ErrInvalidSizing.
func (s SizingJSON) sizing() (kvcache.Sizing, error) {
	m, err := isolation.ParseSizingMode(s.Mode)
	return kvcache.Sizing{Mode: m, HeadroomTokens: s.HeadroomTokens}, err
}

// PrefixJSON is kvcache.PrefixConfig. MaxCheckpoints and
// CheckpointSlots (since ABI 10) bound and size the state checkpoints of
// a pool with window or state groups.
type PrefixJSON struct {
	Disable         bool `json:"disable,omitempty"`
	EventBuffer     int  `json:"event_buffer,omitempty"`
	MaxCheckpoints  int  `json:"max_checkpoints,omitempty"`
	CheckpointSlots int  `json:"checkpoint_slots,omitempty"`
}

// config is the Go PrefixConfig; kvcache.New validates it (its errors
// name the field).
func (j PrefixJSON) config() kvcache.PrefixConfig {
	return kvcache.PrefixConfig{Disable: j.Disable, EventBuffer: j.EventBuffer,
		MaxCheckpoints: j.MaxCheckpoints, CheckpointSlots: j.CheckpointSlots}
}

// DeviceJSON selects the device: kind "host" (or empty), "cuda" with the
// driver's device ordinal, or (a pool's only, since ABI 5) "remote": the
// ranks of a tensor-parallel group, one worker process each
// (cudaops.RemoteRanks), which connect to Listen and serve their shards
// (CreateRankWorker).
type DeviceJSON struct {
	Kind    string `json:"kind,omitempty"`
	Ordinal int    `json:"ordinal,omitempty"`
	// AsyncFills (host only, since ABI 7) scrubs released pages on a
	// goroutine of the library's, as a GPU scrubs them on its stream: a
	// release returns before the memset, and the pages stay quarantined
	// until it ends (cudaops.HostConfig.AsyncFills).
	AsyncFills bool `json:"async_fills,omitempty"`
	// Remote: the address the ranks connect to ("unix:PATH" or
	// "tcp:HOST:PORT"), how many must, how long a fill waits for a rank's
	// report before the rank is lost (0: 30 s), and how long the pool's
	// creation waits for every rank to connect (0: 60 s).
	Listen          string `json:"listen,omitempty"`
	Ranks           int    `json:"ranks,omitempty"`
	ReportTimeoutMS int64  `json:"report_timeout_ms,omitempty"`
	AcceptTimeoutMS int64  `json:"accept_timeout_ms,omitempty"`
}

// Device kinds.
const (
	DeviceHost   = "host"
	DeviceCUDA   = "cuda"
	DeviceRemote = "remote"
)

// maxRanks bounds a remote group: far beyond any tensor-parallel degree,
// and small enough that a typo is not a minute-long accept loop.
const maxRanks = 4096

// remoteFields reports whether any field of a remote group is set.
func (d DeviceJSON) remoteFields() bool {
	return d.Listen != "" || d.Ranks != 0 || d.ReportTimeoutMS != 0 || d.AcceptTimeoutMS != 0
}

// checkLocal checks a host or CUDA device selection (a pool's or a rank
// worker's) and normalises an empty kind to host.
func (d DeviceJSON) checkLocal() (DeviceJSON, error) {
	if d.remoteFields() {
		return DeviceJSON{}, fmt.Errorf("%w: device.listen, .ranks, .report_timeout_ms and .accept_timeout_ms are for kind %q",
			kvcache.ErrInvalidConfig, DeviceRemote)
	}
	switch d.Kind {
	case "", DeviceHost:
		if d.Ordinal != 0 {
			return DeviceJSON{}, fmt.Errorf("%w: device.ordinal %d for a host device", kvcache.ErrInvalidConfig, d.Ordinal)
		}
		d.Kind = DeviceHost
	case DeviceCUDA:
		if d.Ordinal < 0 {
			return DeviceJSON{}, fmt.Errorf("%w: device.ordinal %d", kvcache.ErrInvalidConfig, d.Ordinal)
		}
		if d.AsyncFills {
			return DeviceJSON{}, fmt.Errorf("%w: device.async_fills is for kind %q (a CUDA device's fills are asynchronous already)", kvcache.ErrInvalidConfig, DeviceHost)
		}
	default:
		return DeviceJSON{}, fmt.Errorf("%w: device.kind %q, want %q or %q", kvcache.ErrInvalidConfig, d.Kind, DeviceHost, DeviceCUDA)
	}
	return d, nil
}

// checkRemote checks a remote group's fields.
func (d DeviceJSON) checkRemote() error {
	fail := func(format string, args ...any) error {
		return fmt.Errorf("%w: device: "+format, append([]any{kvcache.ErrInvalidConfig}, args...)...)
	}
	if _, _, err := parseAddress("device.listen", d.Listen); err != nil {
		return err
	}
	switch {
	case d.Ordinal != 0:
		return fail("ordinal %d for a remote group (each rank names its own device)", d.Ordinal)
	case d.AsyncFills:
		return fail("async_fills for a remote group (each rank names its own device)")
	case d.Ranks <= 0 || d.Ranks > maxRanks:
		return fail("ranks %d, want 1 to %d", d.Ranks, maxRanks)
	case d.ReportTimeoutMS < 0:
		return fail("report_timeout_ms %d", d.ReportTimeoutMS)
	case d.AcceptTimeoutMS < 0:
		return fail("accept_timeout_ms %d", d.AcceptTimeoutMS)
	}
	return nil
}

// GeometryJSON is kvcache.Geometry with the dtype by name
// (isolation.ParseDType: fp8_e4m3, fp8_e5m2, fp16, bf16, fp32 and aliases).
type GeometryJSON struct {
	TokensPerPage int    `json:"tokens_per_page"`
	Layers        int    `json:"layers"`
	KVHeads       int    `json:"kv_heads"`
	HeadDim       int    `json:"head_dim"`
	DType         string `json:"dtype"`
}

// TenantJSON is kvcache.TenantConfig.
type TenantJSON struct {
	Name          string     `json:"name"`
	QuotaPages    int        `json:"quota_pages,omitempty"`
	ReservedPages int        `json:"reserved_pages,omitempty"`
	Domain        string     `json:"domain,omitempty"` // sharing domain; empty: the tenant's own
	Sizing        SizingJSON `json:"sizing,omitzero"`  // omitted: the pool's
	// MaxCheckpoints (since ABI 10) bounds the tenant's state checkpoints;
	// 0 (omitted): the pool's bound.
	MaxCheckpoints int `json:"max_checkpoints,omitempty"`
	// TierPages (since ABI 12) is the tenant's share of the host tier.
	TierPages int `json:"tier_pages,omitempty"`
}

// ScrubJSON is kvcache.ScrubPolicy; an empty kind means zero.
type ScrubJSON struct {
	Kind    string  `json:"kind,omitempty"`
	Pattern Pattern `json:"pattern,omitempty"`
}

// Pattern is a 32-bit scrub pattern written as a JSON number or string.
type Pattern uint32

// UnmarshalJSON accepts 32768, "32768", "0x8000". Its errors wrap
// kvcache.ErrInvalidConfig, as every error of a config does.
func (p *Pattern) UnmarshalJSON(b []byte) error {
	s := string(b)
	if len(b) > 0 && b[0] == '"' {
		if err := json.Unmarshal(b, &s); err != nil {
			return fmt.Errorf("%w: scrub.pattern %s: %w", kvcache.ErrInvalidConfig, b, err)
		}
	}
	v, err := strconv.ParseUint(s, 0, 32)
	if err != nil {
		return fmt.Errorf("%w: scrub.pattern %s is not a 32-bit unsigned integer", kvcache.ErrInvalidConfig, b)
	}
	*p = Pattern(v)
	return nil
}

// MaxJSONBytes bounds every JSON document a caller may hand over (pool,
// tenant and receiver configs). The C layer scans strings up to the same
// length, so that what it refuses as too long is what this package would.
const MaxJSONBytes = 1 << 20

// ParseConfig decodes a ConfigJSON into a kvcache.Config. It checks only
// what JSON can get wrong (syntax, unknown fields, names of dtypes and
// scrub kinds); everything else is left to kvcache.New, so C callers get
// exactly the Go validation and errors. Every error wraps
// kvcache.ErrInvalidConfig.
func ParseConfig(data []byte) (kvcache.Config, error) {
	cfg, _, err := parseConfig(data)
	return cfg, err
}

// parseConfig is ParseConfig that also returns the device selection, with
// its kind checked and normalised.
func parseConfig(data []byte) (kvcache.Config, DeviceJSON, error) {
	cfg, dev, err := parseConfigDoc(data)
	if err != nil {
		return kvcache.Config{}, DeviceJSON{}, err
	}
	switch dev.Kind {
	case DeviceRemote:
		err = dev.checkRemote()
	case "", DeviceHost, DeviceCUDA:
		dev, err = dev.checkLocal()
	default:
		err = fmt.Errorf("%w: device.kind %q, want %q, %q or %q", kvcache.ErrInvalidConfig, dev.Kind, DeviceHost, DeviceCUDA, DeviceRemote)
	}
	if err != nil {
		return kvcache.Config{}, DeviceJSON{}, err
	}
	return cfg, dev, nil
}

func parseConfigDoc(data []byte) (kvcache.Config, DeviceJSON, error) {
	fail := func(format string, args ...any) (kvcache.Config, DeviceJSON, error) {
		return kvcache.Config{}, DeviceJSON{}, fmt.Errorf("%w: "+format, append([]any{kvcache.ErrInvalidConfig}, args...)...)
	}
	if len(data) > MaxJSONBytes {
		return fail("config JSON of %d bytes, limit %d", len(data), MaxJSONBytes)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var cj ConfigJSON
	if err := dec.Decode(&cj); err != nil {
		if errors.Is(err, kvcache.ErrInvalidConfig) { // a field's own error (Pattern), already saying what
			return kvcache.Config{}, DeviceJSON{}, err
		}
		return fail("config JSON: %v", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return fail("config JSON: trailing data after the object")
	}
	if cj.Preset != "" && (cj.Cache != nil || cj.Geometry != (GeometryJSON{})) {
		return fail("preset %q and a geometry or cache: give one", cj.Preset)
	}
	var geom kvcache.Geometry
	if (cj.Cache == nil && cj.Preset == "") || cj.Geometry != (GeometryJSON{}) {
		if cj.Geometry.DType == "" {
			return fail("geometry.dtype missing (give geometry, cache or preset)")
		}
		dtype, err := isolation.ParseDType(cj.Geometry.DType)
		if err != nil {
			return fail("geometry.dtype: %w", err)
		}
		geom = kvcache.Geometry{TokensPerPage: cj.Geometry.TokensPerPage, Layers: cj.Geometry.Layers,
			KVHeads: cj.Geometry.KVHeads, HeadDim: cj.Geometry.HeadDim, DType: dtype}
	}
	var spec kvcache.CacheSpec
	if cj.Cache != nil && cj.Device.Kind == DeviceRemote {
		// The ranks' hellos describe regions of a geometry's shape, and
		// the protocol carries page batches, not a spec's spans.
		return fail("cache over a remote group: a pool over remote ranks takes a geometry")
	}
	if cj.Cache != nil {
		kind := cj.Device.Kind
		if kind == "" {
			kind = DeviceHost
		}
		var err error
		if spec, err = cj.Cache.spec(kind); err != nil {
			return kvcache.Config{}, DeviceJSON{}, err
		}
		if spec.IsZero() {
			return fail("cache has no groups")
		}
	}
	if cj.Preset != "" {
		var err error
		if spec, err = kvcache.Preset(cj.Preset); err != nil {
			return kvcache.Config{}, DeviceJSON{}, err
		}
	}
	var err error
	kind := kvcache.ScrubZero
	if cj.Scrub.Kind != "" {
		if kind, err = isolation.ParseScrubKind(cj.Scrub.Kind); err != nil {
			return fail("scrub.kind: %w", err)
		}
	}
	cfg := kvcache.Config{
		Geometry:            geom,
		Cache:               spec,
		MaxLeases:           cj.MaxLeases,
		Pages:               cj.Pages,
		PoolBytes:           cj.PoolBytes,
		MaxContextTokens:    cj.MaxContextTokens,
		AllowUndersizedPool: cj.AllowUndersizedPool,
		Scrub:               kvcache.ScrubPolicy{Kind: kind, Pattern: uint32(cj.Scrub.Pattern)},
		Prefix:              cj.Prefix.config(),
		HostTier: kvcache.HostTierConfig{Pages: cj.HostTier.Pages, Bytes: cj.HostTier.Bytes,
			Checkpoints: cj.HostTier.Checkpoints, NoSwap: cj.HostTier.NoSwap},
		GrowthWatermark: cj.GrowthWatermark,
	}
	if cfg.Sizing, err = cj.Sizing.sizing(); err != nil {
		return fail("sizing: %w", err)
	}
	for i, t := range cj.Tenants {
		tc, err := t.config()
		if err != nil {
			return fail("tenants[%d]: %w", i, err)
		}
		cfg.Tenants = append(cfg.Tenants, tc)
	}
	return cfg, cj.Device, nil
}

func (t TenantJSON) config() (kvcache.TenantConfig, error) {
	sizing, err := t.Sizing.sizing()
	return kvcache.TenantConfig{Name: t.Name, QuotaPages: t.QuotaPages, ReservedPages: t.ReservedPages, Domain: t.Domain,
		Sizing: sizing, MaxCheckpoints: t.MaxCheckpoints, TierPages: t.TierPages}, err
}

// ParseTenant decodes one tenant object, as in the config's "tenants"
// list. Errors wrap isolation.ErrInvalidTenant.
func ParseTenant(data []byte) (kvcache.TenantConfig, error) {
	if len(data) > MaxJSONBytes {
		return kvcache.TenantConfig{}, fmt.Errorf("%w: tenant JSON of %d bytes, limit %d", isolation.ErrInvalidTenant, len(data), MaxJSONBytes)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var tj TenantJSON
	if err := dec.Decode(&tj); err != nil {
		return kvcache.TenantConfig{}, fmt.Errorf("%w: tenant JSON: %v", isolation.ErrInvalidTenant, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return kvcache.TenantConfig{}, fmt.Errorf("%w: tenant JSON: trailing data after the object", isolation.ErrInvalidTenant)
	}
	tc, err := tj.config()
	if err != nil {
		return kvcache.TenantConfig{}, fmt.Errorf("%w: tenant JSON: %w", isolation.ErrInvalidTenant, err)
	}
	return tc, nil
}
