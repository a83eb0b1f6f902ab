package isolation

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// NameProblem says what keeps s from being a name of at most max bytes
// (a tenant, a domain, a request ID, an adapter), or "" if nothing does.
// A name is 1..max bytes of UTF-8 without a NUL: names travel in C
// strings, which end at the first NUL (so "a\x00b" would reach the pool
// through the C ABI as "a", another tenant's name), in handoff manifests,
// and in Prometheus label values, which must be UTF-8 (a scrape of a
// tenant label that is not would fail, or panic the process).
func NameProblem(s string, max int) string {
	if s != "" && len(s) <= max && plainASCII(s) {
		return "" // the usual name (every request ID is checked): one pass
	}
	switch {
	case s == "":
		return "empty"
	case len(s) > max:
		return fmt.Sprintf("%d bytes, want at most %d", len(s), max)
	case !utf8.ValidString(s):
		return "not UTF-8"
	case strings.IndexByte(s, 0) >= 0:
		return "holds a NUL byte"
	}
	return ""
}

// plainASCII reports whether s is ASCII without a NUL: valid UTF-8 with
// nothing to cut it short in C.
func plainASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == 0 || c >= utf8.RuneSelf {
			return false
		}
	}
	return true
}
