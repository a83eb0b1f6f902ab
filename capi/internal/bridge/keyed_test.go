package bridge

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvfence/kvfence/kvcache"
)

func TestSplitPageExtra(t *testing.T) {
	buf := []byte("catdog")
	got, err := SplitPageExtra(buf, []uint64{0, 3, 3, 6})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"", "cat", "", "dog"}
	for i, w := range want {
		if string(got[i]) != w || (w == "" && got[i] != nil) {
			t.Errorf("page %d: %q, want %q", i, got[i], w)
		}
	}
	if got[1] = append(got[1], 'x'); string(buf) != "catdog" {
		t.Errorf("a piece's capacity reaches into the next one: %q", buf)
	}
	for name, ends := range map[string][]uint64{
		"decreasing":      {3, 2},
		"past the buffer": {7},
		"over the limit":  {maxPageExtraTotal + 1},
	} {
		if _, err := SplitPageExtra(buf, ends); !errors.Is(err, kvcache.ErrInvalidRequest) {
			t.Errorf("%s: %v, want ErrInvalidRequest", name, err)
		}
	}
	if got, err := SplitPageExtra(nil, nil); got != nil || err != nil {
		t.Errorf("no ends: %v, %v", got, err)
	}
}

// The keyed admission shares as the material says, through the bridge.
func TestAdmitTokensKeyed(t *testing.T) {
	h := newTestPool(t)
	toks := make([]int32, 50) // 3 full pages of 16 + 2 tokens
	for i := range toks {
		toks[i] = int32(7000 + i)
	}
	admit := func(id string, extra [][]byte) (Handle, int64) {
		t.Helper()
		table := make([]int32, 8)
		l, n, err := AdmitTokensKeyed(h, id, "b", toks, 4, "", extra, 0, table)
		if err != nil {
			t.Fatal(err)
		}
		if n != 4 {
			t.Fatalf("table of %d pages, want 4", n)
		}
		hit, err := HitTokens(l)
		if err != nil {
			t.Fatal(err)
		}
		return l, hit
	}
	pub, _ := admit("pub", [][]byte{nil, []byte("img")})
	if err := Commit(pub, 50); err != nil {
		t.Fatal(err)
	}
	if _, err := CachePrefix(pub, 50); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		id    string
		extra [][]byte
		hit   int64
	}{{"same", [][]byte{nil, []byte("img")}, 48}, {"other", [][]byte{nil, []byte("gmi")}, 16}, {"none", nil, 16}} {
		l, hit := admit(c.id, c.extra)
		if hit != c.hit {
			t.Errorf("%s: hit %d tokens, want %d", c.id, hit, c.hit)
		}
		Free(l)
	}
	if err := ClearPrefixCache(h); err != nil {
		t.Fatal(err)
	}
	l, hit := admit("after", [][]byte{nil, []byte("img")})
	if hit != 0 {
		t.Errorf("a hit of %d tokens after the cache was dropped", hit)
	}
	Free(l)
	Free(pub)
	if err := Check(h); err != nil {
		t.Fatal(err)
	}
	if err := ClearPrefixCache(0); !errors.Is(err, ErrInvalidHandle) {
		t.Errorf("bad handle: %v", err)
	}
}

func TestRankConfigStepLag(t *testing.T) {
	cfg, err := ParseRankConfig([]byte(`{"connect": "unix:/x", "rank": 0, "step_lag": 1}`))
	if err != nil || cfg.StepLag != 1 {
		t.Fatalf("%+v, %v", cfg, err)
	}
	for _, js := range []string{`{"connect": "unix:/x", "rank": 0, "step_lag": -1}`, `{"connect": "unix:/x", "rank": 0, "step_lag": 9}`} {
		if _, err := ParseRankConfig([]byte(js)); !errors.Is(err, kvcache.ErrInvalidConfig) || !strings.Contains(err.Error(), "step_lag") {
			t.Errorf("%s: %v", js, err)
		}
	}
}
