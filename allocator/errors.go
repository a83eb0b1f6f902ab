package allocator

import "errors"

// Sentinel errors. Every error returned by this package wraps exactly one of
// them; match with errors.Is. A call that returns an error has changed
// nothing.
var (
	// ErrInvalidArgument: a negative count, a page ID outside [0, N), or a
	// zero owner.
	ErrInvalidArgument = errors.New("allocator: invalid argument")
	// ErrNoSpace: fewer free pages than asked for.
	ErrNoSpace = errors.New("allocator: not enough free pages")
	// ErrDoubleFree: the page is not in use (already freed, quarantined,
	// retired, or never allocated), or appears twice in one batch.
	ErrDoubleFree = errors.New("allocator: page is not in use")
	// ErrNotOwner: the page is in use by another owner.
	ErrNotOwner = errors.New("allocator: page belongs to another owner")
	// ErrStaleHandle: the handle's generation is not the page's current one:
	// the page has been freed and handed out again since the handle was made.
	ErrStaleHandle = errors.New("allocator: stale page handle")
	// ErrWrongState: the page is not in the state the transition needs
	// (for example Clean of a page that is not quarantined).
	ErrWrongState = errors.New("allocator: page is in the wrong state")
	// ErrRefOverflow: a page's reference count would exceed MaxRefs.
	ErrRefOverflow = errors.New("allocator: too many references to page")
	// ErrCorrupt: Check found the accounting inconsistent. It always means
	// a bug in kvfence.
	ErrCorrupt = errors.New("allocator: accounting is inconsistent")
)
