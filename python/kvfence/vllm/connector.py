"""kvfence's KV connector for vLLM, named in kv_transfer_config:

    {"kv_connector": "KvfenceConnector",
     "kv_connector_module_path": "kvfence.vllm.connector",
     "kv_role": "kv_producer",
     "kv_connector_extra_config": {"kvfence": {...}}}

In the scheduler's process it has vLLM's waiting loop skip a request
kvfence refused for its tenant's sake or for good (_plugin.ConnectorScheduler);
in each worker process it runs kvfence's rank worker over the KV cache
tensors vLLM allocated and launches the scrubs after each step's forward
(_plugin.ConnectorWorker). It loads and saves no KV. Importing this
module imports vLLM.
"""

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                 KVConnectorRole)

from ._plugin import ConnectorScheduler, ConnectorWorker, listen_address, plugin_config


class KvfenceConnectorMetadata(KVConnectorMetadata):
    """Nothing passes from the scheduler's connector to the workers':
    the scrubs go over kvfence's own connection."""


class KvfenceConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = plugin_config(vllm_config.kv_transfer_config)
        self._kvf_sched = ConnectorScheduler() if role == KVConnectorRole.SCHEDULER else None
        self._kvf_work = None
        if role == KVConnectorRole.WORKER:
            from vllm.distributed import get_tensor_model_parallel_rank
            if kv_cache_config is not None:
                layers, blocks = list(kv_cache_config.kv_cache_groups[0].layer_names), kv_cache_config.num_blocks
            else:
                layers, blocks = None, vllm_config.cache_config.num_gpu_blocks
            self._kvf_work = ConnectorWorker(listen_address(cfg, vllm_config.parallel_config.data_parallel_rank),
                                             get_tensor_model_parallel_rank(), layers, blocks,
                                             step_lag=cfg.get("step_lag", 1),
                                             connect_timeout_ms=cfg.get("connect_timeout_ms", 600000))

    @property
    def requires_kv_delivery(self):
        return False  # nothing is handed off: a preempted request just recomputes

    # ---- scheduler side

    def kvf_bind(self, manager):
        self._kvf_sched.kvf_bind(manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._kvf_sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KvfenceConnectorMetadata()

    def request_finished(self, request, block_ids):
        return self._kvf_sched.request_finished(request, block_ids)

    def has_pending_push_work(self):
        return self._kvf_sched is not None and self._kvf_sched.has_pending_push_work()

    # ---- worker side

    def register_kv_caches(self, kv_caches):
        w = self._kvf_work
        if w.layer_names is None:
            w.layer_names = list(kv_caches)
        w.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        self._kvf_work.wait_for_save()

    def shutdown(self):
        if self._kvf_work is not None:
            self._kvf_work.close()
