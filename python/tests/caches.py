"""The three ways the tests hold K/V in kvfence pages: the pool's own
memory ("owned", Pool.kv_views), vLLM's per-layer [2, blocks, block_size,
heads, dim] tensors adopted by the pool ("vllm"), and SGLang's padded
per-layer token buffers adopted from their second page ("sglang"). Each
writes K/V at a lease's slots through the package's views and reads
through block tables."""

import kvfence
import torch

from conftest import HEAD_DIM, KV_HEADS

BLOCK = 8
LAYERS = 2
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def config(pages, tenants, scrub=None, **extra):
    cfg = {"pages": pages, "max_context_tokens": pages * BLOCK,
           "tenants": [t if isinstance(t, dict) else {"name": t} for t in tenants]}
    if scrub:
        cfg["scrub"] = scrub
    cfg.update(extra)
    return cfg


class Cache:
    def __init__(self, kind, dtype, pages, tenants, scrub=None, **extra):
        self.kind, self.dtype = kind, dtype
        cfg = config(pages, tenants, scrub, **extra)
        name = DTYPES[dtype]
        self.offset = 0
        if kind == "owned":
            cfg["geometry"] = {"tokens_per_page": BLOCK, "layers": LAYERS, "kv_heads": KV_HEADS,
                               "head_dim": HEAD_DIM, "dtype": name}
            self.pool = kvfence.Pool(cfg)
            self.engine = None
        elif kind == "vllm":
            self.engine = kvfence.layouts.vllm(LAYERS, pages, BLOCK, KV_HEADS, HEAD_DIM, dtype=name)
            self.pool = kvfence.Pool(cfg, adopt=self.engine)
        elif kind == "sglang":
            self.engine = kvfence.layouts.sglang_mha(LAYERS, pages, BLOCK, KV_HEADS, HEAD_DIM, dtype=name)
            self.pool = kvfence.Pool(cfg, adopt=self.engine)
            self.offset = self.engine.slot_offset
        else:
            raise ValueError(kind)

    def write(self, layer, slots, k, v):
        """Writes k, v [n, KV_HEADS, D] at kvfence slots (the engine's
        reshape_and_cache), through the view the engine would use."""
        if self.kind == "owned":
            kc, vc = self.pool.kv_views(layer)
            kc.flatten(0, 1)[slots] = k.to(self.dtype)
            vc.flatten(0, 1)[slots] = v.to(self.dtype)
        elif self.kind == "vllm":
            kv = self.pool.vllm_kv_cache(layer)  # the pool's view, in vLLM's shape
            kv[0].flatten(0, 1)[slots] = k.to(self.dtype)
            kv[1].flatten(0, 1)[slots] = v.to(self.dtype)
        else:
            kb, vb = self.engine.tensors[0][layer], self.engine.tensors[1][layer]
            kb[slots + self.offset] = k.to(self.dtype)  # SGLang indexes its flat buffers by slot
            vb[slots + self.offset] = v.to(self.dtype)

    def pages(self, layer):
        """K, V of the layer as [num_blocks, BLOCK, KV_HEADS, D], indexed by
        kvfence page: the engine's own tensors where it has them."""
        if self.kind == "owned":
            return self.pool.kv_views(layer)
        if self.kind == "vllm":
            t = self.engine.tensors[layer]
            return t[0], t[1]
        kb, vb = self.engine.tensors[0][layer], self.engine.tensors[1][layer]
        return kb[BLOCK:].view(-1, BLOCK, KV_HEADS, HEAD_DIM), vb[BLOCK:].view(-1, BLOCK, KV_HEADS, HEAD_DIM)

    def slots(self, lease, start, end):
        return lease.slot_mapping_tensor(start, end)

    def close(self):
        self.pool.close()
