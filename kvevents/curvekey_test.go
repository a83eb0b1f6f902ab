package kvevents

import (
	"bytes"
	"encoding/hex"
	"errors"
	"testing"
)

// TestCurveKeysReadZ85AndHex: Z85 is RFC 32's (its test vector), keys
// read back from their String and from hex, a public key is the one its
// secret key derives, and malformed keys are refused with
// ErrInvalidConfig.
func TestCurveKeysReadZ85AndHex(t *testing.T) {
	vector := []byte{0x86, 0x4F, 0xD2, 0x6F, 0xB5, 0x59, 0xF7, 0x5B}
	if got := z85Encode(vector); got != "HelloWorld" {
		t.Fatalf("Z85 of RFC 32's vector: %q", got)
	}
	if b, err := z85Decode("HelloWorld"); err != nil || !bytes.Equal(b, vector) {
		t.Fatalf("Z85 decode: % x, %v", b, err)
	}
	pub, sec, err := NewCurveKeyPair()
	if err != nil {
		t.Fatal(err)
	}
	if sec.Public() != pub {
		t.Fatal("the public key of the pair is not its secret key's")
	}
	for _, s := range []string{pub.String(), "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"} {
		k, err := ParseCurveKey(s)
		if err != nil {
			t.Fatalf("%q: %v", s, err)
		}
		if s == pub.String() && k != pub {
			t.Fatal("a key does not read back from its String")
		}
	}
	for _, bad := range []string{"", "short", pub.String()[:39] + "~", "#####" + pub.String()[5:], "zz" + hex.EncodeToString(pub[:])[:62]} {
		if _, err := ParseCurveKey(bad); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("%q: %v, want ErrInvalidConfig", bad, err)
		}
	}
}
