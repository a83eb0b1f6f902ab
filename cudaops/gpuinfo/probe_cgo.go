//go:build cgo

package gpuinfo

import (
	"fmt"
	"github.com/kvfence/kvfence/cudaops"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Probe reports the name, UUID and memory of GPU index through NVML
// (libnvidia-ml.so.1, loaded at run time by go-nvml). Without the library
// it returns cudaops.ErrNoDevice. It calls nothing but nvml.Init unless Init
// succeeded: any other NVML call after a failed Init ends the process.
func Probe(index int) (Info, error) {
	if index < 0 {
		return Info{}, fmt.Errorf("%w: NVML index %d", cudaops.ErrInvalidArgument, index)
	}
	if ret := nvml.Init(); ret != nvml.SUCCESS {
		// Only the number: Return.String may call into a library that
		// failed to initialise.
		if ret == nvml.ERROR_LIBRARY_NOT_FOUND {
			return Info{}, fmt.Errorf("%w: nvml.Init: library libnvidia-ml.so.1 not found", cudaops.ErrNoDevice)
		}
		return Info{}, fmt.Errorf("%w: nvml.Init: %s", cudaops.ErrNoDevice, nvmlReturnName(ret))
	}
	defer nvml.Shutdown()
	dev, ret := nvml.DeviceGetHandleByIndex(index)
	if ret != nvml.SUCCESS {
		if ret == nvml.ERROR_INVALID_ARGUMENT || ret == nvml.ERROR_NOT_FOUND {
			return Info{}, fmt.Errorf("%w: NVML device %d: %s", cudaops.ErrNoDevice, index, nvml.ErrorString(ret))
		}
		return Info{}, fmt.Errorf("%w: nvml.DeviceGetHandleByIndex(%d): %s", cudaops.ErrDriver, index, nvml.ErrorString(ret))
	}
	info := Info{Index: index}
	if info.Name, ret = dev.GetName(); ret != nvml.SUCCESS {
		return Info{}, fmt.Errorf("%w: nvml GetName: %s", cudaops.ErrDriver, nvml.ErrorString(ret))
	}
	if info.UUID, ret = dev.GetUUID(); ret != nvml.SUCCESS {
		return Info{}, fmt.Errorf("%w: nvml GetUUID: %s", cudaops.ErrDriver, nvml.ErrorString(ret))
	}
	mem, ret := dev.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return Info{}, fmt.Errorf("%w: nvml GetMemoryInfo: %s", cudaops.ErrDriver, nvml.ErrorString(ret))
	}
	info.TotalBytes, info.FreeBytes = mem.Total, mem.Free
	return info, nil
}

// nvmlReturnName names an nvmlReturn_t from a fixed table, calling nothing.
func nvmlReturnName(r nvml.Return) string {
	names := map[nvml.Return]string{
		nvml.ERROR_UNINITIALIZED:           "ERROR_UNINITIALIZED",
		nvml.ERROR_DRIVER_NOT_LOADED:       "ERROR_DRIVER_NOT_LOADED",
		nvml.ERROR_NO_PERMISSION:           "ERROR_NO_PERMISSION",
		nvml.ERROR_LIBRARY_NOT_FOUND:       "ERROR_LIBRARY_NOT_FOUND",
		nvml.ERROR_FUNCTION_NOT_FOUND:      "ERROR_FUNCTION_NOT_FOUND",
		nvml.ERROR_NOT_SUPPORTED:           "ERROR_NOT_SUPPORTED",
		nvml.ERROR_LIB_RM_VERSION_MISMATCH: "ERROR_LIB_RM_VERSION_MISMATCH",
		nvml.ERROR_UNKNOWN:                 "ERROR_UNKNOWN",
	}
	if n, ok := names[r]; ok {
		return fmt.Sprintf("%s (%d)", n, int(r))
	}
	return fmt.Sprintf("nvmlReturn %d", int(r))
}
