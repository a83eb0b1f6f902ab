//go:build race

package memfill

// raceEnabled: the race detector does not see stores made in assembly, so
// under it CopyStreaming is a plain, instrumented copy.
const raceEnabled = true
