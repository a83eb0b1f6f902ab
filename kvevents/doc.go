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
//     msgpack payload.
//   - The payload is the batch [ts, events, data_parallel_rank]: ts a
//     float64 of seconds since the Unix epoch, data_parallel_rank
//     Config.DataParallelRank.
//   - BlockStored: block_hashes, parent_block_hash (nil for a prompt's
//     first page), token_ids, block_size (the pool's tokens per page),
//     lora_id (nil), medium (Config.Medium, "GPU"), lora_name (nil),
//     extra_keys. BlockRemoved: block_hashes, medium, group_idx (nil),
//     extra_keys. AllBlocksCleared: no fields.
//   - ROUTER replay socket (Config.ReplayEndpoint): a request is an empty
//     delimiter frame and an 8-byte big-endian start sequence (what a REQ
//     socket sends); the reply is every buffered batch numbered from the
//     start on, each as [delimiter, seq, payload], then the end marker
//     [delimiter, -1 as 8 signed bytes, empty payload]. A DEALER may send
//     the sequence alone and gets the replies without the delimiter.
//
// Events come in one of two encodings (Config.Encoding). ArrayEvents, the
// default, is vLLM's positional form (msgspec's array_like structs): each
// event an array whose first element is its tag, the fields in vLLM's
// order. MapEvents is the form current vLLM emits: each event a map of
// field names, its tag under "type". The batch is positional in both, as
// in vLLM. The default is the array form because every consumer reads it:
// those written before vLLM moved to maps read nothing else, and those
// updated since (llm-d, Dynamo) read both; choose MapEvents for consumers
// that read only maps. The one field kvfence adds, BlockRemoved's
// extra_keys, comes after vLLM's fields, where positional decoders skip
// unknown trailing fields and map decoders ignore unknown names.
//
// Block hashes are, by default, the 64-bit integer BlockHash of each key
// (its last 8 bytes, big-endian), as vLLM sends them; Config.FullHashes
// sends the whole 32-byte key as a msgpack bin instead, which llm-d reads
// back as the same 64-bit value.
//
// # Sharing domains on the wire
//
// A router must keep tenants of different sharing domains apart as the
// pool does. Every BlockStored and BlockRemoved carries its domain in
// extra_keys: one entry per block, each the list holding the one string
// DomainKeyPrefix + domain name ("kvfence.domain:team",
// "kvfence.domain:tenant:acme"). A router that indexes blocks by hash
// should index them by (domain, hash); one that folds extra keys into its
// own block keys, as llm-d does with a block's string extra keys, gets
// keys that differ by domain.
//
// Keys are domain-scoped by construction, too: a key is kvcache.BlockKey,
// a SHA-256 chain over the prompt's full pages rooted at the domain's
// name and the adapter,
//
//	root  = SHA-256("kvfence/prefix-root/v1" ‖ u32(len(domain)) ‖ domain ‖ u32(len(adapter)) ‖ adapter)
//	key_i = SHA-256(key_i-1 ‖ u32(block_size) ‖ u32 token IDs of page i)   (key_-1 = root)
//
// (u32 little-endian), so a router derives the keys a request would hit
// from the request alone: take the tenant's domain as the pools configure
// it (a named domain, or "tenant:NAME" for a tenant's own), compute the
// chain over the prompt's full pages (in Go: kvcache.Pool.PageKeys, on a
// pool configured like the serving ones), take BlockHash of each key, and
// look for the longest prefix of them in that domain's index. Equal
// prompts of two domains have no key in common, and no client-supplied
// value enters a key.
//
// token_ids is always empty. The pool keeps no prompt tokens once it has
// derived the keys, and an event stream is no place to copy tenants'
// prompts to; the keys above are all a router needs. Consumers that insist
// on recomputing their own keys from token_ids index nothing from a
// kvfence pool.
//
// # Libraries
//
// The two ZeroMQ sockets are served by a small implementation of the parts
// of ZMTP 3.0 they need (zmtp.go: greeting, NULL handshake, frames), not by
// a ZeroMQ library. libzmq (through cgo, e.g. github.com/pebbe/zmq4) would
// put cgo and libzmq's headers into every build of a program that
// publishes, where kvfence's own packages build with CGO_ENABLED=0.
// github.com/go-zeromq/zmq4, the pure-Go ZeroMQ, does not isolate
// subscribers: its PUB socket writes to them one after another from one
// goroutine, so a subscriber that stops reading stops all of them; its
// high-water mark is one per socket and drops without telling; and its
// reader allocates whatever frame size a peer announces. Serving the
// protocol here gives each subscriber its own queue, writer and deadline,
// counts every drop, and bounds every read. Interoperability is tested
// against both other implementations: go-zeromq/zmq4 is the Go subscriber
// of the tests, and libzmq (through Debian's python3-zmq) the Python one.
// Payloads are msgpack written by this package (encode.go), not by a
// msgpack library: the shapes are fixed, so the constant parts of each
// event are encoded once and a block costs its hash and a copy of its
// domain's extra key, with no reflection and no allocation (see Cost).
// Every value takes msgpack's shortest form, and the tests hold the bytes
// to github.com/vmihailenco/msgpack/v5's for the same shapes (it is the
// library llm-d decodes with, and the one this package encoded with
// before) besides decoding them with it and with Python's msgpack.
//
// # Cost
//
// An event's cost is in its bytes: an event of 128 blocks is 4.9 KB on
// the wire, 29 of each block's 38 bytes its domain's extra key. The
// publisher encodes it in 0.6–0.9 µs (BenchmarkEncode; 7–12 µs through
// vmihailenco/msgpack), into the one allocation its batch makes, and each
// subscriber's writer hands the kernel what is queued in one system call
// per wake-up. With the BatchWindow, a pool that emits faster than once a
// millisecond costs one message per millisecond, not one per event.
// All told, in metrics' BenchmarkAdmitReleaseObserved (two such events per
// admit-and-release cycle, a subscriber in the same process, a scrape
// every 10 ms, on a 2-core VM), the publisher, the subscriber and the
// collector use about 9 µs of CPU per cycle, 4.6 µs per event: encoding
// 1.1, the message's allocation 0.6, the write 0.75, the subscriber's
// reads 0.4, the scrapes 0.4, the rest scheduling and sweeping
// (bench/README.md). That CPU runs beside the pool's, on another core
// when there is one free.
//
// What the pool pays is kvcache's: copying each event's keys under its
// lock, and a send that never blocks. The publisher hands each event's
// key array back to the pool once the batch is encoded
// (kvcache.Pool.ReturnEventKeys), so that a later event reuses it: a pool
// observed this way allocates nothing per event, where a fresh 4 KiB of
// keys per event was most of what publishing cost it (page faults and
// cache misses on the admission path). A consumer parked on the channel
// adds a goroutine wake-up per event, which the BatchWindow spares the
// pool under load (the publisher is asleep on a timer, not parked).
package kvevents
