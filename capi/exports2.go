//go:build cgo

package main

// Exports of ABI version 2: the prefix cache, lease phases, tenant JSON,
// prefix-cache events and the handoff as bytes. Same rules as exports.go.

/*
#cgo CFLAGS: -I${SRCDIR}/include -I${SRCDIR}
#include "lasterror.h"
*/
import "C"

import (
	"math"
	"time"
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
	"github.com/kvfence/kvfence/cudaops"
)

func waitDuration(waitMS C.int64_t) time.Duration {
	return time.Duration(min(int64(waitMS), math.MaxInt64/int64(time.Millisecond))) * time.Millisecond
}

// optString is cString for an optional argument: NULL is "".
func optString(p *C.char, name string) (string, error) {
	if p == nil {
		return "", nil
	}
	return cString(p, name)
}

//export kvf_pool_add_tenant_json
func kvf_pool_add_tenant_json(pool C.kvf_pool, tenantJSON *C.char) (st C.kvf_status) {
	defer guard(&st)
	js, err := cString(tenantJSON, "tenant_json")
	if err != nil {
		return fail(err)
	}
	tc, err := bridge.ParseTenant([]byte(js))
	if err != nil {
		return fail(err)
	}
	return result(bridge.AddTenant(uint64(pool), tc))
}

//export kvf_pool_update_tenant_json
func kvf_pool_update_tenant_json(pool C.kvf_pool, tenantJSON *C.char) (st C.kvf_status) {
	defer guard(&st)
	js, err := cString(tenantJSON, "tenant_json")
	if err != nil {
		return fail(err)
	}
	tc, err := bridge.ParseTenant([]byte(js))
	if err != nil {
		return fail(err)
	}
	return result(bridge.UpdateTenant(uint64(pool), tc))
}

//export kvf_pool_events_json
func kvf_pool_events_json(pool C.kvf_pool, buf *C.char, bufLen C.size_t, needed *C.size_t) (st C.kvf_status) {
	defer guard(&st)
	dst, err := cSlice((*byte)(unsafe.Pointer(buf)), bufLen, "buf")
	if err != nil {
		return fail(err)
	}
	n, err := bridge.Events(uint64(pool), dst)
	if needed != nil && n > 0 {
		*needed = C.size_t(n)
	}
	return result(err)
}

//export kvf_admit_tokens
func kvf_admit_tokens(pool C.kvf_pool, requestID, tenant *C.char, tokenIDs *C.int32_t, nTokens C.size_t,
	maxNewTokens C.int64_t, adapter *C.char, waitMS C.int64_t, out *C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	id, err := cString(requestID, "request_id")
	if err != nil {
		return fail(err)
	}
	tn, err := cString(tenant, "tenant")
	if err != nil {
		return fail(err)
	}
	ad, err := optString(adapter, "adapter")
	if err != nil {
		return fail(err)
	}
	toks, err := cSlice((*int32)(unsafe.Pointer(tokenIDs)), nTokens, "token_ids")
	if err != nil {
		return fail(err)
	}
	h, err := bridge.AdmitTokens(uint64(pool), id, tn, toks, int64(maxNewTokens), ad, waitDuration(waitMS))
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_lease(h)
	return C.KVF_OK
}

//export kvf_lease_hit_tokens
func kvf_lease_hit_tokens(lease C.kvf_lease, out *C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	n, err := bridge.HitTokens(uint64(lease))
	if err != nil {
		return fail(err)
	}
	*out = C.int64_t(n)
	return C.KVF_OK
}

//export kvf_lease_cache_prefix
func kvf_lease_cache_prefix(lease C.kvf_lease, tokens C.int64_t, sharedTokens *C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	n, err := bridge.CachePrefix(uint64(lease), int64(tokens))
	if err != nil {
		return fail(err)
	}
	if sharedTokens != nil {
		*sharedTokens = C.int64_t(n)
	}
	return C.KVF_OK
}

//export kvf_lease_phase
func kvf_lease_phase(lease C.kvf_lease, out *C.int32_t) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	ph, err := bridge.Phase(uint64(lease))
	if err != nil {
		return fail(err)
	}
	*out = C.int32_t(ph)
	return C.KVF_OK
}

//export kvf_lease_begin_prefill
func kvf_lease_begin_prefill(lease C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.BeginPrefill(uint64(lease)))
}

//export kvf_lease_finish_prefill
func kvf_lease_finish_prefill(lease C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.FinishPrefill(uint64(lease)))
}

//export kvf_lease_abort
func kvf_lease_abort(lease C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.Abort(uint64(lease)))
}

// cBytes views a caller byte buffer; NULL only with length 0.
func cBytes(p *C.uint8_t, n C.size_t, name string) ([]byte, error) {
	return cSlice((*byte)(unsafe.Pointer(p)), n, name)
}

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
	dst, err := cBytes(buf, bufLen, "buf")
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
	cfg, err := optString(configJSON, "config_json")
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
	src, err := cBytes(buf, bufLen, "buf")
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

//export kvf_pool_regions
func kvf_pool_regions(pool C.kvf_pool, buf *C.kvf_region, bufLen C.size_t, length *C.size_t) (st C.kvf_status) {
	defer guard(&st)
	dst, err := cSlice(buf, bufLen, "buf")
	if err != nil {
		return fail(err)
	}
	rs := make([]cudaops.Region, len(dst))
	n, err := bridge.Regions(uint64(pool), rs)
	if length != nil && n > 0 {
		*length = C.size_t(n)
	}
	if err != nil {
		return fail(err)
	}
	for i, r := range rs[:n] {
		dst[i] = C.kvf_region{base: C.uint64_t(r.Base), stride: C.int64_t(r.Stride), page_bytes: C.int64_t(r.PageBytes), pages: C.int64_t(r.Pages)}
	}
	return C.KVF_OK
}
