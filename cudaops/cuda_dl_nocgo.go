//go:build !cgo

package cudaops

import "fmt"

// loadDriver: without cgo there is no dlopen, so no CUDA driver.
func loadDriver() (driver, error) {
	return nil, fmt.Errorf("%w: built without cgo, so libcuda.so.1 cannot be loaded", ErrNoDevice)
}
