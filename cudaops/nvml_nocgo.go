//go:build !cgo

package cudaops

import "fmt"

// ProbeNVML needs cgo (go-nvml loads libnvidia-ml.so.1 through it).
func ProbeNVML(index int) (DeviceInfo, error) {
	if index < 0 {
		return DeviceInfo{}, fmt.Errorf("%w: NVML index %d", ErrInvalidArgument, index)
	}
	return DeviceInfo{}, fmt.Errorf("%w: built without cgo, so NVML cannot be loaded", ErrNoDevice)
}
