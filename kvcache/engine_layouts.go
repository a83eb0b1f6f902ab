package kvcache

import "fmt"

// Engines' own tensors. An engine that allocated its KV cache itself
// (a PyTorch tensor per layer) hands kvfence its memory as it is laid
// out; kvfence adopts each region from base, page stride and bytes
// (RegionMemory) and never moves it. The common layouts:
//
//   - SGLang: one k_buffer and one v_buffer per layer, [tokens, heads,
//     head_dim]; page p is tokens [p·page_size, (p+1)·page_size), so the
//     stride is the page. SGLang keeps its first page as padding (dummy
//     writes of padded batches land there): adopt from the second page
//     on, and add one to kvfence's page IDs in SGLang's tables.
//   - vLLM: one tensor per layer holding both K and V, either
//     [2, num_blocks, block_size, kv_heads, head_size] (K blocks, then V
//     blocks: KVSplit) or [num_blocks, 2, block_size, kv_heads, head_size]
//     (a block's K and V side by side: KVInterleaved); FusedKVMemory
//     derives the two regions' strides and offsets. MLA backends keep one
//     latent tensor per layer, [num_blocks, block_size, latent], one
//     region of stride one page.

// KVLayout is how one tensor holds a layer's K and V.
type KVLayout uint8

const (
	// KVSplit is [2, num_blocks, …]: every K block, then every V block.
	KVSplit KVLayout = iota + 1
	// KVInterleaved is [num_blocks, 2, …]: block b's K, then its V.
	KVInterleaved
)

// FusedKVMemory returns the memory of a layer's K and V regions in one
// engine tensor of numBlocks blocks, each K (and each V) pageBytes long,
// at device address base (CUDA pools) or in host (host pools; give one).
func FusedKVMemory(layout KVLayout, numBlocks int, pageBytes int64, base uint64, host []byte) (k, v *RegionMemory, err error) {
	if numBlocks < 1 || pageBytes < 1 {
		return nil, nil, fmt.Errorf("%w: fused KV tensor of %d blocks of %d bytes", ErrInvalidConfig, numBlocks, pageBytes)
	}
	if (base == 0) == (host == nil) {
		return nil, nil, fmt.Errorf("%w: fused KV tensor: give a device address or a host buffer, not both or neither", ErrInvalidConfig)
	}
	total := 2 * int64(numBlocks) * pageBytes
	if host != nil && int64(len(host)) < total {
		return nil, nil, fmt.Errorf("%w: fused KV tensor of %d bytes, %d blocks of 2 × %d need %d", ErrInvalidConfig, len(host), numBlocks, pageBytes, total)
	}
	var vOff, stride int64
	switch layout {
	case KVSplit:
		vOff, stride = int64(numBlocks)*pageBytes, pageBytes
	case KVInterleaved:
		vOff, stride = pageBytes, 2*pageBytes
	default:
		return nil, nil, fmt.Errorf("%w: KV layout %d", ErrInvalidConfig, layout)
	}
	k = &RegionMemory{Stride: stride, Pages: numBlocks}
	v = &RegionMemory{Stride: stride, Pages: numBlocks}
	if host != nil {
		k.Host, v.Host = host[:total], host[vOff:total]
	} else {
		k.Base, v.Base = base, base+uint64(vOff)
	}
	return k, v, nil
}
