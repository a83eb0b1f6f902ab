package kvcache

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// checkpointModel is the reference for hybrid prefix hits: the prompts
// each sharing domain has checkpointed, at which token counts. A prompt's
// hit is the longest checkpointed prefix of it in its domain that leaves
// its last token to compute. The pool is sized so that nothing is
// evicted: hits are exactly the model's.
type checkpointModel struct {
	tpp    int
	byDom  map[string][][]int32 // every checkpointed prefix, by domain
	writer map[string]string    // domain + prefix → the tag whose state it holds
}

func (m *checkpointModel) key(dom string, prefix []int32) string {
	return fmt.Sprint(dom, prefix)
}

func (m *checkpointModel) add(dom string, prefix []int32, tag string) {
	k := m.key(dom, prefix)
	if _, ok := m.writer[k]; ok {
		return // kept: the first checkpoint there stays
	}
	m.writer[k] = tag
	m.byDom[dom] = append(m.byDom[dom], slices.Clone(prefix))
}

// hit is the tokens a prompt of dom hits, and whose state it restores.
func (m *checkpointModel) hit(dom string, prompt []int32) (int, string) {
	limit := (len(prompt) - 1) / m.tpp * m.tpp
	best, tag := 0, ""
	for _, c := range m.byDom[dom] {
		if len(c) > best && len(c) <= limit && slices.Equal(c, prompt[:len(c)]) {
			best, tag = len(c), m.writer[m.key(dom, c)]
		}
	}
	return best, tag
}

// Random prompts over a few shared system prompts, from tenants in four
// sharing domains (two of two tenants, two private): each admission hits
// exactly the model's longest checkpointed prefix in its domain, never
// another domain's, and restores exactly the state that checkpoint took.
// The engine checkpoints at the end of the system prompt when it
// prefills past it, and at PrefillCheckpoint; a third of the requests are
// preempted and resumed with their next token.
func TestCheckpointHitsMatchTheModel(t *testing.T) {
	tenants := []TenantConfig{
		{Name: "t0", Domain: "org"}, {Name: "t1", Domain: "org"},
		{Name: "t2", Domain: "lab"}, {Name: "t3", Domain: "lab"},
		{Name: "t4"}, {Name: "t5"},
	}
	cfg := checkpointConfig(8192, 4, 2048, tenants...)
	p := newPool(t, cfg)
	m := &checkpointModel{tpp: p.TokensPerPage(), byDom: map[string][][]int32{}, writer: map[string]string{}}
	tpp := p.TokensPerPage()
	rng := rand.New(rand.NewPCG(31, 4))
	systems := [][]int32{promptTokens(1, 12, 0, 12), promptTokens(2, 20, 0, 20), promptTokens(3, 9, 0, 9)}
	var prompts [][]int32 // earlier prompts, asked again
	hits := 0
	for step := range 400 {
		tenant := tenants[rng.IntN(len(tenants))].Name
		dom, err := p.TenantDomain(tenant)
		require.NoError(t, err)
		var prompt []int32
		switch {
		case len(prompts) > 0 && rng.IntN(4) == 0:
			prompt = prompts[rng.IntN(len(prompts))]
		case rng.IntN(5) == 0: // no system prompt
			prompt = promptTokens(0, 0, step, 1+rng.IntN(40))
			prompts = append(prompts, prompt)
		default:
			sys := systems[rng.IntN(len(systems))]
			prompt = append(slices.Clone(sys), promptTokens(0, 0, step, 1+rng.IntN(30))...)
			prompts = append(prompts, prompt)
		}
		id := fmt.Sprint("r", step)
		wantHit, wantTag := m.hit(dom, prompt)
		l, err := p.TryAdmit(Request{ID: id, Tenant: tenant, PromptTokens: len(prompt), MaxNewTokens: 8, TokenIDs: prompt})
		require.NoError(t, err, "step %d", step)
		require.Equal(t, wantHit, l.HitTokens(), "step %d: tenant %s in %s, prompt of %d", step, tenant, dom, len(prompt))
		require.NoError(t, stateErr(p, l, wantTag, wantHit), "step %d", step)
		if wantHit > 0 {
			hits++
		}
		// Prefill in chunks that end where checkpoints go.
		require.NoError(t, l.BeginPrefill())
		var stops []int
		for _, sys := range systems {
			if n := len(sys) / tpp * tpp; n > wantHit && n <= len(prompt) && slices.Equal(sys[:n], prompt[:n]) && n < len(prompt) {
				stops = append(stops, n)
			}
		}
		if n := l.PrefillCheckpoint(); n > wantHit {
			stops = append(stops, n)
		}
		slices.Sort(stops)
		for _, n := range slices.Compact(stops) {
			prefillTo(t, p, l, id, n)
			require.NoError(t, l.CheckpointState(n, cudaops.Ordering{}), "step %d at %d", step, n)
			m.add(dom, prompt[:n], fmt.Sprintf("%s@%d", id, n))
		}
		prefillTo(t, p, l, id, len(prompt))
		require.NoError(t, l.FinishPrefill())
		if rng.IntN(3) == 0 {
			// Preempted after generating up to the next page boundary; it
			// resumes with what it wrote and its next token.
			gen := (len(prompt)/tpp+1)*tpp - len(prompt)
			out := append(slices.Clone(prompt), promptTokens(0, 0, 1000+step, gen+1)...)
			prefillTo(t, p, l, id, len(prompt)+gen)
			kept, err := l.Preempt(out[:len(prompt)+gen])
			require.NoError(t, err)
			require.Equal(t, len(prompt)+gen, kept, "step %d", step)
			m.add(dom, out[:len(prompt)+gen], fmt.Sprintf("%s@%d", id, len(prompt)+gen))
			prompts = append(prompts, out)
		} else {
			require.NoError(t, l.Release())
		}
		require.NoError(t, p.Check(), "step %d", step)
	}
	s := p.Stats().Checkpoints
	require.Zero(t, s.Evicted, "sized so that nothing is evicted")
	require.EqualValues(t, hits, s.Hits)
	require.Greater(t, hits, 100, "the trace must hit")
	t.Logf("%d hits in 400 admissions; %d checkpoints, %d bytes of state", hits, s.Live, s.StateBytes)
	_, err := p.AuditFreePages()
	require.NoError(t, err)
}
