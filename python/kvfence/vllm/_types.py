"""vLLM's result types that its scheduler inspects, as the manager hands
them over: vLLM's own classes where vLLM is installed (PrefixCacheStats,
the KV events), faithful minimal mirrors where it is not (these tests, and
engines that speak vLLM's vocabulary without vLLM), and KVCacheBlocks,
which is always the mirror (see its doc). Every mirror follows vLLM at
VLLM_COMMIT field for field in what the scheduler reads."""

from dataclasses import dataclass, field

VLLM_COMMIT = "003df2961dd8830c317a61f9745ccd557da9fa06"
"""The vLLM commit (main, 003df29) whose Scheduler, AsyncScheduler,
KVCacheManager and KV connector interface kvfence.vllm was written
against: vllm/v1/core/sched/scheduler.py, kv_cache_manager.py,
kv_cache_utils.py and request.py at this commit. async_scheduler.py was
read at 014b23503270 (the store had no copy at 003df29); it calls the
manager once, cache_blocks, as here."""


class KVCacheBlocks:
    """vLLM's KVCacheBlocks (kv_cache_manager.py): one sequence of blocks
    per KV cache group (the manager's kv_cache_groups: one full-attention
    group, or a hybrid model's several), holding block IDs where vLLM's
    holds KVCacheBlock objects, whose block_id is all the scheduler reads
    of them (through get_block_ids). The lists are the manager's own fresh
    ones, never changed after they are handed out: vLLM's worker may
    extend what it received in place."""

    __slots__ = ("blocks",)

    def __init__(self, blocks):
        self.blocks = blocks

    def get_block_ids(self, allow_none=False):
        """The block IDs per group; None with allow_none when every group
        is empty (vLLM's "no new blocks" for a running request)."""
        if allow_none and not any(self.blocks):
            return None
        return tuple(self.blocks)

    def get_unhashed_block_ids(self):
        return list(self.blocks[0])

    def get_unhashed_block_ids_all_groups(self):
        return [list(g) for g in self.blocks]

    def __add__(self, other):
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))

    def new_empty(self):
        return KVCacheBlocks(tuple(() for _ in self.blocks))

    def __eq__(self, other):
        return isinstance(other, KVCacheBlocks) and tuple(map(list, self.blocks)) == tuple(map(list, other.blocks))

    def __repr__(self):
        return "KVCacheBlocks(%r)" % (self.blocks,)


@dataclass
class _PrefixCacheStats:
    """Mirror of vLLM's PrefixCacheStats (vllm/v1/metrics/stats.py)."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens, num_hits, preempted=False):
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass
class _BlockStored:
    """Mirror of vLLM's BlockStored (vllm/distributed/kv_events.py)."""

    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    lora_id: object
    medium: object
    lora_name: object
    extra_keys: object = None
    group_idx: object = None


@dataclass
class _BlockRemoved:
    block_hashes: list
    medium: object
    group_idx: object = None


@dataclass
class _AllBlocksCleared:
    pass


try:  # vLLM's own types, where the engine runs in vLLM
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.v1.metrics.stats import PrefixCacheStats
    HAVE_VLLM = True
except ImportError:
    PrefixCacheStats, BlockStored, BlockRemoved, AllBlocksCleared = (_PrefixCacheStats, _BlockStored, _BlockRemoved,
                                                                     _AllBlocksCleared)
    HAVE_VLLM = False


@dataclass
class BlockPoolView:
    """What the scheduler reads of the manager's block_pool at
    VLLM_COMMIT besides the manager's own calls: hash_block_size
    (streaming sessions, EAGLE hashing, failed loads) and free_blocks
    (blocks of copy-on-write retentions and deferred frees, which this
    manager never hands out: it is called with none)."""

    hash_block_size: int
    num_blocks: int
    _usage: object = field(default=None, repr=False)

    def free_blocks(self, blocks):
        blocks = list(blocks)
        if blocks:
            raise ValueError("kvfence: the block pool was handed %d blocks to free; kvfence's manager hands out "
                             "none that the scheduler frees itself" % len(blocks))

    def get_usage(self):
        return self._usage() if self._usage else 0.0

    def reset_prefix_cache(self):
        return False
