package cudaops

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"
)

// driver is the slice of the CUDA driver API the CUDA device uses, in Go
// types. The real implementation (cuda_dl_cgo.go) forwards each method to
// one function resolved from libcuda.so.1 with dlsym; tests substitute a
// simulated driver, so everything above this interface (validation, the
// region table, staging, ordering, fences, counters) is tested without a
// GPU, and so is the fill kernel: the simulated driver executes the PTX
// text the device loads (internal/ptx). Handles are the driver's opaque pointers as uintptrs; device
// addresses are uint64 (CUdeviceptr).
//
// Every method that needs a context acts on the one current on the calling
// OS thread; the CUDA device arranges that (see CUDA.enter).
type driver interface {
	init() error
	deviceGet(ordinal int) (int32, error)
	deviceName(dev int32) (string, error)
	deviceTotalMem(dev int32) (uint64, error)
	primaryCtxRetain(dev int32) (uintptr, error)
	primaryCtxRelease(dev int32) error
	ctxPush(ctx uintptr) error
	ctxPop() error
	ctxGetDevice() (int32, error)
	// ctxSynchronize waits for all work queued in the current context, on
	// every stream.
	ctxSynchronize() error
	// exchangeCaptureMode sets the calling thread's stream-capture
	// interaction mode and returns the previous one.
	exchangeCaptureMode(mode int) (int, error)
	memGetInfo() (free, total uint64, err error)
	// pointerInfo reports what the driver knows of device address p: the
	// context it was allocated in (0 for memory no context owns, such as
	// cuMemMap mappings), its memory type and its device ordinal.
	pointerInfo(p uint64) (ptrInfo, error)

	memAlloc(n uint64) (uint64, error)
	memFree(p uint64) error
	// memAllocHost returns page-locked host memory, which async copies
	// may read after the call that queued them has returned.
	memAllocHost(n int) ([]byte, error)
	memFreeHost(b []byte) error
	// memcpyHtoDAsync queues a copy from page-locked memory (from
	// memAllocHost) on stream s.
	memcpyHtoDAsync(dst uint64, src []byte, s uintptr) error
	// memcpyDtoHAsync queues a copy into page-locked memory (from
	// memAllocHost) on stream s.
	memcpyDtoHAsync(dst []byte, src uint64, s uintptr) error
	// memcpyHtoDSync and memcpyDtoHSync queue a copy on stream s and wait
	// for s to drain before returning, so the copy is ordered after all
	// work queued on s and Go memory is never referenced after the call.
	memcpyHtoDSync(dst uint64, src []byte, s uintptr) error
	memcpyDtoHSync(dst []byte, src uint64, s uintptr) error
	// memcpyDtoDAsync queues a copy of n bytes from device address src
	// to device address dst on stream s.
	memcpyDtoDAsync(dst, src, n uint64, s uintptr) error
	memsetD32Async(dst uint64, word uint32, n uint64, s uintptr) error
	memsetD2D32Async(dst, pitch uint64, word uint32, width, height uint64, s uintptr) error

	// moduleLoadData JIT-compiles image; on failure log is the JIT's
	// error log (possibly empty).
	moduleLoadData(image []byte) (m uintptr, log string, err error)
	moduleUnload(m uintptr) error
	moduleGetFunction(m uintptr, name string) (uintptr, error)
	// launchKernel launches fn over grid blocks of block threads on
	// stream s. args holds each argument's bytes and the name of the
	// .param it is for: the real driver passes the bytes (cuLaunchKernel
	// reads as many as the kernel declares), the simulated one checks
	// the names and sizes against the PTX the module was loaded from.
	launchKernel(fn uintptr, grid [3]uint32, block uint32, s uintptr, args *kernelArgs) error

	streamCreate(flags uint32) (uintptr, error)
	streamDestroy(s uintptr) error
	streamSynchronize(s uintptr) error
	streamWaitEvent(s, ev uintptr) error
	// streamGetCtx returns the context stream s belongs to.
	streamGetCtx(s uintptr) (uintptr, error)
	// streamIsCapturing returns s's capture status (cuStreamCaptureNone,
	// Active or Invalidated).
	streamIsCapturing(s uintptr) (int, error)
	eventCreate(flags uint32) (uintptr, error)
	eventRecord(ev, s uintptr) error
	// eventQuery reports whether all work captured by ev has completed;
	// CUDA_ERROR_NOT_READY is (false, nil).
	eventQuery(ev uintptr) (bool, error)
	eventSynchronize(ev uintptr) error
	eventDestroy(ev uintptr) error
	// eventElapsed is the device time between two completed events
	// created with timing (benchmarks only; fences have none).
	eventElapsed(start, end uintptr) (time.Duration, error)
}

