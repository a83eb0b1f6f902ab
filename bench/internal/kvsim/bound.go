package kvsim

import "github.com/kvfence/kvfence/isolation"

// PrefixBound is the most a prefix cache can hit on a trace: the hit rate
// of an infinite cache (nothing is ever evicted) into which every request
// has published its prompt before the next one arrives, counted as the
// pool counts hits. A request looks up its full prompt pages but the one
// holding its last token, (prompt-1)/page of them, and hits the longest
// leading run of them that an earlier request of its sharing domain
// published; it then publishes its full prompt pages, prompt/page of
// them. Requests are taken in trace order; those longer than the context
// window are left out (every pool refuses them, so they look up and
// publish nothing). The bound depends on the trace, the page size, the
// context window and the domain layout, never on the pool.
//
// A real run hits less: its cache is finite, and a request that arrives
// while the prompt it shares is still being computed, or before the
// request that publishes it is admitted, misses. It can hit more only
// where admission reorders requests (a tenant over its quota waits while
// later ones pass) or where refusals leave out requests that the bound
// counts.
type PrefixBound struct {
	Domains      string  `json:"domains"`  // DomainsPerTenant or DomainsShared
	Requests     int     `json:"requests"` // requests counted: within the context window
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

// Bound computes tr's PrefixBound at tokensPerPage with a context window of
// maxContext tokens and the given domain layout.
func Bound(tr *Trace, tokensPerPage, maxContext int, domains string) PrefixBound {
	b := PrefixBound{Domains: domains}
	if domains == "" {
		b.Domains = DomainsPerTenant
	}
	if tokensPerPage < 1 {
		return b
	}
	domainIdx := map[string]int32{}
	tenantDomain := map[string]int32{}
	for _, t := range tr.Tenants {
		d := isolation.PrivateDomainPrefix + t.Name
		if b.Domains == DomainsShared && t.Domain != "" {
			d = t.Domain
		}
		if _, ok := domainIdx[d]; !ok {
			domainIdx[d] = int32(len(domainIdx))
		}
		tenantDomain[t.Name] = domainIdx[d]
	}
	nodes := map[boundKey]int32{}
	var published []int // node → most tokens of its segment published
	type segment struct {
		key    boundKey // parent filled in while walking
		tokens int
	}
	var segs []segment
	for i := range tr.Requests {
		r := &tr.Requests[i]
		if r.Prompt+r.MaxNew > maxContext {
			continue
		}
		b.Requests++
		segs = segs[:0]
		switch {
		case len(r.Blocks) > 0:
			for j, id := range r.Blocks {
				segs = append(segs, segment{boundKey{block: id}, min(tr.BlockTokens, r.Prompt-j*tr.BlockTokens)})
			}
		case r.Prefix > 0:
			segs = append(segs, segment{boundKey{prefix: r.PrefixID}, r.Prefix})
		}
		root := -1 - tenantDomain[r.Tenant]
		// Look up: the tokens an earlier request published, segment by
		// segment, as long as each segment is there whole.
		matched, parent := 0, root
		for _, s := range segs {
			s.key.parent = parent
			n, ok := nodes[s.key]
			if !ok {
				break
			}
			m := min(published[n], s.tokens)
			matched += m
			if m < s.tokens {
				break
			}
			parent = n
		}
		looked := (r.Prompt - 1) / tokensPerPage
		hit := min(matched/tokensPerPage, looked)
		b.LookupPages += uint64(looked)
		b.HitPages += uint64(hit)
		b.PromptTokens += uint64(r.Prompt)
		b.HitTokens += uint64(hit * tokensPerPage)
		// Publish the full prompt pages.
		pub := r.Prompt / tokensPerPage * tokensPerPage
		offset, parent := 0, root
		for _, s := range segs {
			portion := min(max(pub-offset, 0), s.tokens)
			if portion == 0 {
				break
			}
			s.key.parent = parent
			n, ok := nodes[s.key]
			if !ok {
				n = int32(len(published))
				nodes[s.key] = n
				published = append(published, 0)
			}
			published[n] = max(published[n], portion)
			offset += s.tokens
			parent = n
		}
	}
	if b.LookupPages > 0 {
		b.HitRate = float64(b.HitPages) / float64(b.LookupPages)
	}
	if b.PromptTokens > 0 {
		b.PromptHitShare = float64(b.HitTokens) / float64(b.PromptTokens)
	}
	return b
}
