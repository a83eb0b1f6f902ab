//go:build cgo

package cudaops

// This file is the only place where kvfence touches the CUDA driver. It
// opens libcuda.so.1 with dlopen at run time (never at link time, so the
// binary starts on machines without a driver and links only libc and
// libdl), resolves the versioned entry points with dlsym into a table, and
// calls through it. No CUDA header is needed: the few types are declared
// here as the ABI defines them (handles are pointers, CUdeviceptr is a
// 64-bit integer, CUresult an int).
//
// Copies that read or write Go memory (memcpyHtoDSync, memcpyDtoHSync)
// queue the copy and drain the stream inside one C call, so C never holds a
// Go pointer after returning (the cgo pointer rules).

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream, *CUevent;

static struct {
	CUresult (*Init)(unsigned);
	CUresult (*GetErrorName)(CUresult, const char **);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*DeviceGetName)(char *, int, CUdevice);
	CUresult (*DeviceTotalMem)(size_t *, CUdevice);
	CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*PrimaryCtxRelease)(CUdevice);
	CUresult (*CtxPushCurrent)(CUcontext);
	CUresult (*CtxPopCurrent)(CUcontext *);
	CUresult (*CtxGetDevice)(CUdevice *);
	CUresult (*CtxSynchronize)(void);
	CUresult (*ThreadExchangeStreamCaptureMode)(int *);
	CUresult (*PointerGetAttribute)(void *, int, CUdeviceptr);
	CUresult (*MemGetInfo)(size_t *, size_t *);
	CUresult (*MemAlloc)(CUdeviceptr *, size_t);
	CUresult (*MemFree)(CUdeviceptr);
	CUresult (*MemAllocHost)(void **, size_t);
	CUresult (*MemFreeHost)(void *);
	CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
	CUresult (*MemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
	CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
	CUresult (*MemsetD32Async)(CUdeviceptr, unsigned, size_t, CUstream);
	CUresult (*MemsetD2D32Async)(CUdeviceptr, size_t, unsigned, size_t, size_t, CUstream);
	CUresult (*ModuleLoadDataEx)(CUmodule *, const void *, unsigned, int *, void **);
	CUresult (*ModuleUnload)(CUmodule);
	CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
	CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **);
	CUresult (*StreamCreate)(CUstream *, unsigned);
	CUresult (*StreamDestroy)(CUstream);
	CUresult (*StreamSynchronize)(CUstream);
	CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned);
	CUresult (*StreamGetCtx)(CUstream, CUcontext *);
	CUresult (*StreamIsCapturing)(CUstream, int *);
	CUresult (*EventCreate)(CUevent *, unsigned);
	CUresult (*EventRecord)(CUevent, CUstream);
	CUresult (*EventQuery)(CUevent);
	CUresult (*EventSynchronize)(CUevent);
	CUresult (*EventDestroy)(CUevent);
	CUresult (*EventElapsedTime)(float *, CUevent, CUevent);
} kvf;

// kvf_load opens the driver and fills kvf. It returns 0, or 1 with the
// loader's message in msg, or 2 with the missing symbol's name in msg.
static int kvf_load(char *msg, size_t n) {
	void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		const char *e = dlerror();
		snprintf(msg, n, "%s", e ? e : "dlopen libcuda.so.1 failed");
		return 1;
	}