// kernelArgs is a launch's argument list, built without allocating once
// its buffers have grown: argument i's bytes are buf[offs[i]:][:sizes[i]],
// each at a 16-byte aligned offset, for the kernel parameter names[i].
type kernelArgs struct {
	buf   []byte
	offs  []uint32
	sizes []uint32
	names []string
}

// maxKernelArgs bounds a launch's arguments (cuda_dl_cgo.go's array).
const maxKernelArgs = 32

func (a *kernelArgs) reset() {
	a.buf, a.offs, a.sizes, a.names = a.buf[:0], a.offs[:0], a.sizes[:0], a.names[:0]
}

// add appends an argument of n bytes for the parameter name and returns
// its bytes to fill in, zeroed.
func (a *kernelArgs) add(name string, n int) []byte {
	off := (len(a.buf) + 15) &^ 15
	a.buf = append(a.buf, make([]byte, off+n-len(a.buf))...)
	a.offs = append(a.offs, uint32(off))
	a.sizes = append(a.sizes, uint32(n))
	a.names = append(a.names, name)
	return a.buf[off : off+n]
}

func (a *kernelArgs) u32(name string, v uint32) { binary.LittleEndian.PutUint32(a.add(name, 4), v) }
func (a *kernelArgs) u64(name string, v uint64) { binary.LittleEndian.PutUint64(a.add(name, 8), v) }

// arg returns argument i's bytes.
func (a *kernelArgs) arg(i int) []byte { return a.buf[a.offs[i] : a.offs[i]+a.sizes[i]] }

// ptrInfo is what cuPointerGetAttribute reports of a device address.
type ptrInfo struct {
	ctx     uintptr // CU_POINTER_ATTRIBUTE_CONTEXT; 0 when no context owns it
	memType int     // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
	ordinal int32   // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
}

// Driver flag and enum values (cuda.h).
const (
	cuStreamNonBlocking     = 0x1 // CU_STREAM_NON_BLOCKING
	cuEventBlockingSync     = 0x1 // CU_EVENT_BLOCKING_SYNC
	cuEventDisableTiming    = 0x2 // CU_EVENT_DISABLE_TIMING
	cuMemoryTypeHost        = 1   // CU_MEMORYTYPE_HOST
	cuMemoryTypeDevice      = 2   // CU_MEMORYTYPE_DEVICE
	cuMemoryTypeUnified     = 4   // CU_MEMORYTYPE_UNIFIED
	cuCaptureModeGlobal     = 0   // CU_STREAM_CAPTURE_MODE_GLOBAL
	cuCaptureModeRelaxed    = 2   // CU_STREAM_CAPTURE_MODE_RELAXED
	cuCaptureStatusNone     = 0   // CU_STREAM_CAPTURE_STATUS_NONE
	cuCaptureStatusActive   = 1   // CU_STREAM_CAPTURE_STATUS_ACTIVE
	cuCaptureStatusInvalid  = 2   // CU_STREAM_CAPTURE_STATUS_INVALIDATED
	cuErrorInvalidContext   = 201 // CUDA_ERROR_INVALID_CONTEXT
	cuErrorCaptureUnsupp    = 900 // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
	cuErrorCaptureInvalid   = 901 // CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
	cuErrorCaptureIsolation = 905 // CUDA_ERROR_STREAM_CAPTURE_ISOLATION
	cuErrorCaptureImplicit  = 906 // CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
	cuErrorCapturedEvent    = 907 // CUDA_ERROR_CAPTURED_EVENT
	cuErrorOutOfMemory      = 2   // CUDA_ERROR_OUT_OF_MEMORY
	cuErrorInvalidValue     = 1   // CUDA_ERROR_INVALID_VALUE
	cuErrorInvalidHandle    = 400 // CUDA_ERROR_INVALID_HANDLE
	cuErrorNotReady         = 600 // CUDA_ERROR_NOT_READY
	cuErrorStubLibrary      = 34  // CUDA_ERROR_STUB_LIBRARY
	cuErrorNoDevice         = 100 // CUDA_ERROR_NO_DEVICE
	cuErrorInvalidDevice    = 101 // CUDA_ERROR_INVALID_DEVICE
	cuErrorLaunchOutOfRsrcs = 701 // CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
	cuErrorIllegalAddress   = 700 // CUDA_ERROR_ILLEGAL_ADDRESS
	cuErrorLaunchTimeout    = 702 // CUDA_ERROR_LAUNCH_TIMEOUT
	cuErrorMisaligned       = 716 // CUDA_ERROR_MISALIGNED_ADDRESS
	cuErrorLaunchFailed     = 719 // CUDA_ERROR_LAUNCH_FAILED
	cuErrorInvalidPTX       = 218 // CUDA_ERROR_INVALID_PTX
	cuErrorNotFound         = 500 // CUDA_ERROR_NOT_FOUND
)

