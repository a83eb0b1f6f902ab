#!/usr/bin/env python3
"""A KV-aware router's view of a kvfence pool, as a vLLM consumer builds it.

Subscribes to the publisher (SUB), over NULL or, given the server's public
key, over CURVE; waits for one live batch, fills the gap before it from the
replay socket (DEALER, vLLM's request framing), and decodes every batch
strictly with vLLM's KV-event schema (vllm/distributed/kv_events.py) in the
form asked for: the array form (msgspec array_like=True) or the map form.
Strictly means as msgspec decodes with forbid_unknown_fields: every field
one of the struct's, of its type, every field without a default present,
nothing more. Then it mirrors the cached block hashes per sharing domain (a
prompt's first block names the domain in its cache salt, a continuation is
in its parent's), re-derives every stored block's hash from the token_ids
and the lora_name the event carries with the key chain the kvevents package
doc gives, asks for the whole buffer again and checks the replayed batches
are the bytes it got live, and derives block hashes from prompts given on
the command line. Prints one JSON object.

Standard library plus Debian's python3-zmq and python3-msgpack (msgspec
is not packaged; the schema is checked here field by field).
"""

import argparse
import hashlib
import json
import struct
import sys

import msgpack
import zmq
import zmq.utils.z85

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SALT_PREFIX = "kvfence.domain:"


class SchemaError(Exception):
    pass


# vLLM's structs (vllm/distributed/kv_events.py), field by field: name,
# type, and whether it has a default (None); fields without one first.
def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def optional(check):
    return lambda v: v is None or check(v)


def list_of(check):
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


HASH_TYPES = {
    # ExternalBlockHash = bytes | int, vLLM's type.
    "any": lambda v: is_int(v) or isinstance(v, bytes),
    # vLLM's example subscriber types its hashes list[int].
    "int": is_int,
}


def schema(hash_check):
    extra_entry = optional(lambda v: isinstance(v, list))  # tuple[Any, ...] | None
    return {
        "EventBatch": [
            ("ts", lambda v: isinstance(v, float), False),
            ("events", lambda v: isinstance(v, list), False),
            ("data_parallel_rank", optional(is_int), True),
        ],
        "BlockStored": [
            ("block_hashes", list_of(hash_check), False),
            ("parent_block_hash", optional(hash_check), False),
            ("token_ids", list_of(is_int), False),
            ("block_size", is_int, False),
            ("lora_id", optional(is_int), False),
            ("medium", optional(lambda v: isinstance(v, str)), False),
            ("lora_name", optional(lambda v: isinstance(v, str)), False),
            ("extra_keys", optional(list_of(extra_entry)), True),
            ("group_idx", optional(is_int), True),
            ("kv_cache_spec_kind", optional(lambda v: isinstance(v, str)), True),
            ("kv_cache_spec_sliding_window", optional(is_int), True),
        ],
        "BlockRemoved": [
            ("block_hashes", list_of(hash_check), False),
            ("medium", optional(lambda v: isinstance(v, str)), False),
            ("group_idx", optional(is_int), True),
        ],
        "AllBlocksCleared": [],
    }


def decode_struct(name, fields, value, form, tagged):
    """Decodes one struct as msgspec does, strictly; returns (tag, dict)."""
    tag = name
    if form == "array":
        if not isinstance(value, list):
            raise SchemaError(f"{name}: expected an array, got {type(value).__name__}")
        values = list(value)
        if tagged:
            if not values or not isinstance(values[0], str):
                raise SchemaError(f"{name}: no tag")
            tag = values.pop(0)
            fields = fields[tag] if tag in fields else None
            if fields is None:
                raise SchemaError(f"unknown tag {tag!r}")
        required = sum(1 for _, _, has_default in fields if not has_default)
        if len(values) < required:
            raise SchemaError(f"{tag}: {len(values)} fields, {required} required")
        if len(values) > len(fields):
            raise SchemaError(f"{tag}: {len(values)} fields, the struct has {len(fields)}")
        out = {}
        for (fname, check, _), v in zip(fields, values):
            if not check(v):
                raise SchemaError(f"{tag}.{fname}: {v!r} is not of its type")
            out[fname] = v
        return tag, out
    if not isinstance(value, dict):
        raise SchemaError(f"{name}: expected a map, got {type(value).__name__}")
    items = dict(value)
    if tagged:
        tag = items.pop("type", None)
        if tag not in fields:
            raise SchemaError(f"unknown tag {tag!r}")
        fields = fields[tag]
    known = {f[0]: f for f in fields}
    for k in items:
        if k not in known:
            raise SchemaError(f"{tag}: unknown field {k!r}")
    out = {}
    for fname, check, has_default in fields:
        if fname not in items:
            if not has_default:
                raise SchemaError(f"{tag}: missing {fname}")
            continue
        if not check(items[fname]):
            raise SchemaError(f"{tag}.{fname}: {items[fname]!r} is not of its type")
        out[fname] = items[fname]
    return tag, out


