// Package gorgoniacu hands memory, streams, events and contexts that a Go
// engine manages with gorgonia.org/cu to kvfence's CUDA device.
//
// Everything else in this package is behind the build tag `gorgonia`,
// because gorgonia.org/cu links libcuda at build time and calls cuInit in
// its package initialiser, exiting the process when that fails: a binary
// that imports it cannot even start on a machine without a GPU. kvfence's
// own CUDA backend loads the driver at run time instead; this adapter only
// translates handles:
//
//	dev, err := gorgoniacu.Open(ctx)                 // the engine's cu.Context
//	r, err := gorgoniacu.Adopt(dev, kvPtr, pages, stride, pageBytes)
//	fence, err := dev.Fill(pages, spec, gorgoniacu.Ordering(stream, cu.Event{}))
//
// Streams and events can only be waited on from their own context, which is
// why Open builds the kvfence device on the engine's context rather than
// the primary one.
//
// Without a GPU, tests under the tag can be compiled (go test -c, go vet)
// against the CUDA headers that scripts/cuda-sdk.sh fetches, but not run.
package gorgoniacu
