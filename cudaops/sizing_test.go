package cudaops_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

func TestPagesForMemory(t *testing.T) {
	const page = 160 * 32 << 10 // 80 layers × K/V × 32 KiB (16 tokens, 8 heads, dim 128, bf16)
	for _, tc := range []struct {
		free, headroom, perPage int64
		want                    int
		err                     error
	}{
		{free: 100 << 30, headroom: 20 << 30, perPage: page, want: int((80 << 30) / page)},
		{free: page, headroom: 0, perPage: page, want: 1},
		{free: page - 1, headroom: 0, perPage: page, err: cudaops.ErrOutOfMemory},
		{free: 10, headroom: 10, perPage: 1, err: cudaops.ErrOutOfMemory},
		{free: 10, headroom: 11, perPage: 1, err: cudaops.ErrOutOfMemory},
		{free: -1, headroom: 0, perPage: 1, err: cudaops.ErrInvalidArgument},
		{free: 10, headroom: -1, perPage: 1, err: cudaops.ErrInvalidArgument},
		{free: 10, headroom: 0, perPage: 0, err: cudaops.ErrInvalidArgument},
		{free: 1 << 62, headroom: 0, perPage: 4, want: 1<<31 - 1},
	} {
		got, err := cudaops.PagesForMemory(tc.free, tc.headroom, tc.perPage)
		if tc.err != nil {
			assert.ErrorIs(t, err, tc.err, "%+v", tc)
			assert.Zero(t, got)
			continue
		}
		require.NoError(t, err, "%+v", tc)
		assert.Equal(t, tc.want, got, "%+v", tc)
	}
}
