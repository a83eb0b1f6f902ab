// Package gpuinfo reports a GPU's identity and memory through NVML
// (github.com/NVIDIA/go-nvml, which loads libnvidia-ml.so.1 at run time).
// It is a package of its own so that only programs that ask for it link
// go-nvml: a shared library that links it (the C ABI) cannot be loaded
// where NVML's symbols are absent.
package gpuinfo

// Info is what Probe reports about one GPU.
type Info struct {
	Index      int    // NVML index (all GPUs, not CUDA_VISIBLE_DEVICES order)
	Name       string // e.g. "NVIDIA H200"
	UUID       string // e.g. "GPU-…"
	TotalBytes uint64
	FreeBytes  uint64
}
