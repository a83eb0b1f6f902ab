package kvcache

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// imagePrompt is 6 full pages and 2 tokens of placeholders: the same token
// IDs whatever the image, as a multimodal prompt has them. The image
// covers pages 2 and 3.
func imagePrompt() []int32 { return tokens(6*prefixTPP+2, 6*prefixTPP+2, 0) }

func imageExtra(image string) [][]byte {
	return [][]byte{nil, nil, []byte(image + "@0"), []byte(image + "@-4")}
}

func admitExtra(t *testing.T, p *Pool, id, tenant string, toks []int32, extra [][]byte) *Lease {
	t.Helper()
	l, err := p.TryAdmit(Request{ID: id, Tenant: tenant, PromptTokens: len(toks), MaxNewTokens: 2 * prefixTPP,
		TokenIDs: toks, PageExtra: extra})
	require.NoError(t, err)
	require.NoError(t, p.Check())
	return l
}

// Equal placeholder tokens with another image share the pages before the
// image and nothing from the image's first page on; the same image shares
// every page a hit may take.
func TestPageExtraSharesOnlyTheSameImage(t *testing.T) {
	p := newPrefixPool(t, 64, PrefixConfig{}, TenantConfig{Name: "a"})
	toks := imagePrompt()
	pub := admitExtra(t, p, "pub", "a", toks, imageExtra("cat"))
	require.NoError(t, pub.Commit(len(toks)))
	shared, err := pub.CachePrefix(len(toks))
	require.NoError(t, err)
	require.Equal(t, 6*prefixTPP, shared)
	require.NoError(t, p.Check())

	same := admitExtra(t, p, "same", "a", toks, imageExtra("cat"))
	assert.Equal(t, 6*prefixTPP, same.HitTokens(), "the same image shares every full page")

	dog := admitExtra(t, p, "dog", "a", toks, imageExtra("dog"))
	assert.Equal(t, 2*prefixTPP, dog.HitTokens(), "another image shares only the pages before it")
	assert.Equal(t, 2, commonPages(tableOf(t, dog), tableOf(t, pub)))

	text, err := p.TryAdmit(Request{ID: "text", Tenant: "a", PromptTokens: len(toks), MaxNewTokens: 1, TokenIDs: toks})
	require.NoError(t, err)
	assert.Equal(t, 2*prefixTPP, text.HitTokens(), "a text-only prompt with the placeholder tokens shares only the pages before the image")
	for _, l := range []*Lease{pub, same, dog, text} {
		require.NoError(t, l.Release())
	}
	require.NoError(t, p.Check())
}

// Pages published without extra material by a text-only prompt are not
// found by a prompt whose page holds an image in the same tokens, and the
// pages before the image are shared both ways.
func TestPageExtraNeverMatchesATextPage(t *testing.T) {
	p := newPrefixPool(t, 64, PrefixConfig{}, TenantConfig{Name: "a"})
	toks := imagePrompt()
	text := admitComputeCache(t, p, "text", "a", toks, 1)
	img := admitExtra(t, p, "img", "a", toks, imageExtra("cat"))
	assert.Equal(t, 2*prefixTPP, img.HitTokens())
	assert.Equal(t, 2, commonPages(tableOf(t, img), tableOf(t, text)))
	require.NoError(t, text.Release())
	require.NoError(t, img.Release())
	require.NoError(t, p.Check())
}

// A preempted lease publishes its written pages, the partial prompt page
// included once output fills it; that page's key covers its extra
// material, so the request resumes onto it and a text-only prompt with
// the same tokens does not.
func TestPageExtraPreemptKeepsTheImageInTheKeys(t *testing.T) {
	cfg := Config{Geometry: prefixGeometry, Pages: 64, MaxContextTokens: 64 * prefixTPP,
		Tenants: []TenantConfig{{Name: "a"}}, Sizing: onDemand(0)}
	p := newPool(t, cfg)
	prompt := tokens(2*prefixTPP+2, 0, 7) // the image covers the partial page 2
	extra := [][]byte{nil, nil, []byte("cat@1")}
	l := admitExtra(t, p, "r", "a", prompt, extra)
	all := append(append([]int32(nil), prompt...), tokens(2*prefixTPP, 0, 8)...)
	require.NoError(t, l.Commit(len(prompt)))
	require.NoError(t, l.TryGrow(len(all)-len(prompt)))
	require.NoError(t, l.Commit(len(all)))
	kept, err := l.Preempt(all)
	require.NoError(t, err)
	require.Equal(t, 4*prefixTPP, kept, "the written full pages")
	require.NoError(t, p.Check())

	text, err := p.TryAdmit(Request{ID: "text", Tenant: "a", PromptTokens: len(all), MaxNewTokens: 1, TokenIDs: all})
	require.NoError(t, err)
	assert.Equal(t, 2*prefixTPP, text.HitTokens(), "the page with the image is not a text-only page")
	require.NoError(t, text.Release())

	resumed := admitExtra(t, p, "r", "a", all, extra)
	assert.Equal(t, 4*prefixTPP, resumed.HitTokens(), "the request resumes on every page it kept")
	require.NoError(t, resumed.Release())
	require.NoError(t, p.Check())
}

