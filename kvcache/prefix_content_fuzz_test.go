package kvcache

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// FuzzPrefixContentFollowsTokens runs arbitrary sequences of admit (with
// token IDs) / grow / commit / release / CachePrefix / Preempt, honest or
// with a prompt token altered, on one on-demand pool with prefix caching,
// and checks the property the prefix cache exists for: a page a lease
// receives as a hit holds the KV computed for exactly the tokens before
// and in it, in the lease's own sharing domain.
//
// The "engine" here writes into every page that becomes full a marker
// derived from the domain and all tokens up to the page's end (KV depends
// on every token before it), so a hit on a page computed for other
// tokens, or in another domain, shows as a wrong marker. Tenants a and c
// share a domain, b has its own; all draw prompts from the same few token
// streams, so the same tokens recur across domains.
func FuzzPrefixContentFollowsTokens(f *testing.F) {
	f.Add([]byte{0, 20, 2, 8, 2, 8, 6, 0, 3, 0, 0, 20})
	f.Add([]byte{0, 40, 2, 8, 2, 8, 2, 8, 1, 10, 2, 8, 4, 0, 8, 41, 0, 40})
	f.Add([]byte{0, 40, 2, 8, 2, 8, 5, 3, 4, 0, 0, 40, 8, 21, 10, 8, 14, 0})
	f.Add([]byte{0, 33, 2, 8, 2, 8, 2, 8, 2, 8, 4, 0, 8, 32, 0, 34, 12, 0})
	cfg := tinyConfig(48, TenantConfig{Name: "a", Domain: "ac"}, TenantConfig{Name: "b"},
		TenantConfig{Name: "c", Domain: "ac"})
	cfg.Sizing = onDemand(1)
	p, err := New(cfg)
	require.NoError(f, err)
	f.Cleanup(func() { p.Close() })
	host := hostOf(f, p)
	tpp := p.Stats().TokensPerPage
	tenants := []string{"a", "b", "c"}
	known := []error{ErrInvalidArgument, ErrExceedsMaxContext, ErrExceedsCapacity, ErrExceedsQuota,
		ErrPoolExhausted, ErrLeaseReleased}

	// stream is the first n tokens of stream s, variant v: the variants of
	// a stream differ in one of its first two tokens (v 1 or 2; 0 leaves
	// them be), and the first 6 tokens of every stream are common to all.
	stream := func(s, v, n int) []int32 {
		out := tokens(n, 6, int32(s+1))
		if v > 0 && v <= n {
			out[v-1]++
		}
		return out
	}
	// marker fills page with what KV computed for tokens in domain holds.
	marker := func(page int32, domain string, tokens []int32) {
		h := fnv.New64a()
		h.Write([]byte(domain))
		binary.Write(h, binary.LittleEndian, tokens)
		var word [8]byte
		binary.LittleEndian.PutUint64(word[:], h.Sum64())
		for r := range host.Regions() {
			b := host.PageBytes(r, page)
			for i := range b {
				b[i] = word[i%8]
			}
		}
	}
	holds := func(page int32, domain string, tokens []int32) bool {
		before := append([]byte(nil), host.PageBytes(0, page)...)
		marker(page, domain, tokens)
		ok := string(before) == string(host.PageBytes(0, page))
		copy(host.PageBytes(0, page), before)
		return ok
	}

	type slot struct {
		l               *Lease
		stream, variant int
	}
	f.Fuzz(func(t *testing.T, ops []byte) {
		var slots [4]slot
		defer func() {
			for _, s := range slots {
				if s.l.Live() {
					require.NoError(t, s.l.Release())
				}
			}
			require.NoError(t, p.ClearPrefixCache())
			require.NoError(t, p.Check())
		}()
		// commit writes n more tokens into s's lease, as an engine would:
		// a marker in every page that becomes full.
		commit := func(s *slot, n int) error {
			from := s.l.Written()
			if err := s.l.Commit(from + n); err != nil {
				return err
			}
			table, err := s.l.BlockTable()
			require.NoError(t, err)
			all := stream(s.stream, s.variant, from+n)
			for pg := from / tpp; pg < (from+n)/tpp; pg++ {
				marker(table[pg], s.l.Domain(), all[:(pg+1)*tpp])
			}
			return nil
		}
		for i := 0; i+1 < len(ops) && i < 96; i += 2 {
			// ops[i]: the op in bits 0-2, the slot in 3-4, and in 5-7 a
			// choice of tenant and token variant.
			s, arg := &slots[ops[i]>>3&3], int(ops[i+1])
			op, extra := ops[i]&7, int(ops[i]>>5)
			if op != 0 && !s.l.Live() {
				continue
			}
			before := state(p)
			var err error
			switch op {
			case 0: // admit, with the prompt's token IDs
				if s.l.Live() {
					continue
				}
				st, v, prompt := arg%3, extra/3, arg/3%40+1
				var l *Lease
				l, err = p.TryAdmit(Request{ID: fmt.Sprint("s", ops[i]>>3&3), Tenant: tenants[extra%3],
					PromptTokens: prompt, MaxNewTokens: 8 + arg%9, TokenIDs: stream(st, v, prompt)})
				if err != nil {
					break
				}
				*s = slot{l: l, stream: st, variant: v}
				table, terr := l.BlockTable()
				require.NoError(t, terr)
				hit := l.HitTokens() / tpp
				all := stream(st, v, prompt)
				for pg := range hit {
					require.True(t, holds(table[pg], l.Domain(), all[:(pg+1)*tpp]),
						"step %d: hit page %d (page %d) of %q in domain %s does not hold the KV of its tokens",
						i/2, pg, table[pg], l.ID(), l.Domain())
				}
				require.NoError(t, l.Commit(hit*tpp)) // prefill starts after the hit
			case 1:
				err = s.l.TryGrow(arg%24 - 4)
			case 2:
				err = commit(s, min(arg%9, s.l.CapacityTokens()-s.l.Written()))
			case 3:
				err = s.l.Release()
			case 4, 5: // preempt with the written tokens; 5 with another variant's
				written := s.l.Written()
				all := stream(s.stream, s.variant, written)
				if op == 5 {
					forged := stream(s.stream, s.variant%2+1, written)
					if d := firstDifference(forged, all); d >= 0 && d < s.l.PromptTokens() {
						_, err = s.l.Preempt(forged)
						require.ErrorIs(t, err, ErrInvalidArgument, "step %d: prompt token %d forged", i/2, d)
						require.True(t, s.l.Live())
						break
					}
				}
				var kept int
				if kept, err = s.l.Preempt(all); err == nil {
					require.LessOrEqual(t, kept, written)
					require.Zero(t, kept%tpp)
				}
			case 6:
				_, err = s.l.CachePrefix(min(s.l.Written(), s.l.PromptTokens()))
			case 7: // read back the lease's own full pages
				table, terr := s.l.BlockTable()
				require.NoError(t, terr)
				all := stream(s.stream, s.variant, s.l.Written())
				for pg := range s.l.Written() / tpp {
					require.True(t, holds(table[pg], s.l.Domain(), all[:(pg+1)*tpp]), "step %d: page %d of %q", i/2, pg, s.l.ID())
				}
			}
			if err != nil {
				ok := false
				for _, k := range known {
					ok = ok || errors.Is(err, k)
				}
				require.True(t, ok, "step %d: unexpected error %v", i/2, err)
				if op != 3 {
					assert.Equal(t, before, state(p), "step %d: a refused step changed the pool", i/2)
				}
			}
			require.NoError(t, p.Check())
		}
	})
}
