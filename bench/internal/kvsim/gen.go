package kvsim

import (
	"fmt"
	"math"
	"math/rand/v2"
	"time"
)

// GenConfig shapes a synthetic workload.
type GenConfig struct {
	Seed     uint64
	Duration time.Duration // arrivals fall in [0, Duration)
	Rate     float64       // mean arrivals per second (Poisson)
	Tenants  int
	// OrgSize groups tenants into organisations of this many (the last
	// may be smaller): an organisation's tenants use the same system
	// prompt, and its Domain names them a sharing domain for runs with
	// shared domains. 0 or 1: every tenant is on its own, with a system
	// prompt of its own.
	OrgSize int
	// OverlongFraction of requests ask for more than the pool can ever
	// give: half of them (when the pool is smaller than the context window)
	// fit the context window but not the pool (ErrExceedsCapacity), the rest
	// exceed the context window (ErrExceedsMaxContext).
	OverlongFraction float64
	// AbortFraction of requests are aborted by their client mid-generation.
	AbortFraction float64
	// CapacityTokens is the smallest pool the trace will be replayed
	// against, MaxContext the engine's context window, TokensPerPage the
	// page size; they place over-long requests and size quotas.
	CapacityTokens int
	MaxContext     int
	TokensPerPage  int
}

func (c GenConfig) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrBadConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case c.Duration <= 0 || c.Duration > maxTraceAt:
		return bad("duration %v, want (0, %v]", c.Duration, maxTraceAt)
	case !(c.Rate > 0 && c.Rate <= 1e6):
		return bad("rate %v requests/s, want (0, 1e6]", c.Rate)
	case c.Tenants < 1 || c.Tenants > 255:
		return bad("%d tenants, want 1..255", c.Tenants)
	case c.OrgSize < 0 || c.OrgSize > 255:
		return bad("organisation size %d, want 0..255", c.OrgSize)
	case !(c.OverlongFraction >= 0 && c.OverlongFraction < 1):
		return bad("over-long fraction %v, want [0, 1)", c.OverlongFraction)
	case !(c.AbortFraction >= 0 && c.AbortFraction < 1):
		return bad("abort fraction %v, want [0, 1)", c.AbortFraction)
	case c.CapacityTokens < 1 || c.MaxContext < 1 || c.TokensPerPage < 1:
		return bad("capacity %d, max context %d, page %d tokens: all must be ≥ 1", c.CapacityTokens, c.MaxContext, c.TokensPerPage)
	case c.Duration.Seconds()*c.Rate > 10_000_000:
		return bad("%v at %v requests/s is more than 10M requests", c.Duration, c.Rate)
	}
	return nil
}

// Shapes of the synthetic lengths, in tokens. Medians and spreads follow
// what public chat-serving traces show: short outputs, prompts with a
// long lognormal tail, and clients that ask for round max_tokens budgets
// well above what they use.
const (
	userPromptMedian   = 350
	userPromptSigma    = 1.3
	maxUserPrompt      = 32768
	outputMedian       = 150
	outputSigma        = 1.1
	maxOutput          = 4096
	systemPromptMedian = 700
	systemPromptSigma  = 0.8
	systemPromptUse    = 0.9 // share of a tenant's requests that carry its system prompt
)

// Generate builds a deterministic synthetic trace: the same config (seed
// included) always yields the same trace.
func Generate(c GenConfig) (*Trace, error) {
	if err := c.validate(); err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(c.Seed, c.Seed^0x6b766265_6e636821))
	lognormal := func(median, sigma float64, lo, hi int) int {
		v := median * math.Exp(sigma*rng.NormFloat64())
		return int(math.Max(float64(lo), math.Min(float64(hi), math.Round(v))))
	}
	tr := &Trace{}
	// One system prompt per organisation (a tenant alone is its own).
	orgSize := max(1, c.OrgSize)
	orgPrompts := make([]int, (c.Tenants+orgSize-1)/orgSize)
	for k := range orgPrompts {
		orgPrompts[k] = lognormal(systemPromptMedian, systemPromptSigma, 32, 6000)
	}
	// Zipf-like tenant popularity; every fourth tenant has no system prompt.
	weights := make([]float64, c.Tenants)
	var sum float64
	for i := range c.Tenants {
		t := Tenant{Name: fmt.Sprintf("tenant-%02d", i)}
		if orgSize > 1 {
			t.Domain = fmt.Sprintf("org-%02d", i/orgSize)
		}
		if i%4 != 3 {
			t.SystemPrompt = orgPrompts[i/orgSize]
		}
		// The last tenant is a batch customer held to a quarter of the pool.
		if i == c.Tenants-1 && c.Tenants > 1 {
			t.QuotaPages = max(1, c.CapacityTokens/c.TokensPerPage/4)
		}
		tr.Tenants = append(tr.Tenants, t)
		weights[i] = 1 / math.Pow(float64(i+1), 1.1)
		sum += weights[i]
	}
	pickTenant := func() int {
		x := rng.Float64() * sum
		for i, w := range weights {
			if x < w {
				return i
			}
			x -= w
		}
		return len(weights) - 1
	}
	var at float64
	for n := 0; ; n++ {
		at += rng.ExpFloat64() / c.Rate
		arrival := time.Duration(at * 1e9).Round(time.Microsecond)
		if arrival >= c.Duration {
			break
		}
		ti := pickTenant()
		tn := tr.Tenants[ti]
		r := Request{At: arrival, ID: fmt.Sprintf("g%07d", n), Tenant: tn.Name, AbortAfter: -1}
		if tn.SystemPrompt > 0 && rng.Float64() < systemPromptUse {
			r.Prefix = tn.SystemPrompt
			r.PrefixID = DefaultPrefixID(tn.Name, tn.Domain)
		}
		r.Prompt = r.Prefix + lognormal(userPromptMedian, userPromptSigma, 1, maxUserPrompt)
		r.Output = lognormal(outputMedian, outputSigma, 1, maxOutput)
		r.MaxNew = 128
		for r.MaxNew < r.Output {
			r.MaxNew *= 2
		}
		if rng.IntN(2) == 0 {
			r.MaxNew *= 2
		}
		if rng.Float64() < c.OverlongFraction {
			total := 0
			if c.CapacityTokens < c.MaxContext && rng.IntN(2) == 0 {
				total = c.CapacityTokens + 1 + rng.IntN(c.MaxContext-c.CapacityTokens)
			} else {
				total = c.MaxContext + 1 + rng.IntN(c.MaxContext/2+1)
			}
			r.Prompt = max(r.Prefix+1, total-r.MaxNew)
		}
		if rng.Float64() < c.AbortFraction {
			r.AbortAfter = rng.IntN(r.Output)
		}
		tr.Requests = append(tr.Requests, r)
	}
	return tr, nil
}
