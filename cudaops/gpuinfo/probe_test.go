package gpuinfo_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/cudaops/gpuinfo"
)

// TestProbeNVML: on a GPU machine the probe names the device; elsewhere
// (no library, or the toolkit's stub) it is ErrNoDevice and the process
// lives on.
func TestProbeNVML(t *testing.T) {
	_, err := gpuinfo.Probe(-1)
	require.ErrorIs(t, err, cudaops.ErrInvalidArgument)
	info, err := gpuinfo.Probe(0)
	if errors.Is(err, cudaops.ErrNoDevice) {
		t.Skipf("no NVML device: %v", err)
	}
	require.NoError(t, err)
	t.Logf("NVML device 0: %+v", info)
	assert.NotEmpty(t, info.Name)
	assert.NotEmpty(t, info.UUID)
	assert.Positive(t, info.TotalBytes)
	assert.LessOrEqual(t, info.FreeBytes, info.TotalBytes)
	_, err = gpuinfo.Probe(1 << 20)
	assert.ErrorIs(t, err, cudaops.ErrNoDevice, "an index past the last GPU")
}
