package kvcache

import (
	"fmt"
	"strings"
)

// Model presets: the cache specs of real models, built from each model's
// published configuration with the region constructors.
//
// Every number below comes from a named source, given beside the preset
// with the configuration key it is (num_hidden_layers, kv_lora_rank, …).
// Where a number could not be read from the model's own config.json, the
// comment says so and says where it was read instead. What a config does
// not say is a serving choice, stated and explained where it is made:
//
//   - the element type of KV and latents: bf16, the model's dtype, which
//     is what vLLM's and SGLang's kv_cache_dtype "auto" stores; the fp8
//     variant of DeepSeek-V3 is its own preset;
//   - the sparse-attention indexer keys: fp8 with one fp32 scale per 128
//     elements, as vLLM and SGLang store them for these models;
//   - linear-attention state: convolution windows in bf16 and recurrent
//     state in fp32, SGLang's defaults (mamba2_state_dtype: conv from
//     SGLANG_MAMBA_CONV_DTYPE, bfloat16 by default; temporal float32);
//   - the page size: 16 tokens for grouped-query attention (vLLM's
//     default block size), 64 for MLA (FlashMLA's and SGLang's DSA page).
//
// A preset describes one replica of the whole model, as if on one device.
// Under tensor parallelism each rank holds its share of the KV heads
// (MLA latents and indexer keys are replicated on every rank), so build
// the spec of a rank with the region constructors from the same numbers.
// Multi-token-prediction draft layers (DeepSeek-V3's and GLM's
// num_nextn_predict_layers) are a separate draft model with caches of
// their own, not counted here.

// PresetInfo describes one model preset.
type PresetInfo struct {
	// Name is what Preset takes, and the spec's Model.
	Name string
	// Description says in one line what the preset caches.
	Description string
	// Source is where its numbers come from: repositories and files
	// (or URLs); Revision the commits read, where one could be pinned.
	Source, Revision string
	// MaxContextTokens is the model's context window
	// (max_position_embeddings): a Config's MaxContextTokens for it.
	MaxContextTokens int
}

// Page sizes of the presets (see the serving choices above).
const (
	presetGQAPage = 16
	presetMLAPage = 64
)

type preset struct {
	info  PresetInfo
	build func(name string) (CacheSpec, error)
}

// presets lists every preset, in the order Presets reports them.
var presets = []preset{
	{PresetInfo{
		Name:             "llama-3.1-8b",
		Description:      "Llama-3.1-8B: grouped-query attention, 32 layers of 8 KV heads × 128, bf16",
		Source:           "huggingface.co/meta-llama/Llama-3.1-8B config.json",
		MaxContextTokens: 131_072,
	}, presetLlama31},
	{PresetInfo{
		Name:             "deepseek-v3",
		Description:      "DeepSeek-V3: MLA, 61 layers of one 512 + 64 latent per token, bf16",
		Source:           "huggingface.co/deepseek-ai/DeepSeek-V3 config.json",
		MaxContextTokens: 163_840,
	}, presetDeepSeekV3(BF16)},
	{PresetInfo{
		Name:             "deepseek-v3-fp8",
		Description:      "DeepSeek-V3: MLA, 61 layers of one 512 + 64 latent per token in vLLM's fp8_ds_mla format (656 bytes)",
		Source:           "huggingface.co/deepseek-ai/DeepSeek-V3 config.json",
		MaxContextTokens: 163_840,
	}, presetDeepSeekV3(FP8E4M3)},
	{PresetInfo{
		Name:             "glm-5",
		Description:      "GLM-5 (glm_moe_dsa): MLA 512 + 64 in bf16 and a sparse-attention indexer key cache (128 fp8 + scale) on each of 78 layers",
		Source:           "github.com/huggingface/transformers src/transformers/models/glm_moe_dsa/configuration_glm_moe_dsa.py (defaults of zai-org/GLM-5)",
		Revision:         "008e574391258935f3ecc3035c882e73bbcac419",
		MaxContextTokens: 202_752,
	}, presetGLM5},
	{PresetInfo{
		Name: "glm-5.3-flash",
		Description: "GLM-5.3-Flash (glm5_next): 34 Kimi Delta Attention layers in a state slot, " +
			"11 MLA 512 (no rope) layers with an indexer pooled over 4 tokens, every fourth layer",
		Source: "github.com/huggingface/transformers src/transformers/models/glm5_next/configuration_glm5_next.py; " +
			"github.com/sgl-project/sglang python/sglang/srt/configs/mamba_utils.py (KDA state shapes); " +
			"index_kpool and max_position_embeddings as copies of zai-org/GLM-5.3-Flash config.json quote them",
		Revision:         "transformers 02106f7d89617f572b33cbd27dc3e3fed63866e9; sglang 02e208ded6769bd3332cbdc6cf0da939f541514f",
		MaxContextTokens: 1_048_576,
	}, presetGLM53Flash},
	{PresetInfo{
		Name: "qwen3-next-80b-a3b",
		Description: "Qwen3-Next-80B-A3B: 36 Gated DeltaNet layers in a state slot, " +
			"12 full-attention layers of 2 KV heads × 256 (every fourth), bf16",
		Source: "huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct config.json; " +
			"github.com/sgl-project/sglang python/sglang/srt/configs/qwen3_next.py (state shapes)",
		Revision:         "sglang 041bacd339d73f09b23e1f5d916017cc21c55640",
		MaxContextTokens: 262_144,
	}, presetQwen3Next},
	{PresetInfo{
		Name: "gpt-oss-120b",
		Description: "gpt-oss-120b: 36 layers of 8 KV heads × 64, bf16, alternating: " +
			"18 sliding-window (128 tokens) layers in a window group, 18 full-attention layers",
		Source:           "github.com/huggingface/transformers src/transformers/models/gpt_oss/configuration_gpt_oss.py (defaults of gpt-oss-120b)",
		Revision:         "02b8f42b4240dddea1b27c45d2dc95fb2682f841",
		MaxContextTokens: 131_072,
	}, presetGPTOSS120B},
}

