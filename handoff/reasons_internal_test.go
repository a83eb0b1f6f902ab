package handoff

import "testing"

// TestEveryReasonCodeHasAName: ReasonNames is indexed by the wire's
// reason codes, so a code added without a name would index past it.
func TestEveryReasonCodeHasAName(t *testing.T) {
	if len(ReasonNames) != len(reasons) {
		t.Fatalf("%d reason names for %d reason codes", len(ReasonNames), len(reasons))
	}
	for code, r := range reasons {
		if code != 0 && reasonCode(r) != uint8(code) {
			t.Errorf("reason %v has code %d, listed at %d", r, reasonCode(r), code)
		}
	}
}
