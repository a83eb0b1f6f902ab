package kvcache

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// The accessors without an error result panicked on a nil lease (what a
// refused Admit returns) where ID, Pages and Written return zero: an
// engine that logs a refused request's lease must not crash.
func TestNilLeaseAccessorsReturnZero(t *testing.T) {
	var l *Lease
	assert.NotPanics(t, func() {
		assert.Zero(t, l.PromptTokens())
		assert.Zero(t, l.MaxNewTokens())
		assert.Zero(t, l.HitTokens())
		assert.Empty(t, l.Domain())
		assert.Equal(t, PhaseAdmitted, l.Phase(), "as for a zero Lease")
		assert.Zero(t, l.Pages())
		assert.Zero(t, l.CapacityTokens())
		assert.Zero(t, l.Written())
		assert.Empty(t, l.Tenant())
	})
}
