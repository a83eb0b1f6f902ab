package kvsim

import "github.com/kvfence/kvfence/isolation"

// PrefixBound is the most a prefix cache can hit on a trace: the hit rate
// of an infinite cache (nothing is ever evicted) into which every request
// has published its prompt before the next one arrives, counted as the
// pool counts hits. A request looks up its full prompt pages but the one
// holding its last token, (prompt-1)/page of them, and hits the longest
// leading run of them that an earlier request of its sharing domain
// published; it then publishes its full prompt pages, prompt/page of
// them. Requests are taken in trace order. Those longer (prompt + output
// budget) than the longest request the engine can take, its context
// window or its pool, are left out: admission refuses them, so they look
// up and publish nothing. Apart from that limit the bound depends on the
// trace, the page size and the domain layout, never on the pool: a pool
// that holds every request of the trace has the trace's own bound.
//
// A real run hits less: its cache is finite, and a request that arrives
// while the prompt it shares is still being computed, or before the
// request that publishes it is admitted, misses. Its hit rate counts the
// requests it admitted only, so it can read more than the bound when it
// leaves out requests the bound counts (a pool so busy that requests time
// out in its queue, or are still queued at the end); the run's served
// bound (PrefixResult.ServedBound), the same count over the requests it
// admitted, in the order it admitted them, is never below its hits.
type PrefixBound struct {
	Domains      string  `json:"domains"`  // DomainsPerTenant or DomainsShared
	Requests     int     `json:"requests"` // requests counted: those within MaxTokens
	MaxTokens    int     `json:"max_request_tokens"`
	LookupPages  uint64  `json:"lookup_pages"`
	HitPages     uint64  `json:"hit_pages"`
	HitRate      float64 `json:"hit_rate"` // hit ÷ looked-up pages
	PromptTokens uint64  `json:"prompt_tokens"`
	HitTokens    uint64  `json:"hit_tokens"` // hit pages × page size
	// PromptHitShare is hit tokens ÷ prompt tokens of the requests counted.
	PromptHitShare float64 `json:"prompt_hit_share"`
}

// boundKey names one segment of shared content under its parent: a block
// of a chain, or a prefix named by its PrefixID (never empty, so never a
// block's key) at the root. Roots are per sharing domain (parent = -1-domain).
type boundKey struct {
	parent int32
	block  int64
	prefix string
}

// boundIndex is an infinite prefix cache: what every request added so far
// published, by segment. It counts a PrefixBound as requests are added.
type boundIndex struct {
	tr            *Trace
	tokensPerPage int
	// admits says whether admission can take a request at all (default:
	// prompt + budget within MaxTokens).
	admits       func(*Request) bool
	b            PrefixBound
	tenantDomain map[string]int32
	nodes        map[boundKey]int32
	published    []int // node → most tokens of its segment published
	segs         []boundSegment
}

type boundSegment struct {
	key    boundKey // parent filled in while walking
	tokens int
}

func newBoundIndex(tr *Trace, tokensPerPage, maxTokens int, domains string) *boundIndex {
	x := &boundIndex{tr: tr, tokensPerPage: tokensPerPage, b: PrefixBound{Domains: domains, MaxTokens: maxTokens},
		tenantDomain: map[string]int32{}, nodes: map[boundKey]int32{}}
	if domains == "" {
		x.b.Domains = DomainsPerTenant
	}
	domainIdx := map[string]int32{}
	for _, t := range tr.Tenants {
		d := isolation.PrivateDomainPrefix + t.Name
		if x.b.Domains == DomainsShared && t.Domain != "" {
			d = t.Domain
		}
		if _, ok := domainIdx[d]; !ok {
			domainIdx[d] = int32(len(domainIdx))
		}
		x.tenantDomain[t.Name] = domainIdx[d]
	}
	return x
}

