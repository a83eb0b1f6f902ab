package cudaops_test

import (
	"testing"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache/pooltest"
)

// kvcache's copy paths on CUDA pools (kvcache/pooltest): a hybrid
// prompt's handoff through the staged copies, state checkpoints through
// device-to-device copies, and the host tier through page-locked memory,
// each page read back through the device and every free page audited
// for the scrub pattern. Over the simulated driver here, with fill.ptx
// run by its interpreter; on GPU 0 in TestCUDAPoolPathsGPU.
func TestCUDAPoolPaths(t *testing.T) {
	pooltest.Run(t, func(t *testing.T) cudaops.Device {
		d, _ := openFake(t)
		return d
	})
}

// TestCUDAPoolPathsGPU runs the suite on GPU 0 (scripts/gpu-check.sh's
// conformance step) and skips without one.
func TestCUDAPoolPathsGPU(t *testing.T) {
	openGPU(t).Close()
	pooltest.Run(t, func(t *testing.T) cudaops.Device { return openGPU(t) })
}