// DriverError is a failed CUDA driver call. Backends wrap it with the
// sentinel that says what the failure means to the caller (ErrNoDevice,
// ErrDriver, ErrOutOfMemory, ErrInvalidArgument); errors.As reaches it.
type DriverError struct {
	Call string // the driver entry point, e.g. "cuLaunchKernel"
	Code int    // the CUresult
	Name string // the CUresult's name, e.g. "CUDA_ERROR_LAUNCH_FAILED"
}

func (e *DriverError) Error() string {
	return fmt.Sprintf("%s: %s (%d)", e.Call, e.Name, e.Code)
}

// driverCode returns the CUresult inside err, or -1.
func driverCode(err error) int {
	var de *DriverError
	if errors.As(err, &de) {
		return de.Code
	}
	return -1
}

// cuResultNames names the results kvfence can meet. The driver's own
// cuGetErrorName is asked first; this table answers when it cannot (the
// stub library, which fails every call).
var cuResultNames = map[int]string{
	0:   "CUDA_SUCCESS",
	1:   "CUDA_ERROR_INVALID_VALUE",
	2:   "CUDA_ERROR_OUT_OF_MEMORY",
	3:   "CUDA_ERROR_NOT_INITIALIZED",
	4:   "CUDA_ERROR_DEINITIALIZED",
	34:  "CUDA_ERROR_STUB_LIBRARY",
	35:  "CUDA_ERROR_INSUFFICIENT_DRIVER",
	36:  "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER",
	46:  "CUDA_ERROR_DEVICES_UNAVAILABLE",
	100: "CUDA_ERROR_NO_DEVICE",
	101: "CUDA_ERROR_INVALID_DEVICE",
	200: "CUDA_ERROR_INVALID_IMAGE",
	201: "CUDA_ERROR_INVALID_CONTEXT",
	209: "CUDA_ERROR_NO_BINARY_FOR_GPU",
	218: "CUDA_ERROR_INVALID_PTX",
	222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
	400: "CUDA_ERROR_INVALID_HANDLE",
	500: "CUDA_ERROR_NOT_FOUND",
	600: "CUDA_ERROR_NOT_READY",
	700: "CUDA_ERROR_ILLEGAL_ADDRESS",
	701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
	702: "CUDA_ERROR_LAUNCH_TIMEOUT",
	716: "CUDA_ERROR_MISALIGNED_ADDRESS",
	719: "CUDA_ERROR_LAUNCH_FAILED",
	900: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
	901: "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
	905: "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
	906: "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
	907: "CUDA_ERROR_CAPTURED_EVENT",
	999: "CUDA_ERROR_UNKNOWN",
}

func cuResultName(code int) string {
	if n, ok := cuResultNames[code]; ok {
		return n
	}
	return "CUDA_ERROR_UNRECOGNIZED"
}
