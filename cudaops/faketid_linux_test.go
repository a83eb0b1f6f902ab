package cudaops

import "syscall"

// osThread identifies the calling OS thread: the driver keeps a context
// stack per thread, and the device locks its goroutine to one around
// every driver section.
func osThread() int { return syscall.Gettid() }
