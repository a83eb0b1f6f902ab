//go:build !unix

package benchkit

import "time"

// ProcessCPU cannot read the process's CPU time here.
func ProcessCPU() (time.Duration, bool) { return 0, false }
