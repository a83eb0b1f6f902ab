//go:build !linux

package cudaops

func adviseHuge([]byte) {}
