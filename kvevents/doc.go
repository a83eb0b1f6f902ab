// Package kvevents publishes a pool's prefix-cache events (kvcache's
// Pool.Events) to KV-aware routers in vLLM's wire format over ZeroMQ, so
// that routers built for vLLM (llm-d's KV-cache indexer, Dynamo's router,
// AIBrix) follow a kvfence pool without knowing it is one.
//
// # Model
//
// A Publisher reads the pool's event channel (the pool sends to it without
// ever blocking, and counts what a full channel drops), gathers what has
// arrived into a batch (at most Config.MaxBatchEvents events), numbers the
// batch, encodes it once, keeps it in a replay buffer, and queues the same
// bytes for every subscriber. After a batch that was not full it sleeps
// for Config.BatchWindow (1 ms) while the next one gathers in the
// channel: an event after a quiet spell goes out at once, and under load
// a window's events go out as one message, so that the publisher's cost
// is per window rather than per event, and the pool's sends find it
// asleep on a timer and wake no goroutine. (vLLM publishes once per
// engine step, tens of milliseconds.) Each subscriber has its own bounded
// queue and its own writer, which sends what is queued when it wakes in
// one vectored write; a full queue drops the batch for that subscriber
// alone (Stats.SubscriberDrops), and a subscriber that accepts no bytes
// for Config.WriteTimeout is disconnected. So:
//
//   - the pool never waits for the publisher, and the publisher never
//     waits for a subscriber;
//   - every buffer is bounded: the pool's channel, each subscriber's
//     queue, the replay buffer (BufferSteps batches, BufferBytes bytes),
//     what a peer may send (a subscription or a replay request in bytes,
//     16 frames a message, 256 subscriptions a subscriber), and the
//     peers themselves (Config.MaxPeers of each kind, counted from their
//     accept, so a peer that never finishes its handshake holds a slot
//     for WriteTimeout at most, and one that wants nothing, a subscriber
//     with no subscription to the topic or a replay client that sends no
//     request, for Config.IdleTimeout);
//   - every loss is counted and visible downstream: a subscriber that
//     missed batches sees a gap in the sequence numbers and asks the
//     replay socket for them; events the pool dropped before the publisher
//     read them (Stats.Lost) cannot be replayed, so the publisher sends an
//     AllBlocksCleared in their place (Stats.Resyncs) and a router rebuilds
//     its view from what follows rather than keep one that misses stores
//     or removals.
//
// # Wire format
//
// As vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py):
//
//   - PUB socket, each message three frames: the topic (Config.Topic),
//     the batch's sequence number (8 bytes, big-endian, from 0), and the
//     msgpack payload, an EventBatch.
//   - ROUTER replay socket (Config.ReplayEndpoint): a request is an empty
//     delimiter frame and an 8-byte big-endian start sequence (what a REQ
//     socket sends); the reply is every buffered batch numbered from the
//     start on, each as [delimiter, seq, payload] with the very payload
//     sent live, then the end marker [delimiter, -1 as 8 signed bytes,
//     empty payload]. A DEALER may send the sequence alone and gets the
//     replies without the delimiter. A start before the oldest buffered
//     batch (once older ones are gone: what is missing cannot be given
//     back, and a view built from the rest would be silently short) or
//     past the next batch is refused: the end marker alone, counted in
//     Stats.OutOfRange. A subscriber so refused rebuilds its view from
//     the live batches, as after AllBlocksCleared.
//
// Each form (Config.Encoding) is one shape, that of vLLM's structs in it,
// field for field, fields at their defaults (nil) left out as msgspec's
// omit_defaults does. ArrayEvents, the default, is the array_like form
// that llm-d's indexer and vLLM's example subscriber decode; MapEvents the
// map form of current vLLM:
//
//	EventBatch        [ts, events, data_parallel_rank]
//	                  {"ts", "events", "data_parallel_rank"}
//	BlockStored       ["BlockStored", block_hashes, parent_block_hash, token_ids,
//	                   block_size, lora_id, medium, lora_name, extra_keys]
//	                  {"type": "BlockStored", the same names}
//	BlockRemoved      ["BlockRemoved", block_hashes, medium]
//	                  {"type": "BlockRemoved", "block_hashes", "medium"}
//	AllBlocksCleared  ["AllBlocksCleared"]   {"type": "AllBlocksCleared"}
//
// ts is a float64 of seconds since the Unix epoch, data_parallel_rank
// Config.DataParallelRank, block_size the pool's tokens per page, medium
// Config.Medium ("GPU") for pages on the pool's device and
// Config.HostMedium ("CPU") for pages in its host tier (a page evicted
// into the tier is stored there, then removed from the device; one
// onloaded back is stored on the device again; each event's
// kvcache.KVEvent.Medium says which), lora_id nil (vLLM deprecates it for lora_name),
// lora_name the adapter the pages were admitted under (nil for none).
// group_idx and the cache-spec fields are left at their defaults.
//
// Block hashes are, by default, the 64-bit integer BlockHash of each key
// (its last 8 bytes, big-endian), as vLLM sends them. Config.FullHashes
// sends the whole 32-byte key as a msgpack bin instead, as vLLM does with
// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: vLLM's own schema (hashes typed
// bytes | int) and llm-d (which reads the last 8 bytes as the same 64-bit
// value) take it, but it breaks every consumer that types hashes as
// integers, vLLM's example subscriber (list[int]) among them. Leave it
// off unless every consumer reads bytes.
//
// # What a router indexes
//
// Routers built for vLLM index a block under a key of their own that they
// derive from the block's tokens, its parent's key and its extra keys:
// llm-d hashes [parent, tokens, extra] per block (FNV-64a over canonical
// CBOR), rooted at a hash of the model's (or lora_name's) name, and maps
// each of the engine's block hashes to its own key; a request is scored by
// deriving the same keys from its tokens. So:
//
//   - token_ids are each stored block's tokens (block_size of them per
//     hash, in order) when the pool is configured with
//     kvcache.PrefixConfig.EventTokens, and empty otherwise. Off by
//     default: they are tenants' prompts (see Trust boundary), and
//     routers that use kvfence's own keys need none of them (below). A
//     router that derives its keys from tokens, llm-d's among them,
//     indexes nothing without them: turn EventTokens on for it (and
//     CURVE on, unless the network to it is trusted). Pages published by
//     a lease that holds keys and no tokens (admitted with
//     Request.PageKeys alone) go out without tokens even then.
//   - The sharing domain is the cache salt: the first block of every
//     prompt a domain stores (the event without a parent) carries the one
//     extra key CacheSalt(domain) ("kvfence.domain:team"), every other
//     block nil, exactly where vLLM puts a request's cache_salt. vLLM
//     folds that salt into the first block's hash, so that the whole
//     chain after it differs; llm-d reads it as the first block's extra
//     feature and folds it into its request key the same way. A router
//     keeps tenants apart by giving a request of a domain the same first
//     extra key (in llm-d, ScoreTokens' extra features: the salt for
//     block 0, nil after): the request then finds that domain's blocks,
//     on the pods that hold them, and a request of another domain, whose
//     keys are salted otherwise, finds none of them. The salt is the
//     form both know for "the same tokens, not the same cache": a LoRA
//     name would name an adapter (and stand in for the model's name in
//     llm-d), a multimodal hash would claim an image's placeholders.
//   - Removals carry the block hashes alone, as vLLM's do: a hash is of a
//     key rooted in its domain (below), so it names one domain's block,
//     and a router that maps the engine's hashes to its own keys (llm-d)
//     drops exactly that entry.
//
// kvfence's keys are domain-scoped by construction, too: a key is
// kvcache.BlockKey, a SHA-256 chain over the prompt's full pages rooted at
// the domain's name and the adapter,
//
//	root  = SHA-256("kvfence/prefix-root/v1" ‖ u32(len(domain)) ‖ domain ‖ u32(len(adapter)) ‖ adapter)
//	key_i = SHA-256(key_i-1 ‖ u32(block_size) ‖ u32 token IDs of page i)   (key_-1 = root)
//
// (u32 little-endian), so a router can also derive the hashes a request
// would hit without any token_ids on the wire: take the tenant's domain as
// the pools configure it (a named domain, or "tenant:NAME" for a tenant's
// own), compute the chain over the prompt's full pages (in Go:
// kvcache.Pool.PageKeys, on a pool configured like the serving ones), take
// BlockHash of each key, and look for the longest prefix of them among a
// pod's stored hashes. Equal prompts of two domains have no key in common,
// and no client-supplied value enters a key. examples/router does both.
//
// # Trust boundary
//
// With EventTokens the stream carries tenants' prompts, token by token,
// and with or without it, which prompts each domain has cached (by hash,
// which a party that can guess a prompt can test). Whoever can connect to
// the PUB or replay socket reads all of it: ZeroMQ's PUB has no access
// control of its own. Bind the endpoints only where the routers are (an
// ipc:// socket, a loopback or private address), and where the network
// between pool and router is not trusted, set Config.Curve: ZMTP CURVE
// (RFC 26) authenticates the publisher to every client by its key pair
// (which the operator generates, NewCurveKeyPair, and configures: the
// secret on the publisher, the public key on the routers), encrypts and
// authenticates every message per connection, and, with
// CurveConfig.Clients, lets in only the routers whose keys are listed. A
// client without the publisher's key, or with a key not let in, completes
// no handshake and gets nothing, live or replayed; it is counted in
// Stats.AuthFailures. libzmq's clients (pyzmq, llm-d's subscriber) speak
// CURVE given the server's public key (ZMQ_CURVE_SERVERKEY, in Z85 as
// CurveKey.String writes it) and a key pair of their own.
//
// # Libraries
//
// The two ZeroMQ sockets are served by a small implementation of the parts
// of ZMTP 3.0 they need (zmtp.go: greeting, NULL handshake, frames;
// curve.go: the CURVE handshake and messages, with golang.org/x/crypto's
// NaCl box and secretbox), not by a ZeroMQ library. libzmq (through cgo,
// e.g. github.com/pebbe/zmq4) would put cgo and libzmq's headers into
// every build of a program that publishes, where kvfence's own packages
// build with CGO_ENABLED=0. github.com/go-zeromq/zmq4, the pure-Go
// ZeroMQ, does not isolate subscribers: its PUB socket writes to them one
// after another from one goroutine, so a subscriber that stops reading
// stops all of them; its high-water mark is one per socket and drops
// without telling; its reader allocates whatever frame size a peer
// announces; and it has no CURVE. Serving the protocol here gives each
// subscriber its own queue, writer and deadline, counts every drop and
// every refused peer by kind, and bounds every read. Interoperability is
// tested against both other implementations: go-zeromq/zmq4 is a Go
// subscriber of the tests, and libzmq (through Debian's python3-zmq) the
// Python one, over NULL and over CURVE (libzmq, like RFC 26's reference,
// carries MESSAGE commands in data frames; so does this package, and it
// reads either).
// Payloads are msgpack written by this package (encode.go), not by a
// msgpack library: the shapes are fixed, so the constant parts of each
// event are encoded once and a block costs its hash, its tokens and its
// extra-keys entry, with no reflection and no allocation (see Cost).
// Every value takes msgpack's shortest form, and the tests hold the bytes
// to github.com/vmihailenco/msgpack/v5's for the same shapes (it is the
// library llm-d decodes with, and the one this package encoded with
// before) besides decoding them strictly with vLLM's schema in Go and in
// Python.
//
// # Cost
//
// An event's cost is in its bytes. A stored event of 128 blocks is about
// 1.3 KB on the wire without token IDs (9 bytes a hash, 1 of extra keys,
// the salt once), and 9.7 KB with them (2,048 tokens of a 150k
// vocabulary, 3 to 5 bytes each); a removal of 128 blocks is 1.2 KB. The
// publisher encodes the two events of a cycle in 0.11 µs each without
// tokens and 1.16 µs with (BenchmarkEncode; 10.8 µs through
// vmihailenco/msgpack), into the one allocation its batch makes, and each
// subscriber's writer hands the kernel what is queued in one system call
// per wake-up. With the BatchWindow, a pool that emits faster than once a
// millisecond costs one message per millisecond, not one per event.
// CURVE adds, per subscriber, the encryption of every frame it is sent
// (XSalsa20-Poly1305 over the message, one copy into a buffer the writer
// keeps), and that subscriber's decryption on its side.
//
// In metrics' BenchmarkAdmitReleaseObserved (two events per
// admit-and-release cycle, a subscriber in the same process, a scrape
// every 10 ms, on a 2-core VM; bench/README.md), publishing token IDs
// costs the pool 1.04× a plain pool's cycle at the median of 5 paired
// rounds (prefix=tokens/paired-drained), and the whole of it, token IDs
// over CURVE to a CURVE subscriber, 1.06× (prefix=tokens+curve/paired).
// The publisher, the subscriber and the scrapes together use 5.5 µs of
// CPU per event over NULL and 15.7 µs over CURVE (median; the CURVE
// subscriber's decryption included). That CPU runs beside the pool's, on
// another core when there is one free.
//
// What the pool pays is kvcache's: copying each event's keys (and, with
// EventTokens, its tokens) under its lock, and a send that never blocks.
// The publisher hands each event's arrays back to the pool once the batch
// is encoded (kvcache.Pool.ReturnEventKeys, ReturnEventTokens), so that a
// later event reuses them: a pool observed this way allocates nothing per
// event, where a fresh 4 KiB of keys per event was most of what publishing
// cost it (page faults and cache misses on the admission path). A consumer parked on the channel
// adds a goroutine wake-up per event, which the BatchWindow spares the
// pool under load (the publisher is asleep on a timer, not parked).
package kvevents
