package cudaops

import (
	"testing"

	"github.com/kvfence/kvfence/internal/errcontract"
)

// TestErrorContract holds this package, gpuinfo and gorgoniacu to the
// promise of errors.go: every error they return wraps one of this
// package's sentinels, so that a caller (the pool deciding whether pages
// are clean) can always decide with errors.Is. Checked
// in the source, because the paths that break the promise are the rare
// ones a test does not reach: no errors.New inside a function (a sentinel
// belongs in errors.go), and no fmt.Errorf without %w. Tests are exempt.
func TestErrorContract(t *testing.T) {
	errcontract.Check(t, ".", "gpuinfo", "gorgoniacu")
}
