//go:build race

package kvsim

// raceEnabled: the race detector slows a replay of a public trace from
// seconds to many minutes; tests that replay one skip under it.
const raceEnabled = true
