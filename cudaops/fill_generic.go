//go:build !amd64 || purego

package cudaops

// fillWordStreaming falls back to ordinary stores where no streaming-store
// routine exists.
func fillWordStreaming(b []byte, w uint32) { fillWord(b, w) }