def decode_batch(payload, form, sc):
    batch = msgpack.unpackb(payload, raw=False)
    _, b = decode_struct("EventBatch", sc["EventBatch"], batch, form, False)
    events_schema = {k: v for k, v in sc.items() if k != "EventBatch"}
    events = [decode_struct("KVCacheEvent", events_schema, e, form, True) for e in b["events"]]
    return b, events


def block_hash(h):
    if is_int(h):
        return h
    return int.from_bytes(h[-8:], "big")  # a 32-byte key: llm-d's reading


def chain(domain, adapter, block_size, tokens, parent=None):
    """The kvfence key chain (kvevents package doc): the 32-byte keys of
    tokens' full pages, from parent's, or from the root of domain and
    adapter."""
    if parent is None:
        d, a = domain.encode(), adapter.encode()
        parent = hashlib.sha256(b"kvfence/prefix-root/v1" + struct.pack("<I", len(d)) + d
                                + struct.pack("<I", len(a)) + a).digest()
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        page = tokens[start:start + block_size]
        parent = hashlib.sha256(parent + struct.pack("<I", block_size)
                                + struct.pack(f"<{block_size}I", *page)).digest()
        out.append(parent)
    return out


class Mirror:
    def __init__(self):
        self.domains = {}
        self.where = {}  # block hash -> (domain, adapter, 32-byte key or None)
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.stored_blocks = 0
        self.rederived = 0
        self.without_tokens = 0
        self.removed_blocks = 0

    def apply(self, events):
        for tag, f in events:
            self.counts[tag] += 1
            if tag == "AllBlocksCleared":
                self.domains.clear()
                self.where.clear()
            elif tag == "BlockStored":
                self.store(f)
            else:
                for h in map(block_hash, f["block_hashes"]):
                    if h not in self.where:
                        raise SchemaError(f"removal of block {h} never stored")
                    domain = self.where.pop(h)[0]
                    self.domains[domain].discard(h)
                    if not self.domains[domain]:
                        del self.domains[domain]
                    self.removed_blocks += 1

    def store(self, f):
        hashes = [block_hash(h) for h in f["block_hashes"]]
        extra = f.get("extra_keys")
        if extra is None or len(extra) != len(hashes):
            raise SchemaError("BlockStored without one extra_keys entry per block")
        adapter = f["lora_name"] or ""
        parent_key = None
        if f["parent_block_hash"] is None:
            salt = extra[0]
            if not (isinstance(salt, list) and len(salt) == 1 and isinstance(salt[0], str)
                    and salt[0].startswith(SALT_PREFIX)):
                raise SchemaError(f"a prompt's first block without its domain's cache salt: {salt!r}")
            domain = salt[0][len(SALT_PREFIX):]
        else:
            parent = block_hash(f["parent_block_hash"])
            if parent not in self.where:
                raise SchemaError(f"parent {parent} never stored")
            domain, parent_adapter, parent_key = self.where[parent]
            if parent_adapter != adapter:
                raise SchemaError("a continuation under another adapter than its parent")
            if extra[0] is not None:
                raise SchemaError("a continuation with extra keys")
        if any(e is not None for e in extra[1:]):
            raise SchemaError("extra keys past a prompt's first block")
        tokens = f["token_ids"]
        keys = [None] * len(hashes)
        if tokens:
            if len(tokens) != len(hashes) * f["block_size"]:
                raise SchemaError(f"{len(tokens)} token_ids for {len(hashes)} blocks of {f['block_size']}")
            if parent_key is not None or f["parent_block_hash"] is None:
                keys = chain(domain, adapter, f["block_size"], tokens, parent_key)
                got = [int.from_bytes(k[-8:], "big") for k in keys]
                if got != hashes:
                    raise SchemaError("block hashes re-derived from token_ids differ from those published")
                self.rederived += len(hashes)
        else:
            self.without_tokens += len(hashes)
        self.domains.setdefault(domain, set()).update(hashes)
        for h, k in zip(hashes, keys):
            self.where[h] = (domain, adapter, k)
        self.stored_blocks += len(hashes)


def fail(msg):
    print(json.dumps({"error": msg}), flush=True)
    sys.exit(1)


