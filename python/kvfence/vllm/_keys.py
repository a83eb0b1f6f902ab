"""What a vLLM request's prefix keys and tenant are, as kvfence sees them.

Keys. vLLM keys a block by its tokens and extra keys
(kv_cache_utils.generate_block_hash_extra_keys at VLLM_COMMIT): the LoRA
adapter's name on every block, the multimodal items a block overlaps
(each item's identifier, its mm_hash, with its offset from the block's
start), the request's cache_salt on the first block, and a hash of the
block's prompt embeddings. kvfence's keys are a SHA-256 chain rooted at
the tenant's sharing domain and an adapter string, with extra key
material per page (kvf_admit_tokens_keyed):

- adapter: the LoRA name, the operator's salt and the request's
  cache_salt, length-prefixed and hashed into one string ("kvf1:" and 64
  hex digits), or none when all three are absent. A salt only ever
  narrows sharing: the domain stays the tenant's, server-side, whatever
  the request says.
- page material: for each page, SHA-256 of each overlapping item's
  identifier and its offset from the page's start (little-endian int64),
  in the items' order; no bytes for a page without items.
- prompt embeddings: such a request shares nothing (it is admitted
  without token IDs, whose positions hold placeholders).

Tenants. The tenant must be the one the server authenticated, never a
field the client chose: a request that carries a tenant field a client
can set (sampling_params.extra_args or kv_transfer_params) is refused
(ClientTenantField), and the tenant comes from a resolver the operator
names:

- "trace_header:NAME": request.trace_headers[NAME], a header the
  operator's authenticating front end sets when it calls the engine.
  vLLM's OpenAI server copies only trace-context headers (traceparent,
  tracestate) from a client's request into trace_headers; check that
  your front end strips NAME from what clients send.
- "static:NAME": every request is tenant NAME (one tenant per engine).
- "module:function": a callable of the operator's taking vLLM's Request
  and returning the tenant's name, or None for an unauthenticated one.
"""

import hashlib
import importlib
import struct

ADAPTER_PREFIX = "kvf1:"
CLIENT_TENANT_FIELDS = ("kvfence_tenant", "tenant")


class TenantError(Exception):
    """A request whose tenant cannot be established: it is finished with
    an error, never admitted under a guessed tenant."""


class Unauthenticated(TenantError):
    pass


class ClientTenantField(TenantError):
    pass


def resolver(spec):
    """The tenant resolver named by spec (see the module doc): a callable
    request -> tenant name."""
    if callable(spec):
        fn = spec
    elif not isinstance(spec, str) or not spec:
        raise ValueError("kvfence.vllm: tenant resolver %r: want \"trace_header:NAME\", \"static:NAME\" or "
                         "\"module:function\"" % (spec,))
    elif spec.startswith("trace_header:"):
        header = spec[len("trace_header:"):]
        if not header:
            raise ValueError("kvfence.vllm: tenant resolver %r names no header" % spec)

        def fn(request):
            headers = request.trace_headers or {}
            return headers.get(header)
    elif spec.startswith("static:"):
        name = spec[len("static:"):]
        if not name:
            raise ValueError("kvfence.vllm: tenant resolver %r names no tenant" % spec)

        def fn(request):
            return name
    else:
        mod, sep, attr = spec.partition(":")
        if not sep or not mod or not attr:
            raise ValueError("kvfence.vllm: tenant resolver %r: want \"trace_header:NAME\", \"static:NAME\" or "
                             "\"module:function\"" % spec)
        fn = getattr(importlib.import_module(mod), attr)
    return fn


def tenant_of(resolve, request):
    """The request's tenant by resolve; raises TenantError for a request
    with a client-set tenant field or none established."""
    for where, args in (("sampling_params.extra_args", getattr(request.sampling_params, "extra_args", None)),
                        ("kv_transfer_params", request.kv_transfer_params)):
        if isinstance(args, dict):
            for k in CLIENT_TENANT_FIELDS:
                if k in args:
                    raise ClientTenantField("request %s sets %s[%r], a field the client chose; the tenant is the one "
                                            "the server authenticated" % (request.request_id, where, k))
    tenant = resolve(request)
    if not tenant or not isinstance(tenant, str):
        raise Unauthenticated("request %s has no authenticated tenant" % request.request_id)
    return tenant


def _lp(s):
    b = s.encode() if isinstance(s, str) else (s or b"")
    return struct.pack("<I", len(b)) + b


def adapter_of(request, salt=None):
    """kvfence's adapter string for the request: None, or "kvf1:" and the
    SHA-256 of its LoRA name, the server's salt and its cache_salt."""
    lora = request.lora_request.lora_name if request.lora_request is not None else None
    cache_salt = request.cache_salt
    if lora is None and not salt and not cache_salt:
        return None
    h = hashlib.sha256(b"kvfence/vllm-adapter/v1" + _lp(lora) + _lp(salt) + _lp(cache_salt))
    return ADAPTER_PREFIX + h.hexdigest()


def page_extra_of(request, block_size, num_tokens):
    """The extra key material of the first ceil(num_tokens / block_size)
    pages of the request: [] when no page overlaps a multimodal item."""
    features = request.mm_features
    if not features:
        return []
    pages = -(-num_tokens // block_size)
    out = [None] * pages
    last = -1
    for f in features:
        off, length = f.mm_position.offset, f.mm_position.length
        if length <= 0 or off >= num_tokens:
            continue
        ident = hashlib.sha256(str(f.identifier).encode()).digest()
        for p in range(off // block_size, min(pages, -(-(off + length) // block_size))):
            piece = ident + struct.pack("<q", off - p * block_size)
            out[p] = piece if out[p] is None else out[p] + piece
            last = max(last, p)
    return out[:last + 1]