// Presets describes every model preset Preset knows.
func Presets() []PresetInfo {
	infos := make([]PresetInfo, len(presets))
	for i, p := range presets {
		infos[i] = p.info
	}
	return infos
}

// Preset returns the cache spec of the named model (see Presets): a new
// spec each call, which the caller may change (for example to adopt the
// engine's tensors). An unknown name is an error wrapping
// ErrInvalidConfig that lists the known ones.
func Preset(name string) (CacheSpec, error) {
	for _, p := range presets {
		if p.info.Name == name {
			return p.build(name)
		}
	}
	names := make([]string, len(presets))
	for i, p := range presets {
		names[i] = p.info.Name
	}
	return CacheSpec{}, fmt.Errorf("%w: no model preset %q (known: %s)", ErrInvalidConfig, name, strings.Join(names, ", "))
}

// presetLlama31 is Llama-3.1-8B. meta-llama/Llama-3.1-8B's config.json
// (gated on Hugging Face; not in the sources searchable here, so read
// through copies of it, and no revision pinned):
//   - num_hidden_layers 32;
//   - num_key_value_heads 8;
//   - head_dim 128 = hidden_size 4096 / num_attention_heads 32;
//   - torch_dtype bfloat16; max_position_embeddings 131072.
func presetLlama31(name string) (CacheSpec, error) {
	const layers, kvHeads, headDim = 32, 8, 128
	return CacheSpec{Model: name, Groups: []CacheGroup{{
		Name: defaultGroupName, Kind: GroupPerToken, TokensPerPage: presetGQAPage,
		Regions: AttentionKV(layers, kvHeads, headDim, BF16, presetGQAPage),
	}}}, nil
}

// presetDeepSeekV3 is DeepSeek-V3, its latent in dtype: BF16 (vLLM's and
// SGLang's "auto") or FP8E4M3 for DeepSeek's fp8 serving format (vLLM's
// fp8_ds_mla: 512 fp8, 4 fp32 scales, 64 bf16 rope elements = 656 bytes).
// deepseek-ai/DeepSeek-V3's config.json (read through copies of it; no
// revision pinned):
//   - num_hidden_layers 61 (num_nextn_predict_layers 1 is the MTP draft,
//     not counted);
//   - kv_lora_rank 512, qk_rope_head_dim 64: the latent cached per token
//     per layer;
//   - max_position_embeddings 163840.
func presetDeepSeekV3(dtype DType) func(string) (CacheSpec, error) {
	return func(name string) (CacheSpec, error) {
		const layers, kvLoraRank, ropeDim = 61, 512, 64
		var regions []CacheRegion
		if dtype == FP8E4M3 {
			regions = MLALatentFP8(layerRange(layers), kvLoraRank, ropeDim, presetMLAPage)
		} else {
			regions = MLALatent(layerRange(layers), kvLoraRank, ropeDim, dtype, presetMLAPage)
		}
		return CacheSpec{Model: name, Groups: []CacheGroup{{
			Name: defaultGroupName, Kind: GroupPerToken, TokensPerPage: presetMLAPage, Regions: regions,
		}}}, nil
	}
}

