"""Shared pieces of the tests: a tiny deterministic "model" whose K, V and
Q of a token depend only on the token and its position (so a prefix's KV
is the same in every request, as a real model's is), paged attention
over kvfence pages written through the package's views, and contiguous
attention to compare it with.

The tests import the installed kvfence (scripts/ci-python.sh installs it
with pip), or, with PYTHONPATH=python, the source tree's.
"""

import pytest

torch = pytest.importorskip("torch")

HEADS = 4      # query heads
KV_HEADS = 2   # grouped-query attention: 2 query heads per KV head
HEAD_DIM = 8
VOCAB = 1000


class TinyModel:
    """K, V, Q of token t at position p: fixed random projections of
    emb[t] + pos[p]. Counts the tokens it computed."""

    def __init__(self, seed=0, max_pos=4096):
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(VOCAB, 32, generator=g)
        self.pos = torch.randn(max_pos, 32, generator=g) * 0.1
        self.wk = torch.randn(32, KV_HEADS * HEAD_DIM, generator=g) / 6
        self.wv = torch.randn(32, KV_HEADS * HEAD_DIM, generator=g) / 6
        self.wq = torch.randn(32, HEADS * HEAD_DIM, generator=g) / 6
        self.computed = 0

    def kvq(self, tokens, start=0):
        """K, V [n, KV_HEADS, HEAD_DIM] and Q [n, HEADS, HEAD_DIM] of
        tokens at positions start, start + 1, ..."""
        t = torch.as_tensor(tokens, dtype=torch.long)
        x = self.emb[t] + self.pos[start:start + len(t)]
        self.computed += len(t)
        n = len(t)
        return ((x @ self.wk).view(n, KV_HEADS, HEAD_DIM), (x @ self.wv).view(n, KV_HEADS, HEAD_DIM),
                (x @ self.wq).view(n, HEADS, HEAD_DIM))


def contiguous_attention(q, k, v, q_start):
    """Causal attention of queries at positions q_start.. over k, v [n, KV_HEADS, D]."""
    group = HEADS // KV_HEADS
    k = k.float().repeat_interleave(group, dim=1)  # [n, H, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / HEAD_DIM ** 0.5
    qpos = torch.arange(q_start, q_start + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_attention(queries, q_starts, seq_lens, block_tables, k_cache, v_cache):
    """Batched causal paged attention: the K/V of sequence i are read
    through row i of block_tables from k_cache, v_cache
    [num_blocks, block_size, KV_HEADS, D]; queries[i] [n_i, HEADS, D] are at
    positions q_starts[i]... Padded keys (past seq_lens[i]) are masked.
    Returns one [n_i, HEADS, D] output per sequence."""
    b, width = block_tables.shape
    bs = k_cache.shape[1]
    idx = block_tables.long()
    k = k_cache[idx].reshape(b, width * bs, KV_HEADS, HEAD_DIM).float()  # one gather for the batch
    v = v_cache[idx].reshape(b, width * bs, KV_HEADS, HEAD_DIM).float()
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    nq = max(q.shape[0] for q in queries)
    qpad = torch.zeros(b, nq, HEADS, HEAD_DIM)
    qpos = torch.full((b, nq), -1, dtype=torch.long)
    for i, q in enumerate(queries):
        qpad[i, : q.shape[0]] = q.float()
        qpos[i, : q.shape[0]] = torch.arange(q_starts[i], q_starts[i] + q.shape[0])
    scores = torch.einsum("bqhd,bkhd->bhqk", qpad, k) / HEAD_DIM ** 0.5
    kpos = torch.arange(width * bs)
    lens = torch.as_tensor(seq_lens)
    mask = (kpos[None, None, :] > qpos[:, :, None]) | (kpos[None, None, :] >= lens[:, None, None])
    mask[qpos < 0] = False  # padded query rows: keep finite, dropped below
    scores = scores.masked_fill(mask[:, None], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    return [out[i, : q.shape[0]] for i, q in enumerate(queries)]


@pytest.fixture
def model():
    return TinyModel()


def tolerance(dtype):
    return {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
