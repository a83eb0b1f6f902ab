//go:build !amd64 || purego

package memfill

// WordsStreaming falls back to ordinary stores where no streaming-store
// routine exists.
func WordsStreaming(b []byte, w uint32) { Words(b, w) }

// CopyStreaming is copy where no streaming-store routine exists.
func CopyStreaming(dst, src []byte) int { return copy(dst, src) }
