"""The two modules that subclass vLLM's classes (scheduler.py,
connector.py) import vLLM, which these machines cannot install. Here they
import against stand-ins of the few vLLM names they use, each with the
shape it has at 003df29 (KVConnectorBase_V1's abstract methods, the
Scheduler's constructor), to check how they are put together: the
plugin's methods come before vLLM's, the connector implements every
abstract method, and a configuration kvfence cannot serve is refused with
its reason. What vLLM does with them is vllm_replay's business."""

import abc
import enum
import importlib
import sys
import types
from types import SimpleNamespace

import pytest


class _Role(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class _Metadata(abc.ABC):  # noqa: B024
    pass


class _ConnectorBase(abc.ABC):
    """KVConnectorBase_V1 at 003df29: its abstract methods and __init__."""

    def __init__(self, vllm_config, role, kv_cache_config):
        self._vllm_config, self._role, self._kv_cache_config = vllm_config, role, kv_cache_config
        self._kv_transfer_config = vllm_config.kv_transfer_config

    def bind_gpu_block_pool(self, gpu_block_pool):
        return

    @abc.abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_name): ...

    @abc.abstractmethod
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...

    @abc.abstractmethod
    def wait_for_save(self): ...

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens): ...

    @abc.abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens): ...

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output): ...


class _Scheduler:
    def schedule(self, throttle_prefills=False):
        return "vllm's schedule"


class _AsyncScheduler(_Scheduler):
    pass


@pytest.fixture
def stand_ins(monkeypatch):
    names = {
        "vllm": {}, "vllm.v1": {}, "vllm.v1.core": {}, "vllm.v1.core.sched": {},
        "vllm.v1.core.sched.scheduler": {"Scheduler": _Scheduler},
        "vllm.v1.core.sched.async_scheduler": {"AsyncScheduler": _AsyncScheduler},
        "vllm.v1.engine": {"EngineCoreOutput": object, "EngineCoreOutputs": object},
        "vllm.v1.request": {"RequestStatus": object},
        "vllm.distributed": {"get_tensor_model_parallel_rank": lambda: 1},
        "vllm.distributed.kv_transfer": {}, "vllm.distributed.kv_transfer.kv_connector": {},
        "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {
            "KVConnectorBase_V1": _ConnectorBase, "KVConnectorMetadata": _Metadata, "KVConnectorRole": _Role},
    }
    for name, attrs in names.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
    for m in ("kvfence.vllm.scheduler", "kvfence.vllm.connector"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    yield
    for m in ("kvfence.vllm.scheduler", "kvfence.vllm.connector"):
        sys.modules.pop(m, None)


def vllm_config(**parallel):
    extra = {"kvfence": {"listen": "unix:/tmp/kvf-{dp}.sock", "tenant_resolver": "static:a"}}
    p = dict(pipeline_parallel_size=1, tensor_parallel_size=2, data_parallel_rank=0,
             decode_context_parallel_size=1, prefill_context_parallel_size=1)
    p.update(parallel)
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
                           parallel_config=SimpleNamespace(**p), max_concurrent_batches=1,
                           model_config=SimpleNamespace(is_encoder_decoder=False),
                           cache_config=SimpleNamespace(num_gpu_blocks=64))


class FullAttentionSpec:
    block_size, num_kv_heads, head_size, dtype, sliding_window = 16, 2, 64, "torch.bfloat16", None


class MLAAttentionSpec(FullAttentionSpec):
    pass


def kv_cache_config(*specs):
    return SimpleNamespace(num_blocks=64,
                           kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec=s) for s in specs])


def test_plugin_classes_put_kvfence_first(stand_ins):
    sched = importlib.import_module("kvfence.vllm.scheduler")
    from kvfence.vllm._plugin import SchedulerMixin
    for cls, base in ((sched.Scheduler, _Scheduler), (sched.AsyncScheduler, _AsyncScheduler)):
        mro = cls.__mro__
        assert mro.index(SchedulerMixin) < mro.index(base)
        assert cls.schedule is SchedulerMixin.schedule and cls.update_from_output is SchedulerMixin.update_from_output


def test_plugin_refuses_what_kvfence_does_not_serve(stand_ins):
    sched = importlib.import_module("kvfence.vllm.scheduler")
    ok = kv_cache_config(FullAttentionSpec())
    assert sched._unsupported(vllm_config(), ok) is None
    cases = {
        "KV cache groups": (vllm_config(), kv_cache_config(FullAttentionSpec(), FullAttentionSpec())),
        "MLAAttentionSpec": (vllm_config(), kv_cache_config(MLAAttentionSpec())),
        "pipeline": (vllm_config(pipeline_parallel_size=2), ok),
        "context parallelism": (vllm_config(decode_context_parallel_size=2), ok),
    }
    for want, (vc, kvc) in cases.items():
        assert want in sched._unsupported(vc, kvc)
    vc = vllm_config()
    vc.max_concurrent_batches = 3
    assert "batches in flight" in sched._unsupported(vc, ok)


def test_connector_implements_the_interface(stand_ins):
    conn = importlib.import_module("kvfence.vllm.connector")
    c = conn.KvfenceConnector(vllm_config(), _Role.SCHEDULER, kv_cache_config(FullAttentionSpec()))
    assert c.requires_kv_delivery is False and isinstance(c.build_connector_meta(None), _Metadata)
    with pytest.raises(RuntimeError, match="scheduler-cls"):
        c.get_num_new_matched_tokens(SimpleNamespace(request_id="r"), 0)
    w = conn.KvfenceConnector(vllm_config(data_parallel_rank=2), _Role.WORKER, kv_cache_config(FullAttentionSpec()))
    assert w._kvf_work.connect == "unix:/tmp/kvf-2.sock" and w._kvf_work.rank == 1
    assert w._kvf_work.layer_names == ["l0", "l1"] and w._kvf_work.num_blocks == 64
    assert w.wait_for_save() is None  # before the rank worker has joined: nothing to do
