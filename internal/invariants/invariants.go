// Package invariants switches on expensive self-checks. They run when the
// binary is built with the `invariants` build tag, and under the race
// detector, so every `go test -race` run checks the accounting after each
// state change as well as at the points the tests choose.
package invariants
