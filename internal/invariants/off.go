//go:build !(invariants || race)

package invariants

// Enabled reports whether expensive self-checks run.
const Enabled = false
