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
// is advised MADV_HUGEPAGE, and the kernel takes the advice (it marks the
// mapping "hg" in /proc/self/smaps); a smaller one is left as the
// allocator made it. Which memory was advised is read from the calls, not
// from smaps, for the small region: the Go heap may give it memory that an
// earlier large region of this process had (another test's, or this
// one's under -count), whose mapping keeps the flag.
func TestLargeHostRegionsAskForHugePages(t *testing.T) {
	if b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled"); err != nil || strings.Contains(string(b), "[never]") {
		t.Skip("no transparent huge pages on this kernel")
	}
	var advised [][]byte
	advise := madviseHuge
	madviseHuge = func(mem []byte) {
		advised = append(advised, mem)
		advise(mem)
	}
	defer func() { madviseHuge = advise }()
	h := NewHost()
	defer h.Close()
	_, err := h.AllocRegion(4, hugeRegionBytes/4)
	require.NoError(t, err)
	_, err = h.AllocRegion(4, 1<<20)
	require.NoError(t, err)
	require.Equal(t, 1, len(advised), "regions advised") // not Len: it would print the memory
	large := h.PageBytes(0, 0)
	require.Equal(t, unsafe.SliceData(large), unsafe.SliceData(advised[0]), "the advice is not for the large region")
	require.Equal(t, hugeRegionBytes, len(advised[0]), "the advice does not cover the large region")
	require.True(t, advisedHuge(t, large), "large region not marked hg by the kernel")
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
