package isolation

import "fmt"

// SizingMode says how much of a request's output budget its admission
// reserves.
type SizingMode uint8

const (
	// SizeInherit takes the sizing of the level above: a request's from
	// its tenant, a tenant's from its pool; a pool's is SizeFull.
	SizeInherit SizingMode = iota
	// SizeFull reserves prompt + max new tokens at admission: a lease
	// never needs another page. The safest mode, and the default.
	SizeFull
	// SizeOnDemand reserves the whole prompt plus HeadroomTokens of output
	// at admission (never more than the request's max new tokens); the
	// lease grows later, page by page, and growth can be refused, which
	// tells the engine to preempt. The prompt is always admitted whole or
	// refused.
	SizeOnDemand
)

var sizingNames = [...]string{"inherit", "full", "on_demand"}

func (m SizingMode) String() string {
	if int(m) < len(sizingNames) {
		return sizingNames[m]
	}
	return fmt.Sprintf("SizingMode(%d)", uint8(m))
}

// ParseSizingMode accepts the names String returns ("" is inherit).
func ParseSizingMode(s string) (SizingMode, error) {
	if s == "" {
		return SizeInherit, nil
	}
	for m, name := range sizingNames {
		if s == name {
			return SizingMode(m), nil
		}
	}
	return 0, fmt.Errorf("%w: unknown sizing mode %q (want full or on_demand)", ErrInvalidSizing, s)
}

// MaxHeadroomTokens bounds Sizing.HeadroomTokens.
const MaxHeadroomTokens = 1 << 30

// Sizing is how leases are sized at admission: per pool, overridden per
// tenant and per request.
type Sizing struct {
	Mode SizingMode
	// HeadroomTokens is, for SizeOnDemand, the output tokens reserved at
	// admission beyond the prompt. Zero reserves the prompt alone (its
	// last page may still hold a few output tokens).
	HeadroomTokens int
}

// Validate checks a sizing; the error wraps ErrInvalidSizing.
func (s Sizing) Validate() error {
	switch {
	case s.Mode > SizeOnDemand:
		return fmt.Errorf("%w: sizing mode %v", ErrInvalidSizing, s.Mode)
	case s.HeadroomTokens < 0 || s.HeadroomTokens > MaxHeadroomTokens:
		return fmt.Errorf("%w: sizing headroom of %d tokens, want 0..%d", ErrInvalidSizing, s.HeadroomTokens, MaxHeadroomTokens)
	case s.HeadroomTokens != 0 && s.Mode != SizeOnDemand:
		return fmt.Errorf("%w: sizing headroom of %d tokens with mode %v: headroom is for on_demand only", ErrInvalidSizing, s.HeadroomTokens, s.Mode)
	}
	return nil
}

// Or is s, or fallback where s inherits.
func (s Sizing) Or(fallback Sizing) Sizing {
	if s.Mode == SizeInherit {
		return fallback
	}
	return s
}

// OutputTokens is how many of maxNew output tokens an admission under s
// reserves. An inherited sizing reserves them all.
func (s Sizing) OutputTokens(maxNew int) int {
	if s.Mode == SizeOnDemand {
		return min(maxNew, s.HeadroomTokens)
	}
	return maxNew
}
