//go:build gorgonia

package gorgoniacu

import (
	"fmt"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/kvfence/kvfence/cudaops"
)

// cu.CUContext and cu.Event wrap one C handle each in an unexported field
// and offer no accessor for it, so the adapter reads the field through
// unsafe. These checks fail the build if a gorgonia.org/cu release changes
// the layout (the arrays get a negative length).
var (
	_ [unsafe.Sizeof(uintptr(0)) - unsafe.Sizeof(cu.CUContext{})]struct{}
	_ [unsafe.Sizeof(cu.CUContext{}) - unsafe.Sizeof(uintptr(0))]struct{}
	_ [unsafe.Sizeof(uintptr(0)) - unsafe.Sizeof(cu.Event{})]struct{}
	_ [unsafe.Sizeof(cu.Event{}) - unsafe.Sizeof(uintptr(0))]struct{}
)

// ContextHandle returns the CUcontext inside c as an integer. It checks the
// value against c.String(), which prints the same pointer.
func ContextHandle(c cu.CUContext) (uintptr, error) {
	h := *(*uintptr)(unsafe.Pointer(&c))
	if got, want := c.String(), fmt.Sprintf("0x%x", h); got != want {
		return 0, fmt.Errorf("%w: cu.CUContext layout changed: String() %s, field %s", cudaops.ErrInvalidArgument, got, want)
	}
	return h, nil
}

// StreamHandle returns the CUstream inside s; 0 for cu.NoStream.
func StreamHandle(s cu.Stream) uintptr { return uintptr(unsafe.Pointer(s.C())) }

// EventHandle returns the CUevent inside e; 0 for the zero Event.
func EventHandle(e cu.Event) uintptr { return *(*uintptr)(unsafe.Pointer(&e)) }

// Ordering names the engine work a fill must wait for: everything queued
// on s so far and the last record of e. Either may be zero (cu.NoStream,
// cu.Event{}). Note that the zero stream means "no stream" to kvfence, not
// the legacy default stream.
func Ordering(s cu.Stream, e cu.Event) cudaops.Ordering {
	return cudaops.Ordering{Stream: StreamHandle(s), Event: EventHandle(e)}
}

// Open opens a kvfence CUDA device on the engine's context, so fills can
// wait on the engine's streams and events. The context must outlive the
// device.
func Open(c cu.Context) (*cudaops.CUDA, error) {
	if c == nil {
		return nil, fmt.Errorf("%w: nil cu.Context", cudaops.ErrInvalidArgument)
	}
	return OpenCUContext(c.CUDAContext())
}

// OpenCUContext is Open for a bare cu.CUContext.
func OpenCUContext(c cu.CUContext) (*cudaops.CUDA, error) {
	h, err := ContextHandle(c)
	if err != nil {
		return nil, err
	}
	return cudaops.OpenCUDAContext(h)
}

// Region describes engine memory at ptr as a kvfence region: pages pages,
// stride bytes apart, pageBytes long each. It validates the numbers.
func Region(ptr cu.DevicePtr, pages int, stride, pageBytes int64) (cudaops.Region, error) {
	r := cudaops.Region{Base: uint64(ptr), Stride: stride, PageBytes: pageBytes, Pages: pages}
	if ptr == 0 {
		return cudaops.Region{}, fmt.Errorf("%w: nil device pointer", cudaops.ErrInvalidArgument)
	}
	if err := r.Validate(); err != nil {
		return cudaops.Region{}, err
	}
	return r, nil
}

// Adopt registers engine memory at ptr as a region of d (see
// cudaops.CUDA.AdoptRegion for what the engine must guarantee).
func Adopt(d *cudaops.CUDA, ptr cu.DevicePtr, pages int, stride, pageBytes int64) (int, error) {
	r, err := Region(ptr, pages, stride, pageBytes)
	if err != nil {
		return 0, err
	}
	return d.AdoptRegion(r.Base, r.Pages, r.Stride, r.PageBytes)
}
