//go:build cgo

package main

// Handoff, prefill side: exports of a prefilled lease, their manifest and
// pages. The caller carries the bytes.

// #include "lasterror.h"
import "C"

import "github.com/kvfence/kvfence/capi/internal/bridge"

func transferInfo(ti bridge.TransferInfo, out *C.kvf_transfer_info) {
	*out = C.kvf_transfer_info{
		pages:          C.int64_t(ti.Pages),
		page_bytes:     C.int64_t(ti.PageBytes),
		prompt_tokens:  C.int64_t(ti.PromptTokens),
		max_new_tokens: C.int64_t(ti.MaxNewTokens),
		checksum:       C.uint32_t(ti.Checksum),
	}
	if ti.Live {
		out.live = 1
	}
}

//export kvf_export_create
func kvf_export_create(lease C.kvf_lease, key *C.uint8_t, keyLen C.size_t, maxNewTokens, ttlMS C.int64_t, out *C.kvf_export) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	k, err := cBytes(key, keyLen, "key")
	if err != nil {
		return fail(err)
	}
	h, err := bridge.Export(uint64(lease), k, int64(maxNewTokens), waitDuration(ttlMS))
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_export(h)
	return C.KVF_OK
}

//export kvf_export_manifest
func kvf_export_manifest(export C.kvf_export, buf *C.uint8_t, bufLen C.size_t, length *C.size_t) (st C.kvf_status) {
	defer guard(&st)
	dst, err := cBytes(buf, bufLen, "buf")
	if err != nil {
		return fail(err)
	}
	n, err := bridge.ExportManifest(uint64(export), dst)
	if length != nil && n > 0 {
		*length = C.size_t(n)
	}
	return result(err)
}

//export kvf_export_describe
func kvf_export_describe(export C.kvf_export, out *C.kvf_transfer_info) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	ti, err := bridge.DescribeExport(uint64(export))
	if err != nil {
		return fail(err)
	}
	transferInfo(ti, out)
	return C.KVF_OK
}

//export kvf_export_read_pages
func kvf_export_read_pages(export C.kvf_export, firstPage C.int64_t, buf *C.uint8_t, bufLen C.size_t) (st C.kvf_status) {
	defer guard(&st)
	dst, err := cPages(buf, bufLen, firstPage, "read")
	if err != nil {
		return fail(err)
	}
	return result(bridge.ExportReadPages(uint64(export), int64(firstPage), dst))
}

//export kvf_export_ack
func kvf_export_ack(export C.kvf_export) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.ExportAck(uint64(export)))
}

//export kvf_export_abort
func kvf_export_abort(export C.kvf_export) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.ExportAbort(uint64(export)))
}

//export kvf_export_free
func kvf_export_free(export C.kvf_export) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.FreeExport(uint64(export)))
}
