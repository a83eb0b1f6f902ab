//go:build linux

package cudaops

import "golang.org/x/sys/unix"

// adviseHuge asks the kernel to back mem with transparent huge pages
// (with THP in "madvise" mode, the default of many distributions, it
// otherwise uses 4 KiB pages). A region is streamed through by fills and
// handoff copies; 2 MiB pages spare those streams a TLB miss and a
// prefetcher restart every 4 KiB. The advice is a hint: an error (an old
// kernel, THP off) changes nothing.
func adviseHuge(mem []byte) {
	if len(mem) < hugeRegionBytes {
		return
	}
	madviseHuge(mem)
}

// madviseHuge is the system call, a variable so that a test can see
// which memory was advised: the kernel's own record (smaps' "hg" flag)
// outlives the memory, which the Go heap may hand out again.
var madviseHuge = func(mem []byte) { unix.Madvise(mem, unix.MADV_HUGEPAGE) }
