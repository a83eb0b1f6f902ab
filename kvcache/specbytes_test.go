package kvcache

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// hugeWindowSpec is a valid spec at the limits: a sliding-window group of
// 16 regions of 1 GiB pages (16 GiB a page) with a ring of 2^16 pages.
func hugeWindowSpec() CacheSpec {
	var swa []CacheRegion
	for i := range 16 {
		swa = append(swa, CacheRegion{Name: fmt.Sprintf("swa.%d", i), DType: BF16, PageBytes: 1 << 30})
	}
	return CacheSpec{Groups: []CacheGroup{
		{Name: "kv", Kind: GroupPerToken, TokensPerPage: 1, Regions: []CacheRegion{{Name: "k", DType: BF16, PageBytes: 4}}},
		{Name: "swa", Kind: GroupSlidingWindow, TokensPerPage: 1, WindowTokens: 1<<16 - 1, Regions: swa},
	}}
}

// BytesFor and LeaseBytes multiplied leases × ring pages × page bytes in
// int64 and wrapped: 2^24 leases of 2^16 pages of 2^34 bytes is 2^74
// bytes, which came out as 0, and PagesForMemory then sized a pool as if
// the window group needed nothing. They saturate, and PagesForMemory
// refuses.
func TestSpecBytesSaturateInsteadOfWrapping(t *testing.T) {
	s := hugeWindowSpec()
	require.NoError(t, s.Validate())
	assert.Equal(t, int64(math.MaxInt64), s.BytesFor(0, 1<<24))
	assert.Equal(t, int64(math.MaxInt64), s.BytesFor(math.MaxInt32, 1<<24))
	assert.Equal(t, int64(1<<16)*(1<<34), s.LeaseBytes(math.MaxInt32), "2^50: no overflow, exact")
	_, err := s.PagesForMemory(80<<30, 0, 1<<24)
	require.ErrorIs(t, err, ErrUndersizedPool)
	n, err := s.PagesForMemory(1<<62, 0, 1)
	require.NoError(t, err, "one lease's ring of 2^50 bytes fits in 2^62")
	assert.Equal(t, math.MaxInt32, n, "(2^62 - 2^50) / 4 pages, capped")
	_, err = s.PagesForMemory(0, math.MaxInt64, 1)
	require.ErrorIs(t, err, ErrUndersizedPool, "headroom beyond what is free")

	// A pool sized by PoolBytes: 2^14 leases' rings are 2^30 pages of 2^34
	// bytes, 2^64 bytes, which wrapped to 0 beside PoolBytes: the pool got
	// the whole budget as per-token pages, and only the device allocation
	// refused it, after allocating the rest.
	_, err = New(Config{Cache: s, PoolBytes: 1 << 20, MaxLeases: 1 << 14, MaxContextTokens: 1 << 16, AllowUndersizedPool: true})
	require.ErrorIs(t, err, ErrInvalidConfig)
	assert.ErrorContains(t, err, "holds no page of 4 bytes beside 9223372036854775807 bytes")
}
