//go:build !race

package memfill

const raceEnabled = false
