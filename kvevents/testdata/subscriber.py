#!/usr/bin/env python3
"""A KV-aware router's view of a kvfence pool, as a vLLM consumer builds it.

Subscribes to the publisher (SUB), waits for one live batch, fills the gap
before it from the replay socket (DEALER, vLLM's request framing), decodes
every batch with vLLM's KV-event schema in either encoding (positional
arrays or maps), mirrors the cached block hashes per sharing domain (taken
from each event's extra keys), and derives block hashes from prompts with
the key chain the kvevents package doc gives. Prints one JSON object.

Standard library plus Debian's python3-zmq and python3-msgpack.
"""

import argparse
import hashlib
import json
import struct
import sys

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DOMAIN_PREFIX = "kvfence.domain:"

# vLLM's field order (vllm/distributed/kv_events.py), after the tag.
STORED = ["block_hashes", "parent_block_hash", "token_ids", "block_size",
          "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
          "kv_cache_spec_kind", "kv_cache_spec_sliding_window"]
REMOVED = ["block_hashes", "medium", "group_idx", "extra_keys"]


def fail(msg):
    print(json.dumps({"error": msg}))
    sys.exit(1)


def fields_of(event):
    """Returns (tag, fields) for an event in the array or the map form."""
    if isinstance(event, list):
        tag, values = event[0], event[1:]
        names = {"BlockStored": STORED, "BlockRemoved": REMOVED}.get(tag, [])
        if len(values) > len(names):
            fail(f"{tag} has {len(values)} fields, schema has {len(names)}")
        return tag, dict(zip(names, values))
    if isinstance(event, dict):
        fields = dict(event)
        return fields.pop("type"), fields
    fail(f"event is a {type(event).__name__}")


def block_hash(h):
    if isinstance(h, int):
        return h
    if isinstance(h, bytes) and len(h) == 32:
        return int.from_bytes(h[-8:], "big")
    fail(f"block hash {h!r}")


def domain_of(tag, fields):
    extra = fields.get("extra_keys")
    if not isinstance(extra, list) or len(extra) != len(fields["block_hashes"]):
        fail(f"{tag} without one extra_keys entry per block")
    domains = set()
    for keys in extra:
        for k in keys:
            if isinstance(k, str) and k.startswith(DOMAIN_PREFIX):
                domains.add(k[len(DOMAIN_PREFIX):])
    if len(domains) != 1:
        fail(f"{tag} names domains {domains}")
    return domains.pop()


class Mirror:
    def __init__(self):
        self.domains = {}
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def apply(self, payload):
        batch = msgpack.unpackb(payload, raw=False)
        if not (isinstance(batch, list) and len(batch) == 3):
            fail("batch is not [ts, events, data_parallel_rank]")
        ts, events, rank = batch
        if not isinstance(ts, float) or not isinstance(rank, int):
            fail(f"ts {ts!r}, rank {rank!r}")
        for event in events:
            tag, fields = fields_of(event)
            self.counts[tag] += 1
            if tag == "AllBlocksCleared":
                if fields:
                    fail("AllBlocksCleared with fields")
                self.domains.clear()
                continue
            hashes = [block_hash(h) for h in fields["block_hashes"]]
            domain = domain_of(tag, fields)
            if tag == "BlockStored":
                if not isinstance(fields["block_size"], int) or fields["token_ids"] != []:
                    fail("block_size or token_ids")
                for name in ("lora_id", "lora_name"):
                    if name not in fields or fields[name] is not None:
                        fail(f"{name} missing or set")
                self.domains.setdefault(domain, set()).update(hashes)
            elif tag == "BlockRemoved":
                held = self.domains.get(domain, set())
                held.difference_update(hashes)
                if not held:
                    self.domains.pop(domain, None)
            else:
                fail(f"unknown tag {tag}")


def derive(domain, adapter, block_size, tokens):
    """The kvfence key chain (kvevents package doc), as block hashes."""
    d, a = domain.encode(), adapter.encode()
    parent = hashlib.sha256(b"kvfence/prefix-root/v1" + struct.pack("<I", len(d)) + d
                            + struct.pack("<I", len(a)) + a).digest()
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        page = tokens[start:start + block_size]
        parent = hashlib.sha256(parent + struct.pack("<I", block_size)
                                + struct.pack(f"<{block_size}I", *page)).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pub", required=True)
    ap.add_argument("--replay", required=True)
    ap.add_argument("--topic", default="")
    ap.add_argument("--prompts", default="[]", help="JSON list of {domain, adapter, block_size, tokens}")
    args = ap.parse_args()

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(args.pub)
    sub.setsockopt_string(zmq.SUBSCRIBE, args.topic)
    replay = ctx.socket(zmq.DEALER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.connect(args.replay)
    print("subscribed", flush=True)

    if not sub.poll(30_000):
        fail("no live batch within 30 s")
    topic, seq_bytes, payload = sub.recv_multipart()
    if topic.decode() != args.topic or len(seq_bytes) != 8:
        fail(f"frames {topic!r} {seq_bytes!r}")
    live_seq = int.from_bytes(seq_bytes, "big")

    mirror = Mirror()
    replayed = []
    if live_seq > 0:  # the gap before it: everything so far
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            if not replay.poll(30_000):
                fail("replay stalled")
            delim, seq_bytes, body = replay.recv_multipart()
            if delim != b"":
                fail("replay reply without its delimiter")
            if seq_bytes == END_SEQ:
                if body != b"":
                    fail("end marker with a payload")
                break
            seq = int.from_bytes(seq_bytes, "big")
            if seq < live_seq:
                mirror.apply(body)
                replayed.append(seq)
    if replayed != list(range(live_seq)):
        fail(f"replayed {replayed}, live batch {live_seq}")
    mirror.apply(payload)

    prompts = json.loads(args.prompts)
    print(json.dumps({
        "live_seq": live_seq,
        "replayed": len(replayed),
        "counts": mirror.counts,
        "mirror": {d: sorted(hs) for d, hs in mirror.domains.items()},
        "derived": [derive(p["domain"], p["adapter"], p["block_size"], p["tokens"]) for p in prompts],
    }), flush=True)


if __name__ == "__main__":
    main()
