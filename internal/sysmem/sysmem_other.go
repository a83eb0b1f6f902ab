//go:build !linux

package sysmem

func available() (int64, bool) { return 0, false }
