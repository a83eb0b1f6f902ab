//go:build !race

package kvsim

const raceEnabled = false
