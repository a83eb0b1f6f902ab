package handoff

import (
	"errors"
	"testing"
)

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

// TestUnknownReasonCodeReadAsInternal: a receiver newer than its sender
// may answer with a code appended after the sender was built; the sender
// must read it as ErrInternal, keeping the receiver's text, never as
// another reason or a protocol error.
func TestUnknownReasonCodeReadAsInternal(t *testing.T) {
	for _, code := range []int{len(reasons), 255} {
		err := parseVerdict(append([]byte{msgVerdict, stageManifest, byte(code)}, "why"...), stageManifest)
		var re *RefusedError
		if !errors.As(err, &re) || re.Reason != ErrInternal || re.Message != "why" {
			t.Errorf("code %d read as %#v", code, err)
		}
		if got := ReasonName(err); got != "internal" {
			t.Errorf("code %d labelled %q", code, got)
		}
	}
}