// presetGLM5 is GLM-5 (model_type glm_moe_dsa): DeepSeek-V3.2-style sparse
// attention, every layer caching an MLA latent and its indexer's keys.
// transformers' GlmMoeDsaConfig, whose defaults are zai-org/GLM-5's
// (auto_docstring checkpoint="zai-org/GLM-5"; the same numbers as in the
// model's config.json quoted by xLLM's glm5.h and NVIDIA's Megatron
// Bridge notes: 78 layers, 202,752 positions):
//   - num_hidden_layers 78; layer_types: "deepseek_sparse_attention" on
//     every layer; indexer_types: "full" on every layer (index_topk_freq
//     1), so every layer runs its indexer and caches its keys;
//   - kv_lora_rank 512, qk_rope_head_dim 64: the latent, in bf16;
//   - index_head_dim 128: the indexer key, cached as 128 fp8 + one fp32
//     scale = 132 bytes per token (SGLang's NSATokenToKVPool:
//     index_head_dim + index_head_dim/128·4);
//   - max_position_embeddings 202752.
//
// Regions in layer order: layer.L.latent, then layer.L.indexer.
func presetGLM5(name string) (CacheSpec, error) {
	const layers, kvLoraRank, ropeDim, indexHeadDim = 78, 512, 64, 128
	var regions []CacheRegion
	for l := range layers {
		regions = append(regions, MLALatent([]int{l}, kvLoraRank, ropeDim, BF16, presetMLAPage)...)
		regions = append(regions, IndexerKeys([]int{l}, indexHeadDim, presetMLAPage)...)
	}
	return CacheSpec{Model: name, Groups: []CacheGroup{{
		Name: defaultGroupName, Kind: GroupPerToken, TokensPerPage: presetMLAPage, Regions: regions,
	}}}, nil
}

// presetGLM53Flash is GLM-5.3-Flash (model_type glm5_next): a hybrid of Kimi
// Delta Attention (KDA) linear-attention layers, whose whole memory of
// the prompt is a fixed state, and sparse MLA layers with a pooled
// indexer. transformers' Glm5NextTextConfig (defaults for the GLM-5-Next
// checkpoints) and SGLang's Glm5NextTextConfig give:
//   - num_hidden_layers 45; layer_types: "linear_attention" (KDA) where
//     layer % 4 != 3, "deepseek_sparse_attention" on layers 3, 7, …, 43
//     (the 11 of linear_attn_config.full_attn_layers);
//   - kv_lora_rank 512, qk_rope_head_dim 0 (mla_use_nope): a latent of
//     512 elements, no rope part, in bf16;
//   - index_head_dim 128;
//   - KDA: linear_num_heads 64, linear_head_dim 128 (num_heads, head_dim
//     of linear_attn_config), linear_conv_kernel_dim 4
//     (short_conv_kernel_size).
//
// Not in transformers' defaults, which are placeholders there (index_kpool
// 16; max_position_embeddings 4096, marked "TODO: check this value on
// release"): zai-org/GLM-5.3-Flash's config.json sets index_kpool 4 and
// max_position_embeddings 1048576, as several independent copies of its
// text_config quote it (and vLLM's kpool indexer tests: "index_kpool of
// zai-org/GLM-5.3-Flash: one indexer state pools 4"). The config.json
// itself was not readable here; SGLang's default max_position_embeddings
// is 1013760.
//
// Cache shapes:
//   - per token, on each of the 11 sparse layers: the latent, and one
//     indexer entry (128 fp8 + fp32 scale = 132 bytes) per index_kpool = 4
//     tokens, vLLM's Glm5NextIndexerCache (tokens_per_state = index_kpool);
//   - per request, on each of the 34 KDA layers (SGLang's
//     KimiLinearStateShape): a convolution window of (kernel − 1) = 3
//     positions of the q, k and v channels, 3 × 64 × 128 = 24,576, in bf16,
//     and a recurrent state of 64 heads × 128 × 128 in fp32.
//
// Regions: per token layer.L.latent, then layer.L.indexer, for each sparse
// layer; per slot layer.L.conv, then layer.L.state, for each KDA layer.
func presetGLM53Flash(name string) (CacheSpec, error) {
	const (
		layers                   = 45
		kvLoraRank, ropeDim      = 512, 0
		indexHeadDim, indexKPool = 128, 4
		kdaHeads, kdaHeadDim     = 64, 128 // linear_num_heads, linear_head_dim
		kdaConvKernel            = 4       // linear_conv_kernel_dim
	)
	sparse := Layers(layers, func(l int) bool { return l%4 == 3 })
	linear := Layers(layers, func(l int) bool { return l%4 != 3 })
	var perToken []CacheRegion
	for _, l := range sparse {
		indexer, err := PooledIndexerKeys([]int{l}, indexHeadDim, indexKPool, presetMLAPage)
		if err != nil {
			return CacheSpec{}, err
		}
		perToken = append(perToken, MLALatent([]int{l}, kvLoraRank, ropeDim, BF16, presetMLAPage)...)
		perToken = append(perToken, indexer...)
	}
	const convChannels = 3 * kdaHeads * kdaHeadDim // q, k and v each convolved
	return CacheSpec{Model: name, Groups: []CacheGroup{
		{Name: defaultGroupName, Kind: GroupPerToken, TokensPerPage: presetMLAPage, Regions: perToken},
		{Name: "state", Kind: GroupState,
			Regions: LinearAttentionState(linear, convChannels, kdaConvKernel, BF16, kdaHeads, kdaHeadDim, kdaHeadDim, FP32)},
	}}, nil
}

