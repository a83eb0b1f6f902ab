//go:build cgo

package main

// Handoff, decode side: receivers and the imports they begin from a
// manifest.

// #include "lasterror.h"
import "C"

import (
	"github.com/kvfence/kvfence/capi/internal/bridge"
	"github.com/kvfence/kvfence/handoff"
)

//export kvf_receiver_create
func kvf_receiver_create(pool C.kvf_pool, key *C.uint8_t, keyLen C.size_t, configJSON *C.char, out *C.kvf_receiver) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	k, err := cBytes(key, keyLen, "key")
	if err != nil {
		return fail(err)
	}
	cfg, err := optString(configJSON, "config_json", handoff.ErrInvalidConfig)
	if err != nil {
		return fail(err)
	}
	h, err := bridge.CreateReceiver(uint64(pool), k, []byte(cfg))
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_receiver(h)
	return C.KVF_OK
}

//export kvf_receiver_destroy
func kvf_receiver_destroy(receiver C.kvf_receiver) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.DestroyReceiver(uint64(receiver)))
}

//export kvf_import_begin
func kvf_import_begin(receiver C.kvf_receiver, manifest *C.uint8_t, manifestLen C.size_t, out *C.kvf_import) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	if manifest == nil {
		return nullPointer("manifest")
	}
	m, err := cBytes(manifest, manifestLen, "manifest")
	if err != nil {
		return fail(err)
	}
	h, err := bridge.BeginImport(uint64(receiver), m)
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_import(h)
	return C.KVF_OK
}

//export kvf_import_describe
func kvf_import_describe(imp C.kvf_import, out *C.kvf_transfer_info) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	ti, err := bridge.DescribeImport(uint64(imp))
	if err != nil {
		return fail(err)
	}
	transferInfo(ti, out)
	return C.KVF_OK
}

//export kvf_import_write_pages
func kvf_import_write_pages(imp C.kvf_import, firstPage C.int64_t, buf *C.uint8_t, bufLen C.size_t) (st C.kvf_status) {
	defer guard(&st)
	src, err := cPages(buf, bufLen, firstPage, "write")
	if err != nil {
		return fail(err)
	}
	return result(bridge.ImportWritePages(uint64(imp), int64(firstPage), src))
}

//export kvf_import_complete
func kvf_import_complete(imp C.kvf_import, out *C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	h, err := bridge.CompleteImport(uint64(imp))
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_lease(h)
	return C.KVF_OK
}

//export kvf_import_abort
func kvf_import_abort(imp C.kvf_import) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.AbortImport(uint64(imp)))
}

//export kvf_import_free
func kvf_import_free(imp C.kvf_import) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.FreeImport(uint64(imp)))
}
