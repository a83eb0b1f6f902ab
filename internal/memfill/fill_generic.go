//go:build !amd64 || purego

package memfill

// WordsStreaming falls back to ordinary stores where no streaming-store
// routine exists.
func WordsStreaming(b []byte, w uint32) { Words(b, w) }