// add looks r up, counting its pages, then publishes its full prompt
// pages. Requests longer than MaxTokens are left out.
func (x *boundIndex) add(r *Request) {
	if x.tokensPerPage < 1 {
		return
	}
	if x.admits != nil {
		if !x.admits(r) {
			return
		}
	} else if r.Prompt+r.MaxNew > x.b.MaxTokens {
		return
	}
	x.b.Requests++
	segs := x.segs[:0]
	switch {
	case len(r.Blocks) > 0:
		bt := x.tr.BlockTokens
		for j, id := range r.Blocks {
			segs = append(segs, boundSegment{boundKey{block: id}, min(bt, r.Prompt-j*bt)})
		}
	case r.Prefix > 0:
		segs = append(segs, boundSegment{boundKey{prefix: r.PrefixID}, r.Prefix})
	}
	x.segs = segs
	root := -1 - x.tenantDomain[r.Tenant]
	// Look up: the tokens an earlier request published, segment by
	// segment, as long as each segment is there whole.
	matched, parent := 0, root
	for _, s := range segs {
		s.key.parent = parent
		n, ok := x.nodes[s.key]
		if !ok {
			break
		}
		m := min(x.published[n], s.tokens)
		matched += m
		if m < s.tokens {
			break
		}
		parent = n
	}
	tpp := x.tokensPerPage
	looked := (r.Prompt - 1) / tpp
	hit := min(matched/tpp, looked)
	x.b.LookupPages += uint64(looked)
	x.b.HitPages += uint64(hit)
	x.b.PromptTokens += uint64(r.Prompt)
	x.b.HitTokens += uint64(hit * tpp)
	// Publish the full prompt pages.
	pub := r.Prompt / tpp * tpp
	offset, parent := 0, root
	for _, s := range segs {
		portion := min(max(pub-offset, 0), s.tokens)
		if portion == 0 {
			break
		}
		s.key.parent = parent
		n, ok := x.nodes[s.key]
		if !ok {
			n = int32(len(x.published))
			x.nodes[s.key] = n
			x.published = append(x.published, 0)
		}
		x.published[n] = max(x.published[n], portion)
		offset += s.tokens
		parent = n
	}
}

// bound returns the figures so far.
func (x *boundIndex) bound() PrefixBound {
	b := x.b
	if b.LookupPages > 0 {
		b.HitRate = float64(b.HitPages) / float64(b.LookupPages)
	}
	if b.PromptTokens > 0 {
		b.PromptHitShare = float64(b.HitTokens) / float64(b.PromptTokens)
	}
	return b
}

// Bound computes tr's PrefixBound at tokensPerPage for requests of at most
// maxTokens tokens (the engine's context window, or its pool if smaller)
// and the given domain layout.
func Bound(tr *Trace, tokensPerPage, maxTokens int, domains string) PrefixBound {
	x := newBoundIndex(tr, tokensPerPage, maxTokens, domains)
	for i := range tr.Requests {
		x.add(&tr.Requests[i])
	}
	return x.bound()
}

// admissible reports whether a pool of cfg can ever admit r: prompt and
// budget within the context window, and what its sizing reserves at
// admission (everything under full sizing, the prompt and the headroom
// under on-demand) within the pool.
func admissible(r *Request, cfg RunConfig) bool {
	reserve := r.MaxNew
	if cfg.Sizing == SizingOnDemand {
		reserve = min(r.MaxNew, cfg.HeadroomTokens)
	}
	return r.Prompt+r.MaxNew <= cfg.MaxContext && r.Prompt+reserve <= cfg.PoolPages*cfg.tokensPerPage()
}

// newBoundIndexFor is a run's bound index: the requests its pool can
// admit (admissible) count. Under full sizing that is Bound's rule with
// the context window or the pool, whichever is smaller; under on-demand
// sizing a request longer than the pool counts if its prompt and headroom
// fit (MaxTokens still names the smaller of the two).
func newBoundIndexFor(tr *Trace, cfg RunConfig) *boundIndex {
	x := newBoundIndex(tr, cfg.tokensPerPage(), min(cfg.MaxContext, cfg.PoolPages*cfg.tokensPerPage()), cfg.Domains)
	x.admits = func(r *Request) bool { return admissible(r, cfg) }
	return x
}

// boundFor is a run's PrefixBound over the whole trace.
func boundFor(tr *Trace, cfg RunConfig) PrefixBound {
	x := newBoundIndexFor(tr, cfg)
	for i := range tr.Requests {
		x.add(&tr.Requests[i])
	}
	return x.bound()
}
