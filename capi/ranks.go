//go:build cgo

package main

// Rank workers: the worker side of a tensor-parallel group with one
// process per rank (kvfence.h, "Rank workers", since ABI 5).

// #include "lasterror.h"
import "C"

import (
	"github.com/kvfence/kvfence/capi/internal/bridge"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

//export kvf_rank_worker_create
func kvf_rank_worker_create(configJSON *C.char, regions *C.kvf_region, nRegions C.size_t, out *C.kvf_rank_worker) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	js, err := cString(configJSON, "config_json", kvcache.ErrInvalidConfig)
	if err != nil {
		return fail(err)
	}
	cfg, err := bridge.ParseRankConfig([]byte(js))
	if err != nil {
		return fail(err)
	}
	crs, err := cSlice(regions, nRegions, "regions")
	if err != nil {
		return fail(err)
	}
	rs := make([]bridge.RankRegion, len(crs))
	for i, cr := range crs {
		rs[i] = bridge.RankRegion{Base: uint64(cr.base), Stride: int64(cr.stride), PageBytes: int64(cr.page_bytes), Pages: int64(cr.pages)}
		if cfg.Device.Kind == bridge.DeviceHost && rs[i].Base != 0 {
			// The device adopts the caller's memory: view its extent,
			// checked first, so that nothing past it is ever touched.
			n, err := rs[i].Extent()
			if err != nil {
				return fail(err)
			}
			rs[i].Host = bridge.HostMemory(uint64(cr.base), n) // hostmem.go's conversion
		}
	}
	h, err := bridge.CreateRankWorker(cfg, rs)
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_rank_worker(h)
	return C.KVF_OK
}

//export kvf_rank_step
func kvf_rank_step(worker C.kvf_rank_worker, stream, event C.uintptr_t, launched *C.size_t) (st C.kvf_status) {
	defer guard(&st)
	n, err := bridge.RankStep(uint64(worker), cudaops.Ordering{Stream: uintptr(stream), Event: uintptr(event)})
	if launched != nil {
		*launched = C.size_t(n)
	}
	return result(err)
}

//export kvf_rank_worker_wait
func kvf_rank_worker_wait(worker C.kvf_rank_worker, waitMS C.int64_t, ended *C.int32_t) (st C.kvf_status) {
	defer guard(&st)
	done, err := bridge.RankWait(uint64(worker), waitDuration(waitMS))
	if ended != nil {
		*ended = 0
		if done {
			*ended = 1
		}
	}
	return result(err)
}

//export kvf_rank_worker_regions
func kvf_rank_worker_regions(worker C.kvf_rank_worker, buf *C.kvf_region, bufLen C.size_t, length *C.size_t) (st C.kvf_status) {
	defer guard(&st)
	dst, err := cSlice(buf, bufLen, "buf")
	if err != nil {
		return fail(err)
	}
	rs, err := bridge.RankRegions(uint64(worker), len(dst))
	if n := bridge.Classify(err).Need; err != nil && n > 0 && length != nil {
		*length = C.size_t(n) // a short buffer: the count needed
	}
	if err != nil {
		return fail(err)
	}
	if length != nil {
		*length = C.size_t(len(rs))
	}
	for i, r := range rs {
		dst[i] = C.kvf_region{base: C.uint64_t(r.Base), stride: C.int64_t(r.Stride), page_bytes: C.int64_t(r.PageBytes), pages: C.int64_t(r.Pages)}
	}
	return C.KVF_OK
}

//export kvf_rank_worker_close
func kvf_rank_worker_close(worker C.kvf_rank_worker) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.CloseRankWorker(uint64(worker)))
}
