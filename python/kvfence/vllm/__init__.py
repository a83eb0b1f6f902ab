"""kvfence inside vLLM: a KV cache manager, a scheduler plugin and a KV
connector that run in vLLM's own loop, written against vLLM's main at
commit 003df29 (VLLM_COMMIT): vllm/v1/core/sched/scheduler.py,
kv_cache_manager.py, kv_cache_utils.py, request.py and the KV connector
interface (vllm/distributed/kv_transfer/kv_connector/v1/base.py) at that
commit. python/README.md, "Running kvfence in vLLM", has the flags.

- KVCacheManager (this module, standard library only): every method,
  signature and return type vLLM's Scheduler and AsyncScheduler call on
  their kv_cache_manager at VLLM_COMMIT, over a kvfence Pool.
- scheduler.Scheduler / scheduler.AsyncScheduler (import vLLM): vLLM's
  schedulers with this manager, for --scheduler-cls.
- connector.KvfenceConnector (imports vLLM): the KV connector for
  kv_transfer_config; it runs kvfence's rank worker in each worker process.

# The model

A request is admitted in get_computed_blocks, the scheduler's prefix
lookup: kvfence finds the cached prefix in the tenant's sharing domain and
reserves, all or nothing, every page of the prompt and the room of its
first step (and, with the pool's default "sizing": "full", of all its
output; the plugin defaults to "on_demand" with a headroom). The pages of
a hit are its lease's first pages. A lease never leaves a page to another
request before kvfence has scrubbed it.

Block tables. The worker holds one row per KV cache group, each what
the lease holds for the tokens its rows cover: get_blocks (new and
resumed requests, taken whole by the worker) gives them, allocate_slots
(running requests, appended) only the positions past what the worker
holds. No position is reported twice, and no row is longer than
cdiv(max_model_len, block_size).

Hybrid models (_groups). Over a pool with a cache spec, each of vLLM's
KV cache groups is a kvfence group: full attention the per-token pages
(the block table), a sliding window the lease's ring (position i: the
ring page of logical page i), Mamba and other linear attention the
lease's state slot (one entry, vLLM's "none" cache mode). Such a pool
shares prefixes through state checkpoints: a hit is the longest cached
prefix ending at one, its state and window restored into the lease's
slot and ring before admission returns, and vLLM is told the hit's tokens
as computed (its worker then starts from the state in the slot, as it
does for a chunk of prefill). The plugin has prefill chunks end where
vLLM's "align" cache mode would (block boundaries, the prompt's last
one) and at the lease's PrefillCheckpoint; the manager checkpoints when a
step starts on a page boundary of the prompt, before that step runs, and
a preemption with nothing in flight checkpoints what was computed. A
window's ring slides to the end of each step before the step runs, so
it must hold the window and all a request can have scheduled past its
processed tokens (checked at start and every step).

Refusals. vLLM reads None from allocate_slots as "the pool is out of
blocks": it preempts running requests, or stops admitting from the waiting
queue. kvfence's refusals mean more than that, and map to what the
scheduler does right with them:

- the pool short for everyone (PoolExhausted without a cause, or a
  faulted pool) is None: vLLM's back-pressure;
- the tenant's own limit (ExceedsQuota now; PoolExhausted because the free
  pages are other tenants' unused reservations or kept for growth) never
  preempts another tenant's request and never blocks another tenant's
  queue: the connector has the waiting loop skip the request this step
  (get_num_new_matched_tokens is None), and before vLLM's running loop the
  plugin preempts that tenant's own newest request to let a running one
  grow;
- a refusal for good (longer than the context, the pool or the tenant's
  whole quota; an unknown, unauthenticated or client-chosen tenant) is
  skipped too and finished with FINISHED_ERROR after schedule(): nothing
  raises out of the scheduler.

Publishing. kvfence shares a page only once its KV exists: the full prompt
pages below the request's processed tokens (num_computed_tokens -
num_in_flight_tokens: steps whose output has come back) are published at
the request's next allocate_slots (the synchronous Scheduler never calls
cache_blocks) or cache_blocks (AsyncScheduler). A preempted request's
full pages stay cached for its resumption (kvfence's Lease.preempt); a
finished request's other pages are scrubbed. A hybrid pool publishes
pages only with a checkpoint at their end (above): Lease.cache_prefix at
a page boundary there checkpoints the state as it is, which may reflect
other tokens.

Keys. The prefix key covers the tenant's sharing domain (server-side),
the LoRA adapter, the operator's salt and the request's cache_salt (the
adapter string) and, page by page, the multimodal items the page's
placeholder tokens stand for (extra key material): equal tokens with
another LoRA or another image never share a page (_keys).
reset_prefix_cache drops the cache through kvfence, scrubbing it, and
stops the leases admitted before from publishing.

Worker side. The KV memory is vLLM's, in its worker processes: the
scheduler's pool is over remote ranks, and each tensor-parallel worker
runs a kvfence RankWorker over the tensors vLLM allocated (adopted), which
launches the scrubs at the end of each step's forward on that step's
stream, one step late (the connector's doc says why).

Not served: hybrid models through the scheduler plugin (a pool over
remote ranks holds one per-token group and cannot copy a state; the
manager serves them over a local pool), speculative decoding with a
state group, window groups whose pages are not the per-token group's
size, MLA, pipeline and context parallelism, encoder-decoder models,
external KV (other connectors, P/D through vLLM's connector API: kvfence's
own handoff is Lease.export / Receiver), cascade attention (the common
prefix is reported as 0), vLLM's KV cache zeroing and copy-on-write
(kvfence scrubs instead), prompt-embedding requests' prefix sharing,
streaming-input sessions.
"""

from ._groups import KVCacheGroup
from ._keys import ClientTenantField, TenantError, Unauthenticated, adapter_of, page_extra_of, resolver
from ._manager import BACKPRESSURE, DEFERRED, ERROR, KVCacheManager, Refusal, classify
from ._types import HAVE_VLLM, VLLM_COMMIT, KVCacheBlocks, PrefixCacheStats

__all__ = ["KVCacheManager", "KVCacheGroup", "KVCacheBlocks", "PrefixCacheStats", "Refusal", "classify",
           "BACKPRESSURE", "DEFERRED", "ERROR", "VLLM_COMMIT", "HAVE_VLLM", "TenantError", "Unauthenticated",
           "ClientTenantField", "resolver", "adapter_of", "page_extra_of"]
