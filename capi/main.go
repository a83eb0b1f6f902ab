// Command capi is kvfence's C ABI. It is not run: build it as a library,
//
//	go build -buildmode=c-shared -o capi/libkvfence.so ./capi
//	go build -buildmode=c-archive -o capi/libkvfence.a ./capi
//
// and include capi/include/kvfence.h, the hand-written header whose
// declarations a test keeps identical to what cgo generates. The logic
// lives in capi/internal/bridge; the files here only translate C
// arguments, record the per-thread last error and recover panics. See
// README.md in this directory.
package main

func main() {}
