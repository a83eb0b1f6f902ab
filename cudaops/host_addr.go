package cudaops

import "unsafe"

// This file is the Host device's only use of unsafe: the address of a
// region's memory, which Region.Base reports so that overlapping adopted
// buffers are refused and engines can build views over the pages (the C
// ABI reports it). Go heap memory does not move, and the device keeps the
// slice referenced, so the address stays valid until Close.
func hostAddr(mem []byte) uint64 {
	if len(mem) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(mem))))
}

// HostRegion describes a region over host memory mem as Host.AdoptRegion
// would register it (Base is mem's address), so that a caller can check
// adopted buffers against each other (Overlap) before it adopts any.
func HostRegion(mem []byte, pages int, stride, pageBytes int64) Region {
	return Region{Base: hostAddr(mem), Stride: stride, PageBytes: pageBytes, Pages: pages}
}
