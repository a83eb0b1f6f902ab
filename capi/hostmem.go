//go:build cgo

package main

// The one conversion of a host address from C into Go memory: a host
// pool's "cache" region adopting an engine's buffer ("memory": {"base",
// "bytes"}). The engine keeps the buffer alive until kvf_pool_destroy
// (kvfence.h); Go never frees or moves it.

/*
#include <stdint.h>
static inline void *kvf_host_ptr(uint64_t addr) { return (void *)(uintptr_t)addr; }
*/
import "C"

import (
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
)

func init() {
	bridge.HostMemory = func(base uint64, n int64) []byte {
		return unsafe.Slice((*byte)(C.kvf_host_ptr(C.uint64_t(base))), n)
	}
}
