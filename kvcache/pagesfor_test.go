package kvcache

import "testing"

// TestPagesForRoundsUpForEveryPageSize: the shift that replaces the
// division for power-of-two page sizes gives the same pages as the
// division, and other sizes still divide.
func TestPagesForRoundsUpForEveryPageSize(t *testing.T) {
	for _, tpp := range []int{1, 2, 3, 16, 48, 64, 256, 1000} {
		p := &Pool{tpp: tpp, tppShift: log2Exact(tpp)}
		for _, tokens := range []int{0, 1, tpp - 1, tpp, tpp + 1, 7 * tpp, 7*tpp + 1, 1 << 20, 1<<31 - 1} {
			want := (tokens + tpp - 1) / tpp
			if got := p.pagesFor(tokens); got != want {
				t.Errorf("tpp %d (shift %d): pagesFor(%d) = %d, want %d", tpp, p.tppShift, tokens, got, want)
			}
		}
	}
	for n, want := range map[int]int{0: -1, 1: 0, 2: 1, 3: -1, 16: 4, 48: -1, 1 << 20: 20, -16: -1} {
		if got := log2Exact(n); got != want {
			t.Errorf("log2Exact(%d) = %d, want %d", n, got, want)
		}
	}
}
