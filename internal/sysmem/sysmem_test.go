package sysmem

import (
	"runtime"
	"testing"
)

func TestAvailableIsPlausible(t *testing.T) {
	n, ok := Available()
	if runtime.GOOS != "linux" {
		if ok {
			t.Fatalf("Available() = %d, true off Linux, which has no reader", n)
		}
		return
	}
	if !ok {
		t.Fatal("Available() cannot tell on Linux")
	}
	// This process runs, so some memory is left; no machine has an exabyte.
	if n <= 0 || n > 1<<60 {
		t.Fatalf("Available() = %d bytes", n)
	}
}
