package cudaops_test

import (
	"errors"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/cudaops/devicetest"
)

func TestHostConformance(t *testing.T) {
	devicetest.Run(t, func(*testing.T) cudaops.Device { return cudaops.NewHost() })
}

func TestHostAsyncFillsConformance(t *testing.T) {
	devicetest.Run(t, func(*testing.T) cudaops.Device {
		return cudaops.NewHostWith(cudaops.HostConfig{AsyncFills: true})
	})
}

// cudaEngine adapts cudaops.TestEngine to devicetest.Engine.
type cudaEngine struct{ e *cudaops.TestEngine }

func (c cudaEngine) Write(t *testing.T, r int, p int32, word uint32) cudaops.Ordering {
	o, err := c.e.Write(r, p, word)
	require.NoError(t, err)
	return o
}

func (c cudaEngine) Sync(t *testing.T) { require.NoError(t, c.e.Sync()) }

func newCUDAEngine(scratch uint64) func(*testing.T, cudaops.Device) devicetest.Engine {
	return func(t *testing.T, d cudaops.Device) devicetest.Engine {
		e, err := d.(*cudaops.CUDA).NewTestEngine(scratch)
		require.NoError(t, err)
		t.Cleanup(e.Close) // runs before the device's Close (LIFO)
		return cudaEngine{e}
	}
}

func runCUDAModes(t *testing.T, open func(t *testing.T) *cudaops.CUDA, scratch uint64) {
	t.Run("kernel", func(t *testing.T) {
		devicetest.RunWith(t, devicetest.Config{
			Open:            func(t *testing.T) cudaops.Device { return open(t) },
			Engine:          newCUDAEngine(scratch),
			LaunchesPerFill: 1,
		})
	})
	t.Run("memset", func(t *testing.T) {
		devicetest.RunWith(t, devicetest.Config{
			Open: func(t *testing.T) cudaops.Device {
				d := open(t)
				require.NoError(t, d.SetFillMode(cudaops.FillMemset))
				return d
			},
			Engine: newCUDAEngine(scratch),
		})
	})
}

// TestCUDAConformanceSimulated runs the suite on the CUDA device over the
// simulated driver: everything but the driver itself, since the simulated
// driver runs the text of fill.ptx (internal/ptx).
func TestCUDAConformanceSimulated(t *testing.T) {
	runCUDAModes(t, func(t *testing.T) *cudaops.CUDA {
		d, f, err := cudaops.OpenFake()
		require.NoError(t, err)
		t.Cleanup(func() {
			require.Empty(t, f.Leaks(), "after Close")
		})
		// The kernel mode must run fill.ptx, not fall back to memsets.
		require.NoError(t, d.KernelError())
		return d
	}, 4096)
}

// openGPU opens CUDA device 0 or skips the test when there is none (fails,
// when KVFENCE_REQUIRE_GPU is set: scripts/gpu-check.sh sets it).
func openGPU(t testing.TB) *cudaops.CUDA {
	t.Helper()
	d, err := cudaops.OpenCUDA(0)
	if errors.Is(err, cudaops.ErrNoDevice) {
		if os.Getenv("KVFENCE_REQUIRE_GPU") != "" {
			t.Fatalf("KVFENCE_REQUIRE_GPU is set and there is no usable CUDA device: %v", err)
		}
		t.Skipf("no CUDA device: %v", err)
	}
	require.NoError(t, err)
	if kerr := d.KernelError(); kerr != nil {
		t.Errorf("fill kernel did not load: %v", kerr)
	}
	return d
}

// TestCUDADeviceUsable is scripts/gpu-check.sh's first step: GPU 0 opens,
// its fill kernel loads and passes its warm-up launch, and a kernel fill
// of a page reads back. It skips without a GPU, and fails then when
// KVFENCE_REQUIRE_GPU is set.
func TestCUDADeviceUsable(t *testing.T) {
	d := openGPU(t)
	defer d.Close()
	free, total, err := d.MemInfo()
	require.NoError(t, err)
	t.Logf("device %s: %d of %d MiB free, fill mode %s", d.Name(), free>>20, total>>20, d.Stats().Mode)
	require.NoError(t, d.KernelError(), "the fill kernel did not load")
	_, err = d.AllocRegion(4, 4096)
	require.NoError(t, err)
	require.NoError(t, d.WritePage(0, 2, make([]byte, 4096)))
	f, err := d.Fill([]int32{2}, cudaops.FillSpec{Word: 0x80008000}, cudaops.Ordering{})
	require.NoError(t, err)
	require.NoError(t, f.Wait())
	got := make([]byte, 4096)
	require.NoError(t, d.ReadPage(0, 2, got))
	for i := 0; i < len(got); i += 4 {
		require.Equal(t, []byte{0, 0x80, 0, 0x80}, got[i:i+4], "byte %d", i)
	}
}

// TestCUDAConformance runs the suite on a real GPU, and skips without one.
func TestCUDAConformance(t *testing.T) {
	d := openGPU(t)
	t.Logf("device %s", d.Name())
	require.NoError(t, d.Close())
	// 64 MiB of engine work before each engine write keeps it pending
	// while the fill is queued.
	runCUDAModes(t, func(t *testing.T) *cudaops.CUDA { return openGPU(t) }, 64<<20)
}

// TestOpenCUDAHere checks what this machine's driver says. Without a GPU it
// must be ErrNoDevice, and KVFENCE_EXPECT_CUDA_ERROR (CI sets it when the
// stub library is on LD_LIBRARY_PATH) names the error it must carry.
func TestOpenCUDAHere(t *testing.T) {
	d, err := cudaops.OpenCUDA(0)
	if err == nil {
		t.Logf("CUDA device present: %s", d.Name())
		require.NoError(t, d.Close())
		return
	}
	t.Logf("OpenCUDA(0): %v", err)
	require.ErrorIs(t, err, cudaops.ErrNoDevice)
	if want := os.Getenv("KVFENCE_EXPECT_CUDA_ERROR"); want != "" {
		require.ErrorContains(t, err, want)
	}
	// A second attempt answers the same, without crashing.
	_, err2 := cudaops.OpenCUDA(0)
	require.ErrorIs(t, err2, cudaops.ErrNoDevice)
}
