//go:build !cgo

package gpuinfo

import (
	"fmt"

	"github.com/kvfence/kvfence/cudaops"
)

// Probe needs cgo (go-nvml loads libnvidia-ml.so.1 through it).
func Probe(index int) (Info, error) {
	if index < 0 {
		return Info{}, fmt.Errorf("%w: NVML index %d", cudaops.ErrInvalidArgument, index)
	}
	return Info{}, fmt.Errorf("%w: built without cgo, so NVML cannot be loaded", cudaops.ErrNoDevice)
}
