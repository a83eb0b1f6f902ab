package handoff

// SetSumSpansForTest has a chunk's units summed by up to workers
// goroutines, given minBytes each at least, until restore is called.
func SetSumSpansForTest(workers int, minBytes int64) (restore func()) {
	w, b := sumWorkers.Load(), minSpanBytes.Load()
	sumWorkers.Store(int64(workers))
	minSpanBytes.Store(minBytes)
	return func() {
		sumWorkers.Store(w)
		minSpanBytes.Store(b)
	}
}

// InSpansForTest is inSpans.
var InSpansForTest = inSpans

// DefaultSumWorkersForTest is defaultSumWorkers.
var DefaultSumWorkersForTest = defaultSumWorkers
