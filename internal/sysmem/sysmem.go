// Package sysmem tells how much memory this process can still use, so that
// kvfence refuses a pool it could not hold with an error instead of dying
// of an out-of-memory fault half way through building it.
package sysmem

// Available returns the bytes of memory this process can still allocate:
// the smaller of the system's available memory and what its control
// group's limit leaves. ok is false where it cannot tell.
func Available() (bytes int64, ok bool) { return available() }
