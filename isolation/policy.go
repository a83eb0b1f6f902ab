package isolation

import (
	"fmt"
	"strings"

	"github.com/kvfence/kvfence/cudaops"
)

// DType is the element type of the KV cache. It decides which fill
// patterns are finite numbers.
type DType uint8

const (
	DTypeInvalid DType = iota
	FP8E4M3
	FP8E5M2
	FP16
	BF16
	FP32
)

var dtypeNames = [...]string{"invalid", "fp8_e4m3", "fp8_e5m2", "fp16", "bf16", "fp32"}

func (d DType) String() string {
	if int(d) < len(dtypeNames) {
		return dtypeNames[d]
	}
	return fmt.Sprintf("DType(%d)", uint8(d))
}

// ParseDType accepts the names String returns (case-insensitive), plus
// "float16", "bfloat16", "float32", "fp8" (= fp8_e4m3).
func ParseDType(s string) (DType, error) {
	switch strings.ToLower(s) {
	case "fp8", "fp8_e4m3", "e4m3":
		return FP8E4M3, nil
	case "fp8_e5m2", "e5m2":
		return FP8E5M2, nil
	case "fp16", "float16", "half":
		return FP16, nil
	case "bf16", "bfloat16":
		return BF16, nil
	case "fp32", "float32", "float":
		return FP32, nil
	}
	return DTypeInvalid, fmt.Errorf("%w: unknown dtype %q", ErrInvalidPolicy, s)
}

// Size is the element size in bytes, 0 for an invalid dtype.
func (d DType) Size() int {
	switch d {
	case FP8E4M3, FP8E5M2:
		return 1
	case FP16, BF16:
		return 2
	case FP32:
		return 4
	}
	return 0
}

// Valid reports whether d is a known dtype.
func (d DType) Valid() bool { return d.Size() != 0 }

// NegativeZero is the dtype's -0: the default poison. It is numerically
// harmless and bit-distinct from written zeros.
func (d DType) NegativeZero() uint32 {
	return 1 << (8*d.Size() - 1)
}

// IsFinite reports whether the element bit pattern bits is a finite number
// in d. Bits above the element width must be zero.
func (d DType) IsFinite(bits uint32) bool {
	switch d {
	case FP8E4M3: // no infinities; S.1111.111 is NaN
		return bits&0x7f != 0x7f
	case FP8E5M2:
		return bits&0x7c != 0x7c
	case FP16:
		return bits&0x7c00 != 0x7c00
	case BF16:
		return bits&0x7f80 != 0x7f80
	case FP32:
		return bits&0x7f800000 != 0x7f800000
	}
	return false
}

// replicate repeats an element bit pattern over a 32-bit word.
func (d DType) replicate(bits uint32) uint32 {
	switch d.Size() {
	case 1:
		return bits * 0x01010101
	case 2:
		return bits | bits<<16
	}
	return bits
}

// finiteMask has the top exponent bit of every element in a word set.
// Clearing it keeps any bit pattern a finite number, which canary words
// need: their bits are derived from the page ID.
func (d DType) finiteMask() uint32 {
	switch d.Size() {
	case 1:
		return 0x40404040
	case 2:
		return 0x40004000
	}
	return 0x40000000
}

// ScrubKind selects what freed pages are filled with.
type ScrubKind uint8

const (
	// ScrubZero fills freed pages with zero bytes. The default.
	ScrubZero ScrubKind = iota
	// ScrubPoison fills freed pages with a finite per-element pattern
	// (default: the dtype's negative zero).
	ScrubPoison
	// ScrubCanary fills each freed page with a page-specific finite pattern
	// and verifies it when the page is next handed out: a mismatch means
	// something wrote to a freed page. For debugging and audits; it reads
	// every page back on allocation.
	ScrubCanary
)

func (k ScrubKind) String() string {
	switch k {
	case ScrubZero:
		return "zero"
	case ScrubPoison:
		return "poison"
	case ScrubCanary:
		return "canary"
	}
	return fmt.Sprintf("ScrubKind(%d)", uint8(k))
}

// ParseScrubKind accepts the names String returns.
func ParseScrubKind(s string) (ScrubKind, error) {
	for k := ScrubZero; k <= ScrubCanary; k++ {
		if strings.EqualFold(s, k.String()) {
			return k, nil
		}
	}
	return 0, fmt.Errorf("%w: unknown scrub kind %q (want zero, poison or canary)", ErrInvalidPolicy, s)
}

