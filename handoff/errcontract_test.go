package handoff

import (
	"testing"

	"github.com/kvfence/kvfence/internal/errcontract"
)

// TestErrorContract holds this package, handoff/grpcx and handoff/tcpx to the promise
// of errors.go: every error they return wraps one of their sentinels (or
// kvcache's), so that a caller can always decide with errors.Is. Checked
// in the source, because the paths that break the promise are the rare
// ones a test does not reach: no errors.New inside a function (a sentinel
// belongs in errors.go), and no fmt.Errorf without %w. Tests are exempt.
func TestErrorContract(t *testing.T) {
	errcontract.Check(t, ".", "grpcx", "tcpx")
}
