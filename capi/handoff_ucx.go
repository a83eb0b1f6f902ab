//go:build cgo

package main

// Handoff over UCX: a receiver serves imports on an address, a transport
// sends exports there (since ABI 11). The library has UCX when built with
// the tag ucx; otherwise the calls that need it return
// KVF_ERR_UNAVAILABLE.

// #include "lasterror.h"
import "C"

import (
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/kvcache"
)

//export kvf_ucx_available
func kvf_ucx_available() C.int {
	if bridge.UCXAvailable() {
		return 1
	}
	return 0
}

//export kvf_ucx_server_create
func kvf_ucx_server_create(receiver C.kvf_receiver, addr *C.char, optionsJSON *C.char, out *C.kvf_ucx_server) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	a, err := cString(addr, "addr", kvcache.ErrInvalidArgument)
	if err != nil {
		return fail(err)
	}
	opts, err := optString(optionsJSON, "options_json", handoff.ErrInvalidConfig)
	if err != nil {
		return fail(err)
	}
	h, err := bridge.CreateUCXServer(uint64(receiver), a, []byte(opts))
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_ucx_server(h)
	return C.KVF_OK
}

//export kvf_ucx_server_addr
func kvf_ucx_server_addr(server C.kvf_ucx_server, buf *C.char, bufLen C.size_t, needed *C.size_t) (st C.kvf_status) {
	defer guard(&st)
	dst, err := cSlice((*byte)(unsafe.Pointer(buf)), bufLen, "buf")
	if err != nil {
		return fail(err)
	}
	addr, err := bridge.UCXServerAddr(uint64(server))
	if err != nil {
		return fail(err)
	}
	if needed != nil {
		*needed = C.size_t(len(addr) + 1)
	}
	if len(dst) < len(addr)+1 {
		return fail(&bridge.BufferError{What: "address (bytes, NUL included)", Need: len(addr) + 1, Have: len(dst)})
	}
	dst[copy(dst, addr)] = 0
	return C.KVF_OK
}

//export kvf_ucx_server_destroy
func kvf_ucx_server_destroy(server C.kvf_ucx_server) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.DestroyUCXServer(uint64(server)))
}

//export kvf_ucx_transport_create
func kvf_ucx_transport_create(addr *C.char, optionsJSON *C.char, out *C.kvf_ucx_transport) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	a, err := cString(addr, "addr", kvcache.ErrInvalidArgument)
	if err != nil {
		return fail(err)
	}
	opts, err := optString(optionsJSON, "options_json", handoff.ErrInvalidConfig)
	if err != nil {
		return fail(err)
	}
	h, err := bridge.CreateUCXTransport(a, []byte(opts))
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_ucx_transport(h)
	return C.KVF_OK
}

//export kvf_ucx_transport_destroy
func kvf_ucx_transport_destroy(transport C.kvf_ucx_transport) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.DestroyUCXTransport(uint64(transport)))
}

//export kvf_export_send_ucx
func kvf_export_send_ucx(export C.kvf_export, transport C.kvf_ucx_transport, timeoutMS C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.ExportSendUCX(uint64(export), uint64(transport), waitDuration(timeoutMS)))
}

//export kvf_receiver_take
func kvf_receiver_take(receiver C.kvf_receiver, requestID *C.char, out *C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	id, err := cString(requestID, "request_id", kvcache.ErrInvalidRequest)
	if err != nil {
		return fail(err)
	}
	h, err := bridge.ReceiverTake(uint64(receiver), id)
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_lease(h)
	return C.KVF_OK
}
