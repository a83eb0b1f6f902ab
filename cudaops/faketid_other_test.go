//go:build !linux

package cudaops

// osThread: elsewhere the simulated driver keeps one context stack.
func osThread() int { return 0 }
