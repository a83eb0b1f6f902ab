package bridge

import (
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

// CacheSpecJSON is kvcache.CacheSpec: the pool config's "cache" object,
// which describes any model's caches as groups of regions (instead of
// "geometry"). Kinds and dtypes are names; a region's "memory" adopts
// engine-owned memory.
type CacheSpecJSON struct {
	Model  string           `json:"model,omitempty"`
	Groups []CacheGroupJSON `json:"groups"`
	// Shard (since ABI 9): the tensor-parallel shard the regions hold;
	// omitted, the whole model (kvcache.CacheSpec.Shard).
	Shard *ShardJSON `json:"shard,omitempty"`
}

// ShardJSON is kvcache.Shard: rank Rank of Size. Both are required: a
// shard whose rank or size was left out (rank 0 by default, or size 0,
// the unsharded spec) would be another shard's pool than the operator
// meant, which a handoff refuses only once KV is on the way.
type ShardJSON struct {
	Rank *int `json:"rank"`
	Size *int `json:"size"`
}

// shard checks the fields JSON can get wrong; kvcache.New checks the
// size's upper bound.
func (j *ShardJSON) shard() (kvcache.Shard, error) {
	bad := func(format string, args ...any) (kvcache.Shard, error) {
		return kvcache.Shard{}, fmt.Errorf("%w: cache.shard: "+format, append([]any{kvcache.ErrInvalidConfig}, args...)...)
	}
	switch {
	case j.Size == nil:
		return bad("size missing (the tensor-parallel degree; omit shard for the whole model)")
	case j.Rank == nil:
		return bad("rank missing (0 to size - 1)")
	case *j.Size < 1:
		return bad("size %d, want 1 or more ranks (omit shard for the whole model)", *j.Size)
	case *j.Rank < 0 || *j.Rank >= *j.Size:
		return bad("rank %d of size %d, want 0 to %d", *j.Rank, *j.Size, *j.Size-1)
	}
	return kvcache.Shard{Rank: *j.Rank, Size: *j.Size}, nil
}

// CacheGroupJSON is kvcache.CacheGroup; kind is "per_token",
// "sliding_window" or "state".
type CacheGroupJSON struct {
	Name          string            `json:"name"`
	Kind          string            `json:"kind"`
	TokensPerPage int               `json:"tokens_per_page,omitempty"`
	WindowTokens  int               `json:"window_tokens,omitempty"`
	Regions       []CacheRegionJSON `json:"regions"`
}

// CacheRegionJSON is kvcache.CacheRegion.
type CacheRegionJSON struct {
	Name      string            `json:"name"`
	DType     string            `json:"dtype"`
	AlsoHolds []string          `json:"also_holds,omitempty"`
	PageBytes int64             `json:"page_bytes"`
	Memory    *RegionMemoryJSON `json:"memory,omitempty"`
}

// RegionMemoryJSON is engine-owned memory for a region: page p at base +
// p × stride. On a CUDA pool base is a device address (a CUdeviceptr, what
// torch's data_ptr() returns for a CUDA tensor); on a host pool the
// address of host memory the engine keeps alive until kvf_pool_destroy,
// bytes long (its size must be given: kvfence never reads past it).
type RegionMemoryJSON struct {
	Base   Address `json:"base"`
	Stride int64   `json:"stride,omitempty"`
	Pages  int     `json:"pages,omitempty"`
	Bytes  int64   `json:"bytes,omitempty"`
}

// Address is a 64-bit address written as a JSON number or a string in any
// Go integer syntax ("0x7f0012340000"): JSON numbers above 2^53 lose
// precision in many encoders, so engines should send strings.
type Address uint64

// UnmarshalJSON accepts 4096, "4096", "0x1000".
func (a *Address) UnmarshalJSON(b []byte) error {
	s := string(b)
	if len(b) > 0 && b[0] == '"' {
		if err := json.Unmarshal(b, &s); err != nil {
			return fmt.Errorf("%w: address %s: %w", kvcache.ErrInvalidConfig, b, err)
		}
	}
	v, err := strconv.ParseUint(s, 0, 64)
	if err != nil {
		return fmt.Errorf("%w: address %s is not a 64-bit unsigned integer", kvcache.ErrInvalidConfig, b)
	}
	*a = Address(v)
	return nil
}

// HostMemory turns a host address and length from the C ABI into the Go
// slice a host pool adopts. The C ABI sets it (its cgo file holds the one
// conversion); without it a host pool cannot adopt memory.
var HostMemory func(base uint64, n int64) []byte

// spec converts the JSON to a kvcache.CacheSpec for a pool on a device of
// kind deviceKind. It checks names (kinds, dtypes) and what only JSON can
// get wrong; kvcache.New checks the rest.
func (c *CacheSpecJSON) spec(deviceKind string) (kvcache.CacheSpec, error) {
	s := kvcache.CacheSpec{Model: c.Model}
	if c.Shard != nil {
		var err error
		if s.Shard, err = c.Shard.shard(); err != nil {
			return kvcache.CacheSpec{}, err
		}
	}
	for gi, gj := range c.Groups {
		kind, err := kvcache.ParseGroupKind(gj.Kind)
		if err != nil {
			return kvcache.CacheSpec{}, fmt.Errorf("cache.groups[%d].kind: %w", gi, err)
		}
		g := kvcache.CacheGroup{Name: gj.Name, Kind: kind, TokensPerPage: gj.TokensPerPage, WindowTokens: gj.WindowTokens}
		for ri, rj := range gj.Regions {
			where := fmt.Sprintf("cache.groups[%d].regions[%d]", gi, ri)
			if rj.DType == "" {
				return kvcache.CacheSpec{}, fmt.Errorf("%w: %s.dtype missing", kvcache.ErrInvalidConfig, where)
			}
			d, err := isolation.ParseDType(rj.DType)
			if err != nil {
				return kvcache.CacheSpec{}, fmt.Errorf("%w: %s.dtype: %w", kvcache.ErrInvalidConfig, where, err)
			}
			r := kvcache.CacheRegion{Name: rj.Name, DType: d, PageBytes: rj.PageBytes}
			for ai, a := range rj.AlsoHolds {
				o, err := isolation.ParseDType(a)
				if err != nil {
					return kvcache.CacheSpec{}, fmt.Errorf("%w: %s.also_holds[%d]: %w", kvcache.ErrInvalidConfig, where, ai, err)
				}
				r.AlsoHolds = append(r.AlsoHolds, o)
			}
			if m := rj.Memory; m != nil {
				if r.Memory, err = m.memory(deviceKind, where); err != nil {
					return kvcache.CacheSpec{}, err
				}
			}
			g.Regions = append(g.Regions, r)
		}
		s.Groups = append(s.Groups, g)
	}
	return s, nil
}

func (m *RegionMemoryJSON) memory(deviceKind, where string) (*kvcache.RegionMemory, error) {
	rm := &kvcache.RegionMemory{Stride: m.Stride, Pages: m.Pages}
	switch {
	case m.Base == 0:
		return nil, fmt.Errorf("%w: %s.memory.base is 0", kvcache.ErrInvalidConfig, where)
	case m.Bytes < 0:
		return nil, fmt.Errorf("%w: %s.memory.bytes = %d", kvcache.ErrInvalidConfig, where, m.Bytes)
	case deviceKind != DeviceHost:
		rm.Base = uint64(m.Base)
		return rm, nil
	case m.Bytes == 0:
		return nil, fmt.Errorf("%w: %s.memory.bytes missing: a host pool adopts only memory whose size it is told", kvcache.ErrInvalidConfig, where)
	case HostMemory == nil:
		return nil, fmt.Errorf("%w: %s.memory: host memory is adopted only through the C ABI", kvcache.ErrInvalidConfig, where)
	case uint64(m.Base) > ^uint64(0)-uint64(m.Bytes):
		return nil, fmt.Errorf("%w: %s.memory of %d bytes at %#x wraps the address space", kvcache.ErrInvalidConfig, where, m.Bytes, uint64(m.Base))
	}
	rm.Host = HostMemory(uint64(m.Base), m.Bytes)
	return rm, nil
}