#define SYM(field, name) \
	if (!(*(void **)&kvf.field = dlsym(lib, name))) { snprintf(msg, n, "%s", name); return 2; }
	SYM(Init, "cuInit")
	SYM(GetErrorName, "cuGetErrorName")
	SYM(DeviceGet, "cuDeviceGet")
	SYM(DeviceGetName, "cuDeviceGetName")
	SYM(DeviceTotalMem, "cuDeviceTotalMem_v2")
	SYM(PrimaryCtxRetain, "cuDevicePrimaryCtxRetain")
	SYM(PrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2")
	SYM(CtxPushCurrent, "cuCtxPushCurrent_v2")
	SYM(CtxPopCurrent, "cuCtxPopCurrent_v2")
	SYM(CtxGetDevice, "cuCtxGetDevice")
	SYM(CtxSynchronize, "cuCtxSynchronize")
	SYM(ThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode")
	SYM(PointerGetAttribute, "cuPointerGetAttribute")
	SYM(MemGetInfo, "cuMemGetInfo_v2")
	SYM(MemAlloc, "cuMemAlloc_v2")
	SYM(MemFree, "cuMemFree_v2")
	SYM(MemAllocHost, "cuMemAllocHost_v2")
	SYM(MemFreeHost, "cuMemFreeHost")
	SYM(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2")
	SYM(MemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2")
	SYM(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2")
	SYM(MemsetD32Async, "cuMemsetD32Async")
	SYM(MemsetD2D32Async, "cuMemsetD2D32Async")
	SYM(ModuleLoadDataEx, "cuModuleLoadDataEx")
	SYM(ModuleUnload, "cuModuleUnload")
	SYM(ModuleGetFunction, "cuModuleGetFunction")
	SYM(LaunchKernel, "cuLaunchKernel")
	SYM(StreamCreate, "cuStreamCreate")
	SYM(StreamDestroy, "cuStreamDestroy_v2")
	SYM(StreamSynchronize, "cuStreamSynchronize")
	SYM(StreamWaitEvent, "cuStreamWaitEvent")
	SYM(StreamGetCtx, "cuStreamGetCtx")
	SYM(StreamIsCapturing, "cuStreamIsCapturing")
	SYM(EventCreate, "cuEventCreate")
	SYM(EventRecord, "cuEventRecord")
	SYM(EventQuery, "cuEventQuery")
	SYM(EventSynchronize, "cuEventSynchronize")
	SYM(EventDestroy, "cuEventDestroy_v2")
	SYM(EventElapsedTime, "cuEventElapsedTime")
#undef SYM
	return 0;
}

static const char *kvf_error_name(CUresult r) {
	const char *s = NULL;
	if (kvf.GetErrorName(r, &s) != 0) return NULL;
	return s;
}

static CUresult kvf_init(void) { return kvf.Init(0); }
static CUresult kvf_device_get(CUdevice *d, int ord) { return kvf.DeviceGet(d, ord); }
static CUresult kvf_device_name(char *b, int n, CUdevice d) { return kvf.DeviceGetName(b, n, d); }
static CUresult kvf_device_total_mem(size_t *b, CUdevice d) { return kvf.DeviceTotalMem(b, d); }
static CUresult kvf_primary_retain(uintptr_t *c, CUdevice d) { return kvf.PrimaryCtxRetain((CUcontext *)c, d); }
static CUresult kvf_primary_release(CUdevice d) { return kvf.PrimaryCtxRelease(d); }
static CUresult kvf_ctx_push(uintptr_t c) { return kvf.CtxPushCurrent((CUcontext)c); }
static CUresult kvf_ctx_pop(void) { CUcontext c; return kvf.CtxPopCurrent(&c); }
static CUresult kvf_ctx_get_device(CUdevice *d) { return kvf.CtxGetDevice(d); }
static CUresult kvf_ctx_sync(void) { return kvf.CtxSynchronize(); }
static CUresult kvf_exchange_capture_mode(int *mode) { return kvf.ThreadExchangeStreamCaptureMode(mode); }
// kvf_pointer_info asks for the three attributes kvfence checks at
// adoption; which says which query failed.
static CUresult kvf_pointer_info(CUdeviceptr p, uintptr_t *ctx, unsigned *type, int *ordinal, int *which) {
	CUcontext c = NULL;
	CUresult r;
	*which = 0;
	if ((r = kvf.PointerGetAttribute(type, 2, p)) != 0) return r;      // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
	*which = 1;
	if ((r = kvf.PointerGetAttribute(ordinal, 9, p)) != 0) return r;   // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
	*which = 2;
	if ((r = kvf.PointerGetAttribute(&c, 1, p)) != 0) return r;        // CU_POINTER_ATTRIBUTE_CONTEXT
	*ctx = (uintptr_t)c;
	return 0;
}
static CUresult kvf_mem_get_info(size_t *f, size_t *t) { return kvf.MemGetInfo(f, t); }
static CUresult kvf_mem_alloc(CUdeviceptr *p, size_t n) { return kvf.MemAlloc(p, n); }
static CUresult kvf_mem_free(CUdeviceptr p) { return kvf.MemFree(p); }
static CUresult kvf_mem_alloc_host(void **p, size_t n) { return kvf.MemAllocHost(p, n); }
static CUresult kvf_mem_free_host(void *p) { return kvf.MemFreeHost(p); }
static CUresult kvf_htod_async(CUdeviceptr d, const void *h, size_t n, uintptr_t s) {
	return kvf.MemcpyHtoDAsync(d, h, n, (CUstream)s);
}
static CUresult kvf_dtod_async(CUdeviceptr dst, CUdeviceptr src, size_t n, uintptr_t s) {
	return kvf.MemcpyDtoDAsync(dst, src, n, (CUstream)s);
}
static CUresult kvf_dtoh_async(void *h, CUdeviceptr d, size_t n, uintptr_t s) {
	return kvf.MemcpyDtoHAsync(h, d, n, (CUstream)s);
}
static CUresult kvf_htod_sync(CUdeviceptr d, const void *h, size_t n, uintptr_t s, int *which) {
	CUresult r = kvf.MemcpyHtoDAsync(d, h, n, (CUstream)s);
	*which = 0;
	if (r != 0) return r;
	*which = 1;
	return kvf.StreamSynchronize((CUstream)s);
}
static CUresult kvf_dtoh_sync(void *h, CUdeviceptr d, size_t n, uintptr_t s, int *which) {
	CUresult r = kvf.MemcpyDtoHAsync(h, d, n, (CUstream)s);
	*which = 0;
	if (r != 0) return r;
	*which = 1;
	return kvf.StreamSynchronize((CUstream)s);
}
static CUresult kvf_memset_d32(CUdeviceptr d, unsigned w, size_t n, uintptr_t s) {
	return kvf.MemsetD32Async(d, w, n, (CUstream)s);
}
static CUresult kvf_memset_d2d32(CUdeviceptr d, size_t pitch, unsigned w, size_t width, size_t height, uintptr_t s) {
	return kvf.MemsetD2D32Async(d, pitch, w, width, height, (CUstream)s);
}
// kvf_module_load JIT-compiles a PTX image, keeping the JIT's error log
// in log (NUL-terminated) when it fails.
static CUresult kvf_module_load(uintptr_t *m, const void *image, char *log, size_t log_len) {
	int opts[2] = {5, 6}; // CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES
	void *vals[2] = {log, (void *)log_len};
	log[0] = 0;
	return kvf.ModuleLoadDataEx((CUmodule *)m, image, 2, opts, vals);
}
static CUresult kvf_module_unload(uintptr_t m) { return kvf.ModuleUnload((CUmodule)m); }
static CUresult kvf_module_function(uintptr_t *f, uintptr_t m, const char *name) {
	return kvf.ModuleGetFunction((CUfunction *)f, (CUmodule)m, name);
}
// kvf_launch launches f with the n arguments whose bytes lie in buf at
// offs[i], as many as the kernel declares for each. cuLaunchKernel copies
// them before it returns, so buf is not referenced afterwards.
#define KVF_MAX_ARGS 32
static CUresult kvf_launch(uintptr_t f, unsigned gx, unsigned gy, unsigned gz, unsigned block, uintptr_t s,
		unsigned char *buf, const unsigned *offs, int n) {
	void *params[KVF_MAX_ARGS];
	if (n < 0 || n > KVF_MAX_ARGS) return 1; // CUDA_ERROR_INVALID_VALUE
	for (int i = 0; i < n; i++) params[i] = buf + offs[i];
	return kvf.LaunchKernel((CUfunction)f, gx, gy, gz, block, 1, 1, 0, (CUstream)s, params, NULL);
}
static CUresult kvf_stream_create(uintptr_t *s, unsigned flags) { return kvf.StreamCreate((CUstream *)s, flags); }
static CUresult kvf_stream_destroy(uintptr_t s) { return kvf.StreamDestroy((CUstream)s); }
static CUresult kvf_stream_sync(uintptr_t s) { return kvf.StreamSynchronize((CUstream)s); }
static CUresult kvf_stream_wait_event(uintptr_t s, uintptr_t e) {
	return kvf.StreamWaitEvent((CUstream)s, (CUevent)e, 0);
}
static CUresult kvf_stream_get_ctx(uintptr_t s, uintptr_t *c) { return kvf.StreamGetCtx((CUstream)s, (CUcontext *)c); }
static CUresult kvf_stream_is_capturing(uintptr_t s, int *status) { return kvf.StreamIsCapturing((CUstream)s, status); }
static CUresult kvf_event_create(uintptr_t *e, unsigned flags) { return kvf.EventCreate((CUevent *)e, flags); }
static CUresult kvf_event_record(uintptr_t e, uintptr_t s) { return kvf.EventRecord((CUevent)e, (CUstream)s); }
static CUresult kvf_event_query(uintptr_t e) { return kvf.EventQuery((CUevent)e); }
static CUresult kvf_event_sync(uintptr_t e) { return kvf.EventSynchronize((CUevent)e); }
static CUresult kvf_event_destroy(uintptr_t e) { return kvf.EventDestroy((CUevent)e); }
static CUresult kvf_event_elapsed(float *ms, uintptr_t a, uintptr_t b) { return kvf.EventElapsedTime(ms, (CUevent)a, (CUevent)b); }
*/
import "C"

import (
	"fmt"
	"sync"
	"time"
	"unsafe"
)

// dl is the driver reached through dlopen. It has no state of its own: the
// function table is process-wide, loaded once and never unloaded (contexts
// may outlive any one device).
type dl struct{}

var (
	dlOnce sync.Once
	dlErr  error
)

// loadDriver opens libcuda.so.1 once per process. A missing library or
// symbol is ErrNoDevice: this machine cannot run the CUDA backend.
func loadDriver() (driver, error) {
	dlOnce.Do(func() {
		var msg [512]C.char
		switch C.kvf_load(&msg[0], C.size_t(len(msg))) {
		case 0:
		case 1:
			dlErr = fmt.Errorf("%w: %s", ErrNoDevice, C.GoString(&msg[0]))
		default:
			dlErr = fmt.Errorf("%w: libcuda.so.1 lacks %s (driver too old)", ErrNoDevice, C.GoString(&msg[0]))
		}
	})
	if dlErr != nil {
		return nil, dlErr
	}
	return dl{}, nil
}

// check turns a CUresult into nil or a *DriverError naming call.
func check(call string, r C.CUresult) error {
	if r == 0 {
		return nil
	}
	name := cuResultName(int(r))
	if s := C.kvf_error_name(r); s != nil {
		name = C.GoString(s)
	}
	return &DriverError{Call: call, Code: int(r), Name: name}
}

func (dl) init() error { return check("cuInit", C.kvf_init()) }

func (dl) deviceGet(ordinal int) (int32, error) {
	var d C.CUdevice
	err := check("cuDeviceGet", C.kvf_device_get(&d, C.int(ordinal)))
	return int32(d), err
}

func (dl) deviceName(dev int32) (string, error) {
	var b [256]C.char
	if err := check("cuDeviceGetName", C.kvf_device_name(&b[0], C.int(len(b)), C.CUdevice(dev))); err != nil {
		return "", err
	}
	return C.GoString(&b[0]), nil
}

func (dl) deviceTotalMem(dev int32) (uint64, error) {
	var n C.size_t
	err := check("cuDeviceTotalMem_v2", C.kvf_device_total_mem(&n, C.CUdevice(dev)))
	return uint64(n), err
}

func (dl) primaryCtxRetain(dev int32) (uintptr, error) {
	var c C.uintptr_t
	err := check("cuDevicePrimaryCtxRetain", C.kvf_primary_retain(&c, C.CUdevice(dev)))
	return uintptr(c), err
}

func (dl) primaryCtxRelease(dev int32) error {
	return check("cuDevicePrimaryCtxRelease_v2", C.kvf_primary_release(C.CUdevice(dev)))
}

func (dl) ctxPush(ctx uintptr) error {
	return check("cuCtxPushCurrent_v2", C.kvf_ctx_push(C.uintptr_t(ctx)))
}

func (dl) ctxPop() error { return check("cuCtxPopCurrent_v2", C.kvf_ctx_pop()) }

func (dl) ctxGetDevice() (int32, error) {
	var d C.CUdevice
	err := check("cuCtxGetDevice", C.kvf_ctx_get_device(&d))
	return int32(d), err
}

func (dl) ctxSynchronize() error { return check("cuCtxSynchronize", C.kvf_ctx_sync()) }

func (dl) exchangeCaptureMode(mode int) (int, error) {
	m := C.int(mode)
	err := check("cuThreadExchangeStreamCaptureMode", C.kvf_exchange_capture_mode(&m))
	return int(m), err
}

func (dl) pointerInfo(p uint64) (ptrInfo, error) {
	var (
		ctx     C.uintptr_t
		typ     C.unsigned
		ordinal C.int
		which   C.int
	)
	r := C.kvf_pointer_info(C.CUdeviceptr(p), &ctx, &typ, &ordinal, &which)
	if err := check([3]string{"cuPointerGetAttribute(MEMORY_TYPE)", "cuPointerGetAttribute(DEVICE_ORDINAL)",
		"cuPointerGetAttribute(CONTEXT)"}[which], r); err != nil {
		return ptrInfo{}, err
	}
	return ptrInfo{ctx: uintptr(ctx), memType: int(typ), ordinal: int32(ordinal)}, nil
}

func (dl) memGetInfo() (free, total uint64, err error) {
	var f, t C.size_t
	err = check("cuMemGetInfo_v2", C.kvf_mem_get_info(&f, &t))
	return uint64(f), uint64(t), err
}

func (dl) memAlloc(n uint64) (uint64, error) {
	var p C.CUdeviceptr
	err := check("cuMemAlloc_v2", C.kvf_mem_alloc(&p, C.size_t(n)))
	return uint64(p), err
}

func (dl) memFree(p uint64) error { return check("cuMemFree_v2", C.kvf_mem_free(C.CUdeviceptr(p))) }

func (dl) memAllocHost(n int) ([]byte, error) {
	var p unsafe.Pointer
	if err := check("cuMemAllocHost_v2", C.kvf_mem_alloc_host(&p, C.size_t(n))); err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(p), n), nil
}

func (dl) memFreeHost(b []byte) error {
	return check("cuMemFreeHost", C.kvf_mem_free_host(unsafe.Pointer(unsafe.SliceData(b))))
}

func (dl) memcpyHtoDAsync(dst uint64, src []byte, s uintptr) error {
	if len(src) == 0 {
		return nil
	}
	return check("cuMemcpyHtoDAsync_v2", C.kvf_htod_async(C.CUdeviceptr(dst),
		unsafe.Pointer(unsafe.SliceData(src)), C.size_t(len(src)), C.uintptr_t(s)))
}

func (dl) memcpyDtoHAsync(dst []byte, src uint64, s uintptr) error {
	if len(dst) == 0 {
		return nil
	}
	return check("cuMemcpyDtoHAsync_v2", C.kvf_dtoh_async(unsafe.Pointer(unsafe.SliceData(dst)), C.CUdeviceptr(src),
		C.size_t(len(dst)), C.uintptr_t(s)))
}

func (dl) memcpyDtoDAsync(dst, src, n uint64, s uintptr) error {
	if n == 0 {
		return nil
	}
	return check("cuMemcpyDtoDAsync_v2", C.kvf_dtod_async(C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n), C.uintptr_t(s)))
}

func (dl) memcpyHtoDSync(dst uint64, src []byte, s uintptr) error {
	if len(src) == 0 {
		return nil
	}
	var which C.int
	r := C.kvf_htod_sync(C.CUdeviceptr(dst), unsafe.Pointer(unsafe.SliceData(src)),
		C.size_t(len(src)), C.uintptr_t(s), &which)
	return check([2]string{"cuMemcpyHtoDAsync_v2", "cuStreamSynchronize"}[which], r)
}

func (dl) memcpyDtoHSync(dst []byte, src uint64, s uintptr) error {
	if len(dst) == 0 {
		return nil
	}
	var which C.int
	r := C.kvf_dtoh_sync(unsafe.Pointer(unsafe.SliceData(dst)), C.CUdeviceptr(src),
		C.size_t(len(dst)), C.uintptr_t(s), &which)
	return check([2]string{"cuMemcpyDtoHAsync_v2", "cuStreamSynchronize"}[which], r)
}

func (dl) memsetD32Async(dst uint64, word uint32, n uint64, s uintptr) error {
	return check("cuMemsetD32Async", C.kvf_memset_d32(C.CUdeviceptr(dst), C.unsigned(word), C.size_t(n), C.uintptr_t(s)))
}

func (dl) memsetD2D32Async(dst, pitch uint64, word uint32, width, height uint64, s uintptr) error {
	return check("cuMemsetD2D32Async", C.kvf_memset_d2d32(C.CUdeviceptr(dst), C.size_t(pitch),
		C.unsigned(word), C.size_t(width), C.size_t(height), C.uintptr_t(s)))
}

func (dl) moduleLoadData(image []byte) (uintptr, string, error) {
	// The driver reads a PTX image up to its NUL; give it a C copy that
	// has one.
	p := C.CBytes(append(image[:len(image):len(image)], 0))
	defer C.free(p)
	var log [4096]C.char
	var m C.uintptr_t
	if err := check("cuModuleLoadDataEx", C.kvf_module_load(&m, p, &log[0], C.size_t(len(log)))); err != nil {
		return 0, C.GoString(&log[0]), err
	}
	return uintptr(m), "", nil
}

func (dl) moduleUnload(m uintptr) error {
	return check("cuModuleUnload", C.kvf_module_unload(C.uintptr_t(m)))
}

func (dl) moduleGetFunction(m uintptr, name string) (uintptr, error) {
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	var f C.uintptr_t
	err := check("cuModuleGetFunction", C.kvf_module_function(&f, C.uintptr_t(m), cs))
	return uintptr(f), err
}

func (dl) launchKernel(fn uintptr, grid [3]uint32, block uint32, s uintptr, args *kernelArgs) error {
	n := len(args.offs)
	if n == 0 || n > maxKernelArgs {
		return &DriverError{Call: "cuLaunchKernel", Code: cuErrorInvalidValue, Name: cuResultName(cuErrorInvalidValue)}
	}
	return check("cuLaunchKernel", C.kvf_launch(C.uintptr_t(fn), C.unsigned(grid[0]), C.unsigned(grid[1]), C.unsigned(grid[2]),
		C.unsigned(block), C.uintptr_t(s), (*C.uchar)(unsafe.Pointer(unsafe.SliceData(args.buf))),
		(*C.unsigned)(unsafe.Pointer(unsafe.SliceData(args.offs))), C.int(n)))
}

func (dl) streamCreate(flags uint32) (uintptr, error) {
	var s C.uintptr_t
	err := check("cuStreamCreate", C.kvf_stream_create(&s, C.unsigned(flags)))
	return uintptr(s), err
}

func (dl) streamDestroy(s uintptr) error {
	return check("cuStreamDestroy_v2", C.kvf_stream_destroy(C.uintptr_t(s)))
}

func (dl) streamSynchronize(s uintptr) error {
	return check("cuStreamSynchronize", C.kvf_stream_sync(C.uintptr_t(s)))
}

func (dl) streamWaitEvent(s, ev uintptr) error {
	return check("cuStreamWaitEvent", C.kvf_stream_wait_event(C.uintptr_t(s), C.uintptr_t(ev)))
}

func (dl) streamGetCtx(s uintptr) (uintptr, error) {
	var c C.uintptr_t
	err := check("cuStreamGetCtx", C.kvf_stream_get_ctx(C.uintptr_t(s), &c))
	return uintptr(c), err
}

func (dl) streamIsCapturing(s uintptr) (int, error) {
	var st C.int
	err := check("cuStreamIsCapturing", C.kvf_stream_is_capturing(C.uintptr_t(s), &st))
	return int(st), err
}

func (dl) eventCreate(flags uint32) (uintptr, error) {
	var e C.uintptr_t
	err := check("cuEventCreate", C.kvf_event_create(&e, C.unsigned(flags)))
	return uintptr(e), err
}

func (dl) eventRecord(ev, s uintptr) error {
	return check("cuEventRecord", C.kvf_event_record(C.uintptr_t(ev), C.uintptr_t(s)))
}

func (dl) eventQuery(ev uintptr) (bool, error) {
	r := C.kvf_event_query(C.uintptr_t(ev))
	if r == cuErrorNotReady {
		return false, nil
	}
	return r == 0, check("cuEventQuery", r)
}

func (dl) eventSynchronize(ev uintptr) error {
	return check("cuEventSynchronize", C.kvf_event_sync(C.uintptr_t(ev)))
}

func (dl) eventDestroy(ev uintptr) error {
	return check("cuEventDestroy_v2", C.kvf_event_destroy(C.uintptr_t(ev)))
}

func (dl) eventElapsed(start, end uintptr) (time.Duration, error) {
	var ms C.float
	if err := check("cuEventElapsedTime", C.kvf_event_elapsed(&ms, C.uintptr_t(start), C.uintptr_t(end))); err != nil {
		return 0, err
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}
