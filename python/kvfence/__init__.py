"""kvfence for Python engines: pools of paged KV-cache memory shared by
tenants, through libkvfence's C ABI (capi/include/kvfence.h), with the
standard library alone; torch (tensor views, block tables and slot
mappings as tensors, stream-ordered release) and numpy are optional.

    import kvfence
    with kvfence.Pool(config) as pool:
        k, v = pool.kv_views(0)                         # torch views of layer 0's pages
        with pool.admit_tokens("r1", "acme", ids, max_new_tokens=256) as lease:
            slots = lease.slot_mapping_tensor(lease.hit_tokens(), len(ids))
            table = lease.block_table_tensor()
            ...                                         # prefill, decode
        # leaving the block released the lease after torch.cuda.current_stream()

Every failed call raises a KvfenceError subclass named after the Go
error (kvfence.ExceedsQuota, kvfence.PoolExhausted, ...) with the numbers.
See python/README.md.
"""

from . import _lib
from ._core import PHASES, Export, Import, Lease, Pool, RankWorker, Receiver, UCXServer, UCXTransport, default_stream, ucx_available
from ._lib import ABI_VERSION, STREAM_LEGACY, STREAM_PER_THREAD, library_path
from ._views import CudaArray, RegionView
from .errors import *  # noqa: F401,F403
from .errors import AdmissionError, KvfenceError, STATUSES
from . import errors as _errors
from . import layouts  # noqa: F401

__version__ = "0.1.0"

OK = 0
# The status codes as module constants (ERR_EXCEEDS_QUOTA = 25, ...), as
# examples/python/kvfence.py had them.
for _code, _cname, _go in STATUSES:
    globals()[_cname[4:]] = _code
del _code, _cname, _go


def version():
    """The library's version."""
    return _lib.version().decode()


def abi_version():
    return _lib.abi_version()


def status_name(status):
    return _lib.status_name(status).decode()


__all__ = ["Pool", "Lease", "Export", "Import", "Receiver", "UCXServer", "UCXTransport", "ucx_available",
           "RankWorker", "RegionView", "CudaArray",
           "KvfenceError", "AdmissionError", "default_stream", "version", "abi_version", "status_name",
           "library_path", "layouts", "STREAM_LEGACY", "STREAM_PER_THREAD", "ABI_VERSION", "PHASES"] + \
    [n for n in _errors.__all__ if n not in ("from_last_error", "check")]
