"""Exceptions: one class per kvfence status, named after the Go sentinel
error the status mirrors (KVF_ERR_EXCEEDS_QUOTA is kvcache.ErrExceedsQuota:
class ExceedsQuota), each carrying the numbers of kvf_last_error.

    try:
        lease = pool.admit_tokens("r1", "acme", ids)
    except kvfence.ExceedsQuota as e:      # or kvfence.AdmissionError, KvfenceError
        print(e.go_error, e.need, e.have, e.limit, e.retryable, e.permanent)

Admission refusals (statuses 20-26, and 80: an admission whose copy out
of the host tier failed) derive from AdmissionError, as the Go refusals
are *kvcache.AdmissionError. Bad arguments and configurations (a host
tier a pool cannot have, 79, among them) are also ValueErrors.
PoolClosed is raised by the package itself, too, for a pool closed on
the Python side (a view of a closed pool).
"""

from . import _lib

# status, C enumerator, the Go sentinel it mirrors (capi/internal/bridge/status.go).
STATUSES = (
    (1, "KVF_ERR_INVALID_ARGUMENT", "kvcache.ErrInvalidArgument"),
    (2, "KVF_ERR_NULL_POINTER", "bridge.ErrNullPointer"),
    (3, "KVF_ERR_INVALID_HANDLE", "bridge.ErrInvalidHandle"),
    (4, "KVF_ERR_BUFFER_TOO_SMALL", "bridge.ErrBufferTooSmall"),
    (5, "KVF_ERR_INTERNAL", "bridge.ErrInternal"),
    (10, "KVF_ERR_INVALID_CONFIG", "kvcache.ErrInvalidConfig"),
    (11, "KVF_ERR_UNDERSIZED_POOL", "kvcache.ErrUndersizedPool"),
    (20, "KVF_ERR_INVALID_REQUEST", "kvcache.ErrInvalidRequest"),
    (21, "KVF_ERR_UNKNOWN_TENANT", "kvcache.ErrUnknownTenant"),
    (22, "KVF_ERR_DUPLICATE_REQUEST", "kvcache.ErrDuplicateRequest"),
    (23, "KVF_ERR_EXCEEDS_MAX_CONTEXT", "kvcache.ErrExceedsMaxContext"),
    (24, "KVF_ERR_EXCEEDS_CAPACITY", "kvcache.ErrExceedsCapacity"),
    (25, "KVF_ERR_EXCEEDS_QUOTA", "kvcache.ErrExceedsQuota"),
    (26, "KVF_ERR_POOL_EXHAUSTED", "kvcache.ErrPoolExhausted"),
    (30, "KVF_ERR_POOL_CLOSED", "kvcache.ErrPoolClosed"),
    (31, "KVF_ERR_POOL_FAULTED", "kvcache.ErrPoolFaulted"),
    (32, "KVF_ERR_LEASE_RELEASED", "kvcache.ErrLeaseReleased"),
    (33, "KVF_ERR_SCRUB_FAILED", "kvcache.ErrScrubFailed"),
    (34, "KVF_ERR_CANARY_MISMATCH", "kvcache.ErrCanaryMismatch"),
    (40, "KVF_ERR_INVALID_TENANT", "isolation.ErrInvalidTenant"),
    (41, "KVF_ERR_DUPLICATE_TENANT", "isolation.ErrDuplicateTenant"),
    (42, "KVF_ERR_OVER_RESERVED", "isolation.ErrOverReserved"),
    (50, "KVF_ERR_NO_DEVICE", "cudaops.ErrNoDevice"),
    (51, "KVF_ERR_DEVICE_OUT_OF_MEMORY", "cudaops.ErrOutOfMemory"),
    (52, "KVF_ERR_DEVICE_FAILED", "cudaops.ErrDriver"),
    (53, "KVF_ERR_BAD_ORDERING", "cudaops.ErrBadOrdering"),
    (60, "KVF_ERR_LEASE_PHASE", "kvcache.ErrLeasePhase"),
    (61, "KVF_ERR_RECLAIMED", "kvcache.ErrReclaimed"),
    (62, "KVF_ERR_STALE_TRANSFER", "kvcache.ErrStaleTransfer"),
    (63, "KVF_ERR_DUPLICATE_PAGE", "kvcache.ErrDuplicatePage"),
    (64, "KVF_ERR_INCOMPLETE_TRANSFER", "kvcache.ErrIncompleteTransfer"),
    (65, "KVF_ERR_CHECKSUM_MISMATCH", "kvcache.ErrChecksumMismatch"),
    (66, "KVF_ERR_MALFORMED_MANIFEST", "handoff.ErrMalformedManifest"),
    (67, "KVF_ERR_BAD_MAC", "handoff.ErrBadMAC"),
    (68, "KVF_ERR_MANIFEST_EXPIRED", "handoff.ErrExpired"),
    (69, "KVF_ERR_GEOMETRY_MISMATCH", "handoff.ErrGeometryMismatch"),
    (70, "KVF_ERR_DOMAIN_MISMATCH", "handoff.ErrDomainMismatch"),
    (71, "KVF_ERR_REPLAY", "handoff.ErrReplay"),
    (72, "KVF_ERR_IN_PROGRESS", "handoff.ErrInProgress"),
    (73, "KVF_ERR_SHARD_MISMATCH", "handoff.ErrShardMismatch"),
    (74, "KVF_ERR_NO_STATE_GROUP", "kvcache.ErrNoStateGroup"),
    (75, "KVF_ERR_CHECKPOINT_CAPACITY", "kvcache.ErrCheckpointCapacity"),
    (76, "KVF_ERR_TRANSPORT", "handoff.ErrTransport"),
    (77, "KVF_ERR_PROTOCOL", "handoff.ErrProtocol"),
    (78, "KVF_ERR_UNAVAILABLE", "ucxx.ErrUnavailable"),
    (79, "KVF_ERR_TIER_UNSUPPORTED", "kvcache.ErrTierUnsupported"),
    (80, "KVF_ERR_ONLOAD_FAILED", "kvcache.ErrOnloadFailed"),
    (81, "KVF_ERR_OFFLOAD_FAILED", "kvcache.ErrOffloadFailed"),
)

