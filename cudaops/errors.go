package cudaops

import "errors"

// Sentinel errors of every Device. Every error this package (and gpuinfo,
// gorgoniacu) returns wraps one of them, a failed driver call as a
// *DriverError inside ErrDriver, ErrNoDevice, ErrOutOfMemory or
// ErrInvalidArgument; match with errors.Is. TestErrorContract checks the
// source for errors that could escape it.
var (
	// ErrNoDevice: the backend cannot run here (no driver, no GPU, the
	// driver refused to initialise). The message names the driver's error.
	ErrNoDevice = errors.New("cudaops: no usable device")
	// ErrInvalidArgument: a page or region outside the device's regions, a
	// buffer of the wrong length, a malformed region description.
	ErrInvalidArgument = errors.New("cudaops: invalid argument")
	// ErrOutOfMemory: the device could not allocate a region.
	ErrOutOfMemory = errors.New("cudaops: out of device memory")
	// ErrClosed: the device has been closed.
	ErrClosed = errors.New("cudaops: device closed")
	// ErrDriver: a driver call failed; the message names the call and the
	// driver's error.
	ErrDriver = errors.New("cudaops: driver call failed")
	// ErrBadOrdering: an Ordering the device cannot wait for: a stream or
	// event the driver does not know, of another context, or capturing a
	// CUDA graph. The caller's mistake: errors wrapping it also wrap
	// ErrInvalidArgument, and nothing was queued.
	ErrBadOrdering = errors.New("cudaops: unusable ordering")
)