// presetQwen3Next is Qwen3-Next-80B-A3B: Gated DeltaNet linear-attention
// layers and a full-attention layer every full_attention_interval.
// Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (a verbatim copy; the
// same numbers are transformers' Qwen3NextConfig defaults):
//   - num_hidden_layers 48, full_attention_interval 4: layer L is
//     full attention where (L+1) % 4 == 0 (3, 7, …, 47: 12 layers), Gated
//     DeltaNet otherwise (36 layers);
//   - num_key_value_heads 2, head_dim 256: the full layers' K and V, bf16;
//   - linear_num_key_heads 16, linear_num_value_heads 32,
//     linear_key_head_dim 128, linear_value_head_dim 128,
//     linear_conv_kernel_dim 4;
//   - max_position_embeddings 262144.
//
// State shapes, SGLang's Qwen3NextConfig.mamba2_cache_params with
// Mamba2StateShape: a convolution window of (kernel − 1) = 3 positions of
// conv_dim = value_dim + 2 · key_dim = 32·128 + 2·16·128 = 8,192
// channels (q, k and v), bf16; a recurrent state of num_heads =
// linear_num_value_heads 32 × linear_key_head_dim 128 ×
// linear_value_head_dim 128, fp32.
func presetQwen3Next(name string) (CacheSpec, error) {
	const (
		layers, interval         = 48, 4
		kvHeads, headDim         = 2, 256
		keyHeads, valueHeads     = 16, 32
		keyHeadDim, valueHeadDim = 128, 128
		convKernel               = 4
	)
	full := Layers(layers, func(l int) bool { return (l+1)%interval == 0 })
	linear := Layers(layers, func(l int) bool { return (l+1)%interval != 0 })
	const convChannels = valueHeads*valueHeadDim + 2*keyHeads*keyHeadDim
	return CacheSpec{Model: name, Groups: []CacheGroup{
		{Name: defaultGroupName, Kind: GroupPerToken, TokensPerPage: presetGQAPage,
			Regions: AttentionKVOf(full, kvHeads, headDim, BF16, presetGQAPage)},
		{Name: "state", Kind: GroupState,
			Regions: LinearAttentionState(linear, convChannels, convKernel, BF16, valueHeads, keyHeadDim, valueHeadDim, FP32)},
	}}, nil
}

// presetGPTOSS120B is gpt-oss-120b: grouped-query attention whose layers
// alternate between a 128-token sliding window and full attention.
// transformers' GptOssConfig, whose defaults are gpt-oss-120b's (its
// auto_docstring names gpt-oss-20b, which has 24 layers; copies of
// openai/gpt-oss-120b's config.json give the 36 layers below):
//   - num_hidden_layers 36; layer_types "sliding_attention" where
//     (L+1) % 2 != 0 (the even layers, 18), "full_attention" on the odd;
//   - num_key_value_heads 8, head_dim 64, K and V in bf16 (the checkpoint
//     quantises only the experts' weights);
//   - sliding_window 128; max_position_embeddings 131072.
//
// The full layers are the per-token group; the sliding ones a window
// group whose ring holds a lease's last 128 tokens (9 pages of 16).
func presetGPTOSS120B(name string) (CacheSpec, error) {
	const layers, kvHeads, headDim, window = 36, 8, 64, 128
	sliding := Layers(layers, func(l int) bool { return (l+1)%2 != 0 })
	full := Layers(layers, func(l int) bool { return (l+1)%2 == 0 })
	return CacheSpec{Model: name, Groups: []CacheGroup{
		{Name: defaultGroupName, Kind: GroupPerToken, TokensPerPage: presetGQAPage,
			Regions: AttentionKVOf(full, kvHeads, headDim, BF16, presetGQAPage)},
		{Name: "window", Kind: GroupSlidingWindow, TokensPerPage: presetGQAPage, WindowTokens: window,
			Regions: AttentionKVOf(sliding, kvHeads, headDim, BF16, presetGQAPage)},
	}}, nil
}
