package cudaops

import "fmt"

// PagesForMemory returns how many pages of bytesPerPage (the bytes one page
// occupies over all its regions on this device) fit in free memory after
// keeping headroom for the engine's weights, activations and workspace.
// The kvcache layer turns this into a capacity in tokens and refuses a pool
// that cannot hold its maximum context.
func PagesForMemory(free, headroom, bytesPerPage int64) (int, error) {
	switch {
	case free < 0 || headroom < 0:
		return 0, fmt.Errorf("%w: free %d and headroom %d bytes must not be negative", ErrInvalidArgument, free, headroom)
	case bytesPerPage <= 0:
		return 0, fmt.Errorf("%w: %d bytes per page", ErrInvalidArgument, bytesPerPage)
	case headroom >= free:
		return 0, fmt.Errorf("%w: headroom of %d bytes leaves nothing of %d free", ErrOutOfMemory, headroom, free)
	}
	n := (free - headroom) / bytesPerPage
	if n == 0 {
		return 0, fmt.Errorf("%w: %d bytes after headroom hold no page of %d bytes", ErrOutOfMemory, free-headroom, bytesPerPage)
	}
	// Page IDs are int32.
	return int(min(n, 1<<31-1)), nil
}