// The extended form is another key than the plain one for the same
// tokens, the plain pages of a request with extra material have the plain
// keys, and the material is length-delimited.
func TestPageExtraKeys(t *testing.T) {
	toks := tokens(3*prefixTPP, 0, 3)
	root := prefixRoot("d", "")
	plain := appendPageKeys(nil, root, prefixTPP, toks)
	withEmpty := appendPageKeysExtra(nil, root, prefixTPP, toks, [][]byte{nil, {}, nil})
	assert.Equal(t, plain, withEmpty, "empty material is no material")
	ext := appendPageKeysExtra(nil, root, prefixTPP, toks, [][]byte{nil, []byte("x")})
	assert.Equal(t, plain[0], ext[0])
	assert.NotEqual(t, plain[1], ext[1])
	assert.NotEqual(t, plain[2], ext[2], "the chain carries the material on")
	ext2 := appendPageKeysExtra(nil, root, prefixTPP, toks, [][]byte{nil, []byte("y")})
	assert.NotEqual(t, ext[1], ext2[1])
	// A lease's keys from a later page on agree with the whole chain.
	l := &Lease{extra: [][]byte{nil, []byte("x")}}
	tail := l.appendLeaseKeys(nil, ext[0], prefixTPP, 1, toks[prefixTPP:])
	assert.Equal(t, ext[1:], tail)
}

// Bad extra material is refused before anything is allocated.
func TestPageExtraRefusals(t *testing.T) {
	p := newPrefixPool(t, 16, PrefixConfig{}, TenantConfig{Name: "a"})
	toks := tokens(2*prefixTPP+1, 0, 1)
	before := state(p)
	for name, req := range map[string]Request{
		"without token IDs": {PromptTokens: len(toks), PageExtra: [][]byte{[]byte("x")}},
		"more than pages":   {PromptTokens: len(toks), TokenIDs: toks, PageExtra: make([][]byte, 4)},
		"too large":         {PromptTokens: len(toks), TokenIDs: toks, PageExtra: [][]byte{make([]byte, MaxPageExtraBytes+1)}},
	} {
		req.ID, req.Tenant = "r", "a"
		_, err := p.TryAdmit(req)
		require.ErrorIs(t, err, ErrInvalidRequest, name)
		assert.Equal(t, before, state(p), name)
		require.NoError(t, p.Check())
	}
	// One entry per page, the partial last page included, is fine.
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks, PageExtra: make([][]byte, 3)})
	require.NoError(t, err)
	require.NoError(t, l.Release())
}

// The material is copied at admission: the caller may reuse its buffer.
func TestPageExtraIsCopied(t *testing.T) {
	p := newPrefixPool(t, 64, PrefixConfig{}, TenantConfig{Name: "a"})
	toks := imagePrompt()
	buf := []byte("cat@0")
	pub := admitExtra(t, p, "pub", "a", toks, [][]byte{nil, nil, buf})
	copy(buf, "dog@0")
	require.NoError(t, pub.Commit(len(toks)))
	_, err := pub.CachePrefix(len(toks))
	require.NoError(t, err)
	for i, image := range []string{"cat@0", "dog@0"} {
		l := admitExtra(t, p, fmt.Sprint("r", i), "a", toks, [][]byte{nil, nil, []byte(image)})
		want := map[string]int{"cat@0": 6 * prefixTPP, "dog@0": 2 * prefixTPP}[image]
		assert.Equal(t, want, l.HitTokens(), image)
		require.NoError(t, l.Release())
	}
	require.NoError(t, pub.Release())
	require.NoError(t, p.Check())
}