// ScrubPolicy says how freed pages are cleaned.
type ScrubPolicy struct {
	Kind ScrubKind
	// Pattern is the element bit pattern for ScrubPoison (e.g. 0x8000 for
	// bf16 -0); zero means the dtype's negative zero. For ScrubCanary it
	// seeds the page-specific words; zero means a fixed default seed.
	Pattern uint32
}

const (
	canarySalt        = 0x9e3779b1 // odd, so distinct pages get distinct words
	defaultCanarySeed = 0x5ca1ab1e
)

// FillSpec validates the policy against dtype and returns the device fill
// it implies.
func (p ScrubPolicy) FillSpec(d DType) (cudaops.FillSpec, error) {
	return p.FillSpecFor(d)
}

// FillSpecFor is FillSpec for a pool whose regions hold several element
// types (MLA latents in fp8 with fp32 scales, bf16 state beside fp32
// state): one fill word for every region, a finite number read as any of
// them. A poison Pattern is an element of the first dtype, repeated over
// the word; the word must then be finite in every lane of every dtype.
// Canary words clear the top exponent bit of every lane of every dtype.
func (p ScrubPolicy) FillSpecFor(dtypes ...DType) (cudaops.FillSpec, error) {
	if len(dtypes) == 0 {
		return cudaops.FillSpec{}, fmt.Errorf("%w: no dtype", ErrInvalidPolicy)
	}
	for _, d := range dtypes {
		if !d.Valid() {
			return cudaops.FillSpec{}, fmt.Errorf("%w: dtype %v", ErrInvalidPolicy, d)
		}
	}
	d := dtypes[0]
	switch p.Kind {
	case ScrubZero:
		if p.Pattern != 0 {
			return cudaops.FillSpec{}, fmt.Errorf("%w: zero scrub takes no pattern, got %#x", ErrInvalidPolicy, p.Pattern)
		}
		return cudaops.FillSpec{}, nil
	case ScrubPoison:
		bits := p.Pattern
		if bits == 0 {
			bits = d.NegativeZero()
		}
		if width := 8 * d.Size(); width < 32 && bits>>width != 0 {
			return cudaops.FillSpec{}, fmt.Errorf("%w: poison %#x is wider than %v's %d bits", ErrInvalidPolicy, bits, d, width)
		}
		if !d.IsFinite(bits) {
			return cudaops.FillSpec{}, fmt.Errorf("%w: poison %#x in %v", ErrNonFinitePattern, bits, d)
		}
		word := d.replicate(bits)
		for _, o := range dtypes[1:] {
			if !o.wordFinite(word) {
				return cudaops.FillSpec{}, fmt.Errorf("%w: poison %#x of %v is the word %#08x, not finite as %v (the pool also holds %v); "+
					"choose a pattern finite in both", ErrNonFinitePattern, bits, d, word, o, o)
			}
		}
		return cudaops.FillSpec{Word: word}, nil
	case ScrubCanary:
		seed := p.Pattern
		if seed == 0 {
			seed = defaultCanarySeed
		}
		var mask uint32
		for _, o := range dtypes {
			mask |= o.finiteMask()
		}
		return cudaops.FillSpec{Word: seed, PageSalt: canarySalt, ClearMask: mask}, nil
	}
	return cudaops.FillSpec{}, fmt.Errorf("%w: scrub kind %v", ErrInvalidPolicy, p.Kind)
}

// wordFinite reports whether every element of d in the 32-bit word w is
// finite.
func (d DType) wordFinite(w uint32) bool {
	bits := 8 * d.Size()
	for shift := 0; shift < 32; shift += bits {
		lane := w >> shift
		if bits < 32 {
			lane &= 1<<bits - 1
		}
		if !d.IsFinite(lane) {
			return false
		}
	}
	return true
}

// ScrubStats are running totals of a pool's scrubbing.
type ScrubStats struct {
	Fills          uint64 // batches filled
	PagesScrubbed  uint64
	BytesScrubbed  uint64
	FillErrors     uint64
	PagesRetired   uint64
	CanaryChecks   uint64 // pages verified on allocation
	CanaryFailures uint64
}
