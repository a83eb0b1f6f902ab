"""Engine caches that a pool adopts: the engine's own KV tensors, in the
engine's shapes, allocated here with torch and handed to kvfence as a
cache spec with "memory" (kvcache/doc.go, "Cache groups"), so that the
tensors the model writes are the pool's pages:

    cache = kvfence.layouts.vllm(layers=32, num_blocks=4096, block_size=16,
                                 kv_heads=8, head_size=128, dtype="bf16")
    pool = kvfence.Pool({"max_context_tokens": 32768, "tenants": [...]}, adopt=cache)
    kv_caches = cache.tensors          # vLLM's per-layer [2, num_blocks, block_size, kv_heads, head_size]

The pool keeps the tensors referenced until it is destroyed; kvfence
scrubs their pages in place. Each layout says how its slots map to
kvfence's (slot_offset) and what shape one page of each region has
(page_shapes, which Pool.region(i).tensor() uses).
"""

from . import _views


def _torch_dtype(torch, dtype):
    name = _views.dtype_name(dtype)
    table = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
             "fp8": getattr(torch, "float8_e4m3fn", torch.uint8),
             "fp8_e4m3": getattr(torch, "float8_e4m3fn", torch.uint8),
             "fp8_e5m2": getattr(torch, "float8_e5m2", torch.uint8)}
    if name not in table:
        raise ValueError("kvfence: a KV cache of %s" % name)
    return name, table[name]


def _device(device):
    d = str(device)
    if d == "cpu":
        return "cpu", "cpu"
    if d.startswith("cuda"):
        ordinal = int(d.split(":", 1)[1]) if ":" in d else 0
        return ("cuda", ordinal), "cuda:%d" % ordinal
    raise ValueError("kvfence: device %r (cpu or cuda:N)" % device)


class EngineCache:
    """Tensors an engine allocated and the cache spec describing them.
    kind: "vllm", "sglang_mha" or "mla"; tensors: the engine's; num_blocks;
    block_size; dtype (kvfence's name); device ("cpu" or ("cuda", N));
    slot_offset: what to add to kvfence's slots to index the engine's
    token dimension."""

    def __init__(self, kind, tensors, regions, num_blocks, block_size, dtype, device, slot_offset=0):
        self.kind, self.tensors, self._regions = kind, tensors, regions
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.device, self.slot_offset = device, slot_offset

    def cache_spec(self):
        return {"model": "engine-" + self.kind, "groups": [{
            "name": "kv", "kind": "per_token", "tokens_per_page": self.block_size,
            "regions": [{"name": name, "dtype": self.dtype, "page_bytes": pb,
                         "memory": {"base": hex(base), "stride": stride, "pages": self.num_blocks,
                                    "bytes": (self.num_blocks - 1) * stride + pb}}
                        for name, base, stride, pb, _ in self._regions]}]}

    def page_shapes(self):
        return {name: shape for name, _, _, _, shape in self._regions}


def vllm(layers, num_blocks, block_size, kv_heads, head_size, dtype="bf16", device="cpu"):
    """vLLM's FlashAttention layout: per layer one tensor
    [2, num_blocks, block_size, kv_heads, head_size] (K = [0], V = [1]);
    a layer's K and V are two regions, V num_blocks pages after K.
    Slots are vLLM's: block * block_size + offset."""
    import torch
    name, tdt = _torch_dtype(torch, dtype)
    dev, tdev = _device(device)
    page = block_size * kv_heads * head_size * _views.element_size(name)
    tensors, regions = [], []
    for layer in range(layers):
        t = torch.empty((2, num_blocks, block_size, kv_heads, head_size), dtype=tdt, device=tdev)
        tensors.append(t)
        for i, kv in enumerate("kv"):
            regions.append(("layer.%d.%s" % (layer, kv), t[i].data_ptr(), page, page, (block_size, kv_heads, head_size)))
    return EngineCache("vllm", tensors, regions, num_blocks, block_size, name, dev)


def sglang_mha(layers, num_pages, page_size, head_num, head_dim, dtype="bf16", device="cpu"):
    """SGLang's MHATokenToKVPool: per layer k_buffer and v_buffer of
    [(num_pages + 1) * page_size, head_num, head_dim], tokens flat; its
    first page is SGLang's padding page (dummy tokens are written to slot
    0), so kvfence adopts each buffer from its second page on: kvfence's
    page p is SGLang's page p + 1, and slot_offset = page_size.
    tensors = (k_buffers, v_buffers)."""
    import torch
    name, tdt = _torch_dtype(torch, dtype)
    dev, tdev = _device(device)
    es = _views.element_size(name)
    page = page_size * head_num * head_dim * es
    ks, vs, regions = [], [], []
    for layer in range(layers):
        k = torch.empty(((num_pages + 1) * page_size, head_num, head_dim), dtype=tdt, device=tdev)
        v = torch.empty_like(k)
        ks.append(k)
        vs.append(v)
        for kv, t in (("k", k), ("v", v)):
            regions.append(("layer.%d.%s" % (layer, kv), t.data_ptr() + page, page, page, (page_size, head_num, head_dim)))
    return EngineCache("sglang_mha", (ks, vs), regions, num_pages, page_size, name, dev, slot_offset=page_size)


def mla(layers, num_blocks, block_size, kv_lora_rank=512, qk_rope_head_dim=64, dtype="bf16", device="cpu"):
    """vLLM's MLA layout: per layer one latent tensor
    [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (the
    compressed KV and the rope key of each token); one region per layer."""
    import torch
    name, tdt = _torch_dtype(torch, dtype)
    dev, tdev = _device(device)
    width = kv_lora_rank + qk_rope_head_dim
    page = block_size * width * _views.element_size(name)
    tensors, regions = [], []
    for layer in range(layers):
        t = torch.empty((num_blocks, block_size, width), dtype=tdt, device=tdev)
        tensors.append(t)
        regions.append(("layer.%d.latent" % layer, t.data_ptr(), page, page, (block_size, width)))
    return EngineCache("mla", tensors, regions, num_blocks, block_size, name, dev)
