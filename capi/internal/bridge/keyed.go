package bridge

import (
	"fmt"
	"strings"
	"time"

	"github.com/kvfence/kvfence/kvcache"
)

// Admission with extra key material per prompt page, and dropping the
// prefix cache (since ABI 8): what an engine needs to key pages as it
// keys them itself (vLLM: the LoRA adapter, the multimodal items behind a
// prompt's placeholder tokens, a cache salt) and to invalidate the cache
// after a weight update.

// maxPageExtraTotal bounds the extra key material of one admission: as
// much as a prompt of a million pages could carry at 1 KiB each.
const maxPageExtraTotal = 1 << 30

// SplitPageExtra cuts buf into the extra key material of each prompt page:
// page i's is buf[ends[i-1]:ends[i]] (ends[-1] = 0), empty for none. The
// ends must not decrease, and buf must hold ends[len-1] bytes (the caller
// passes it that long). Bad ends are a bad value of the admission's
// arguments (kvcache.ErrInvalidRequest). The pieces view buf; the
// admission copies what it keeps.
func SplitPageExtra(buf []byte, ends []uint64) ([][]byte, error) {
	if len(ends) == 0 {
		return nil, nil
	}
	for i := 1; i < len(ends); i++ {
		if ends[i] < ends[i-1] {
			return nil, fmt.Errorf("%w: page_extra_ends[%d] = %d is below page_extra_ends[%d] = %d",
				kvcache.ErrInvalidRequest, i, ends[i], i-1, ends[i-1])
		}
	}
	if total := ends[len(ends)-1]; total > maxPageExtraTotal || total > uint64(len(buf)) {
		return nil, fmt.Errorf("%w: page extra key material of %d bytes (buffer %d, limit %d)",
			kvcache.ErrInvalidRequest, total, len(buf), maxPageExtraTotal)
	}
	out := make([][]byte, len(ends))
	var start uint64
	for i, end := range ends {
		if end > start {
			out[i] = buf[start:end:end]
		}
		start = end
	}
	return out, nil
}

// AdmitTokensKeyed is AdmitTokensTable whose prompt pages carry extra key
// material (kvcache.Request.PageExtra; nil entries for pages without).
func AdmitTokensKeyed(h Handle, id, tenant string, tokens []int32, maxNewTokens int64, adapter string, extra [][]byte,
	wait time.Duration, table []int32) (Handle, int, error) {
	return admitTable(h, kvcache.Request{ID: id, Tenant: tenant, PromptTokens: len(tokens), MaxNewTokens: clampInt(maxNewTokens),
		TokenIDs: tokens, Adapter: strings.Clone(adapter), PageExtra: extra}, maxNewTokens, wait, table)
}

// ClearPrefixCache drops the pool's prefix cache in every domain
// (kvcache.Pool.ClearPrefixCache): cached pages are scrubbed, pages live
// leases share stay theirs and are scrubbed when the last of them ends.
func ClearPrefixCache(h Handle) error {
	pe, err := lookupPool(h)
	if err != nil {
		return err
	}
	return pe.pool.ClearPrefixCache()
}