OK = 0


class KvfenceError(Exception):
    """A failed kvfence call. status: the C status (int); name: its C
    enumerator; go_error: the Go sentinel it mirrors; message: the Go
    error's text; need, have, limit (pages; tokens for ExceedsMaxContext;
    elements or bytes for BufferTooSmall), need_tokens, limit_tokens;
    retryable, permanent (admission refusals); cause, for PoolExhausted
    (ABI 8): None when the pool's supply is short, "reserved" when the
    free pages are other tenants' unused reservations, "kept_for_growth"
    when they are kept for running leases' growth."""

    status = -1
    name = "KVF_ERR_UNKNOWN_STATUS"
    go_error = ""

    def __init__(self, message, status=None, need=0, have=0, limit=0, need_tokens=0, limit_tokens=0,
                 retryable=False, permanent=False, cause=None):
        if status is not None:
            self.status = status
            self.name = _lib.status_name(status).decode()
        self.message = message
        self.need, self.have, self.limit = need, have, limit
        self.need_tokens, self.limit_tokens = need_tokens, limit_tokens
        self.retryable, self.permanent = retryable, permanent
        self.cause = cause
        super().__init__(message)

    def __str__(self):
        nums = ""
        if self.need or self.have or self.limit:
            nums = " (need %d, have %d, limit %d)" % (self.need, self.have, self.limit)
        msg = self.message if self.message.startswith(self.name) else "%s: %s" % (self.name, self.message)
        return msg + nums


class AdmissionError(KvfenceError):
    """A refused admission or growth; nothing was allocated."""


BY_STATUS = {}


def _make(status, cname, goname):
    short = goname.split(".", 1)[1][3:]  # kvcache.ErrExceedsQuota -> ExceedsQuota
    bases = (AdmissionError,) if 20 <= status <= 26 or status == 80 else (KvfenceError,)
    if status in (1, 10, 11, 40, 79):
        bases += (ValueError,)
    cls = type(short, bases, {"status": status, "name": cname, "go_error": goname,
                              "__doc__": "%s (%s)" % (cname, goname), "__module__": __name__})
    BY_STATUS[status] = cls
    globals()[short] = cls
    return short


__all__ = ["KvfenceError", "AdmissionError", "STATUSES", "from_last_error", "check"]
__all__ += [_make(*s) for s in STATUSES]


def from_last_error(status):
    """The exception for a failed call's status, with the calling thread's
    last error (read it right after the call, on the same thread)."""
    import ctypes
    info = _lib.ErrorInfo()
    _lib.last_error(ctypes.byref(info))
    buf = ctypes.create_string_buffer(int(info.message_len) + 1)
    _lib.last_error_message(buf, len(buf), None)
    cls = BY_STATUS.get(status, KvfenceError)
    return cls(buf.value.decode(errors="replace"), status, info.need, info.have, info.limit,
               info.need_tokens, info.limit_tokens, bool(info.retryable), bool(info.permanent),
               _lib.CAUSES.get(info.cause, info.cause))


def check(status):
    if status:
        raise from_last_error(status)
