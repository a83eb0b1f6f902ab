package bridge

import (
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// GroupTable copies the pages (slots) lease h holds in cache group group
// into dst and returns how many there are and the logical page the first
// holds (kvcache.Lease.GroupTable). group may alias C memory.
func GroupTable(h Handle, group string, dst []int32) (n, first int, err error) {
	err = withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		var table []int32
		first, table, err = l.GroupTable(group, nil)
		if err != nil {
			return err
		}
		n = len(table)
		if n > len(dst) {
			return &BufferError{What: "group table", Need: n, Have: len(dst)}
		}
		copy(dst, table)
		return nil
	})
	return n, first, err
}

// SlideWindows moves lease h's sliding windows to its written watermark,
// scrubbing the pages that slid out after after (kvcache.Lease.SlideWindows),
// and returns how many were scrubbed.
func SlideWindows(h Handle, after cudaops.Ordering) (int, error) {
	var n int
	err := withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		var err error
		n, err = l.SlideWindows(after)
		return err
	})
	return n, err
}

// GroupDoc is kvcache.GroupStats.
type GroupDoc struct {
	Name        string `json:"name"`
	Kind        string `json:"kind"`
	Pages       int    `json:"pages"`
	PageBytes   int64  `json:"page_bytes"`
	Free        int    `json:"free"`
	InUse       int    `json:"in_use"`
	Cached      int    `json:"cached"`
	Quarantined int    `json:"quarantined"`
	Retired     int    `json:"retired"`
}

func groupDocs(gs []kvcache.GroupStats) []GroupDoc {
	out := []GroupDoc{}
	for _, g := range gs {
		out = append(out, GroupDoc{Name: g.Name, Kind: g.Kind.String(), Pages: g.Pages, PageBytes: g.PageBytes,
			Free: g.Free, InUse: g.InUse, Cached: g.Cached, Quarantined: g.Quarantined, Retired: g.Retired})
	}
	return out
}