def secure(sock, args):
    """Makes sock a CURVE client of the server key given, if one is."""
    if not args.server_key:
        return
    if args.client_secret:
        sec = zmq.utils.z85.encode(bytes.fromhex(args.client_secret))
        pub = zmq.curve_public(sec)
    else:
        pub, sec = zmq.curve_keypair()
    sock.curve_secretkey = sec
    sock.curve_publickey = pub
    sock.curve_serverkey = zmq.utils.z85.encode(bytes.fromhex(args.server_key))


def request_replay(replay, start, timeout_ms):
    """Sends a replay request and returns [(seq, payload)] up to the end
    marker; None if the request cannot be sent or no answer comes (a DEALER
    with no peer it could complete a handshake with would block)."""
    if not replay.poll(timeout_ms, zmq.POLLOUT):
        return None
    try:
        replay.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
    except zmq.Again:
        return None
    got = []
    while True:
        if not replay.poll(timeout_ms):
            return None
        delim, seq_bytes, body = replay.recv_multipart()
        if delim != b"":
            fail("replay reply without its delimiter")
        if seq_bytes == END_SEQ:
            if body != b"":
                fail("end marker with a payload")
            return got
        got.append((int.from_bytes(seq_bytes, "big"), body))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pub", required=True)
    ap.add_argument("--replay", required=True)
    ap.add_argument("--topic", default="")
    ap.add_argument("--form", choices=["array", "map"], required=True)
    ap.add_argument("--hash-type", choices=sorted(HASH_TYPES), default="any")
    ap.add_argument("--server-key", default="", help="the publisher's CURVE public key, hex: use CURVE")
    ap.add_argument("--client-secret", default="", help="this subscriber's CURVE secret key, hex (default: a fresh one)")
    ap.add_argument("--until", type=int, default=0, help="read live batches up to this sequence number")
    ap.add_argument("--expect-nothing", action="store_true",
                    help="report whether anything arrives within 2 s, and stop")
    ap.add_argument("--prompts", default="[]", help="JSON list of {domain, adapter, block_size, tokens}")
    args = ap.parse_args()
    sc = schema(HASH_TYPES[args.hash_type])

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    secure(sub, args)
    sub.connect(args.pub)
    sub.setsockopt_string(zmq.SUBSCRIBE, args.topic)
    replay = ctx.socket(zmq.DEALER)
    replay.setsockopt(zmq.LINGER, 0)
    secure(replay, args)
    replay.connect(args.replay)
    print("subscribed", flush=True)

    if args.expect_nothing:
        got_live = bool(sub.poll(2_000))
        got_replay = request_replay(replay, 0, 2_000)
        print(json.dumps({"live": got_live, "replay": got_replay is not None}), flush=True)
        return

    if not sub.poll(30_000):
        fail("no live batch within 30 s")
    live = {}
    topic, seq_bytes, payload = sub.recv_multipart()
    if topic.decode() != args.topic or len(seq_bytes) != 8:
        fail(f"frames {topic!r} {seq_bytes!r}")
    first = int.from_bytes(seq_bytes, "big")
    live[first] = payload
    while max(live) < args.until:
        if not sub.poll(30_000):
            fail(f"live batches stopped at {max(live)}, waiting for {args.until}")
        _, seq_bytes, payload = sub.recv_multipart()
        live[int.from_bytes(seq_bytes, "big")] = payload
    if sorted(live) != list(range(first, max(live) + 1)):
        fail(f"live batches {sorted(live)} have a gap")

    mirror = Mirror()
    replayed = request_replay(replay, 0, 30_000)
    if replayed is None:
        fail("replay stalled")
    seqs = [s for s, _ in replayed]
    if seqs != list(range(max(live) + 1)):
        fail(f"replayed {seqs}, live batches up to {max(live)}")
    identical = all(body == live[s] for s, body in replayed if s in live)
    try:
        for seq, body in replayed:
            b, events = decode_batch(body, args.form, sc)
            if b.get("data_parallel_rank") is None:
                raise SchemaError("no data_parallel_rank")
            mirror.apply(events)
    except SchemaError as e:
        fail(f"schema: {e}")

    prompts = json.loads(args.prompts)
    derived = [[int.from_bytes(k[-8:], "big") for k in chain(p["domain"], p["adapter"], p["block_size"], p["tokens"])]
               for p in prompts]
    print(json.dumps({
        "first_live": first,
        "last_live": max(live),
        "replayed": len(replayed),
        "replay_identical": identical,
        "counts": mirror.counts,
        "stored_blocks": mirror.stored_blocks,
        "rederived": mirror.rederived,
        "without_tokens": mirror.without_tokens,
        "removed_blocks": mirror.removed_blocks,
        "mirror": {d: sorted(hs) for d, hs in mirror.domains.items()},
        "derived": derived,
    }), flush=True)


if __name__ == "__main__":
    main()
