//go:build linux

package cudaops

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// TestLargeHostRegionsAskForHugePages: a region of hugeRegionBytes or more
// is advised MADV_HUGEPAGE (the kernel marks the mapping "hg" in
// /proc/self/smaps); a smaller one is left as the allocator made it.
func TestLargeHostRegionsAskForHugePages(t *testing.T) {
	if b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled"); err != nil || strings.Contains(string(b), "[never]") {
		t.Skip("no transparent huge pages on this kernel")
	}
	h := NewHost()
	defer h.Close()
	_, err := h.AllocRegion(4, hugeRegionBytes/4)
	require.NoError(t, err)
	_, err = h.AllocRegion(4, 1<<20)
	require.NoError(t, err)
	require.True(t, advisedHuge(t, h.PageBytes(0, 0)), "large region not advised")
	require.False(t, advisedHuge(t, h.PageBytes(1, 0)), "small region advised")
}

// advisedHuge reports whether the mapping holding b has the hg flag.
func advisedHuge(t *testing.T, b []byte) bool {
	t.Helper()
	addr := uint64(uintptr(unsafe.Pointer(&b[0])))
	f, err := os.Open("/proc/self/smaps")
	require.NoError(t, err)
	defer f.Close()
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if fields := strings.Fields(line); len(fields) > 0 && strings.Contains(fields[0], "-") && !strings.HasSuffix(fields[0], ":") {
			lo, hi, _ := strings.Cut(fields[0], "-")
			l, err1 := strconv.ParseUint(lo, 16, 64)
			h, err2 := strconv.ParseUint(hi, 16, 64)
			in = err1 == nil && err2 == nil && l <= addr && addr < h
			continue
		}
		if in && strings.HasPrefix(line, "VmFlags:") {
			for _, fl := range strings.Fields(strings.TrimPrefix(line, "VmFlags:")) {
				if fl == "hg" {
					return true
				}
			}
			return false
		}
	}
	require.NoError(t, sc.Err())
	t.Fatalf("no mapping holds %#x", addr)
	return false
}
