package kvevents

import (
	"testing"

	"github.com/kvfence/kvfence/internal/errcontract"
)

// TestErrorContract holds the package to the promise of errors.go: every
// error it returns wraps one of its sentinels (see internal/errcontract).
func TestErrorContract(t *testing.T) { errcontract.Check(t, ".") }
