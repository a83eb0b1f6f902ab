package grpcx

// LentCollected reads how many messages' views came back only through
// their cleanup (SendViews).
func LentCollected() uint64 { return lentCollected.Load() }
