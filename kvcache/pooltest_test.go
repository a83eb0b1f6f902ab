package kvcache_test

import (
	"testing"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache/pooltest"
)

// The pool's copy paths (handoff, checkpoints, host tier) on the Host
// device, with fills that end before Fill returns and with fills that
// end later, as a GPU's; cudaops runs the same suite on CUDA.
func TestPoolPathsOnHost(t *testing.T) {
	pooltest.Run(t, func(*testing.T) cudaops.Device { return cudaops.NewHost() })
}

func TestPoolPathsOnAsyncHost(t *testing.T) {
	pooltest.Run(t, func(*testing.T) cudaops.Device {
		return cudaops.NewHostWith(cudaops.HostConfig{AsyncFills: true})
	})
}
