// Package handoff moves a prompt's KV from a prefill pool to a decode pool
// (disaggregated serving) so that nothing but a complete, verified prefill
// of the right request can ever become a decode lease.
//
// It answers the incident in docs/design.md: a prefill node rejected an
// over-long prompt, substituted a one-token placeholder, still shipped its
// "KV", and the decode node generated from pages holding other tenants'
// data (SGLang 30233, 30325, 36988, 38935, 38704; a late transfer landing
// in reused pages: SGLang 24578).
//
// # Model
//
// The page-level state machine lives in kvcache (see kvcache/phase.go):
// a lease is admitted → prefilling → prefilled (written watermark = prompt
// tokens) → exported → released, or aborted from any phase. This package
// sits above it (see the architecture in docs/design.md: kvcache stays the
// façade engines embed, handoff is a peer of capi and examples that
// imports it) and adds what crosses the wire:
//
//   - Manifest: request ID, tenant, sharing domain, prompt and max new
//     tokens, the exporting pool's cache spec (every group's kind, page
//     size and window, every region's bytes and element types) with its
//     tensor-parallel shard, each group's extent (kvcache's handoff
//     units: the prompt's per-token pages, each window's pages still
//     inside the window at the prompt's end from its first logical page
//     on, each state slot), per-unit sender generations, the content
//     checksum, an expiry, and an HMAC-SHA256 under a key the prefill and
//     decode pools share. A versioned little-endian encoding; Decode
//     checks the MAC before it trusts a byte and refuses anything not
//     exactly a version-2 manifest. The checksum travels either in the
//     manifest or, for a streamed transfer, sealed after the pages: the
//     manifest says which (FlagChecksumSealed), and the seal carries the
//     checksum under an HMAC with the same key, bound to the manifest's
//     transfer ID.
//   - Sender: Export pins a prefilled lease (nothing else exports: a
//     refused request has no lease, a placeholder that wrote 1 of N tokens
//     is not prefilled) and signs its manifest; Send streams the manifest,
//     waits for the receiver to accept it, streams the units (whole units
//     of one group per data frame; a unit larger than a message, such as
//     a state slot, in part frames of whole 4 KiB blocks), summing each
//     just before the transport takes it, seals the sum, and waits for the
//     receiver's verdict. On a ViewStream over a pool of host memory the
//     transport reads the units where they lie (kvcache's UnitViews: pinned
//     until the stream gives them back, and every end of the export waits
//     for that); otherwise they are staged (device → host → wire). So the first page leaves as soon
//     as the receiver has admitted the import, and each byte leaves the
//     device once (a manifest carrying the checksum would need a whole
//     pass over the pages first). The pages stay pinned until that ack, an
//     Abort, or the reclaim deadline; then they are released through the
//     scrubber.
//   - Receiver: Serve verifies the MAC, expiry (and an upper bound on it),
//     the cache spec and the shard (another is refused naming the first
//     difference: ErrGeometryMismatch, ErrShardMismatch), and replay (a
//     request ID already imported is refused,
//     ErrReplay, and one being imported too, ErrInProgress, until that
//     import ends), then admits fail-closed in every cache group of the
//     decode pool (prompt + max new tokens, the pool's own quota and
//     capacity checks, and the sharing domain: see below), receives the
//     units in order, checks every frame's transfer ID, place and
//     generations, and only once every unit of every group arrived and the
//     content checksum (the manifest's, or the seal's once its MAC
//     verifies) matches hands out the lease: a transfer that lacks any
//     group's bytes is incomplete, never a lease with an empty state.
//     Any failure aborts the import through the scrubber and reports a
//     reason code to the sender. So does the TransferTimeout, which also
//     ends Serve's wait for the sender's next frame
//     (InterruptibleEndpoint): a sender that stalls holds neither decode
//     pages, nor the goroutine serving it, nor its request ID.
//
// # Sharing domains
//
// KV crosses only inside one sharing domain (kvcache's package doc), and
// both ends take the domain from their own pool's tenant configuration,
// never from the request: the manifest names the domain the exporting
// lease was admitted in (kvcache.Lease.Domain; a tenant moved after the
// admission does not relabel its pages), and the decode pool admits the
// import only if the tenant is in that domain there, checked before the
// admission and again on the admitted lease (kvcache.Pool.BeginImport), so
// a tenant moved at any point before the import is refused with
// ErrDomainMismatch. Operators therefore name shared domains alike on the
// prefill and decode pools; a tenant's own domain is "tenant:<name>" on
// both. The decode lease is a prefilled lease of that domain: once the
// engine attaches the prompt's tokens (kvcache.Lease.AttachTokens, keys
// derived in the lease's domain) CachePrefix publishes its verified pages
// there like any other lease's. The manifest does not carry token IDs: the
// decode engine has them, and the pages' keys are a decode-pool matter.
//
// # Invariants
//
//   - No decode lease becomes usable unless a manifest signed with the
//     shared key, unexpired, of the pool's cache spec and shard and of the domain the
//     tenant is in on the decode pool, not seen before, was followed by
//     exactly its units, every group's, with its checksum (in the manifest, or in a seal
//     signed with the same key for the manifest's transfer).
//   - An exported lease takes no writes (Commit and SlotMapping fail with
//     kvcache.ErrLeasePhase): the bytes sent are the bytes summed.
//   - Exported pages are read only while their lease still holds them, and
//     imported pages are written only while their import lives, each at the
//     generation it was admitted with: no byte is read from or written to a
//     page that was released and reused.
//   - On every path, success or failure, Check passes on both pools and
//     every page ends in a live lease or scrubbed.
//
// Errors are sentinels (errors.go) or kvcache's; the sender sees a
// receiver's refusal as a *RefusedError wrapping ErrRefused and the
// receiver's reason. A nil argument (lease, transport, endpoint, context),
// or a method called on the nil result of a call that failed, returns
// ErrInvalidArgument: the incident's engine carried on after a refusal,
// and an engine that does so again must get an error it can log, never a
// panic that takes the node and every other tenant's requests with it.
//
// # Operations
//
// Receiver.Stats and Sender.Stats count transfers by outcome, failures by
// reason (ReasonNames: the wire's reason codes as stable labels), and
// ReceiverConfig.Logger and SenderConfig.Logger, when set, get one record
// per refused or failed transfer with its reason and the error's numbers;
// package metrics exports both to Prometheus.
//
// # Transports
//
// A Transport carries messages: the manifest, data frames (consecutive
// whole units tagged with the transfer ID and their generations), part
// frames (a range of one unit too large for a message), an end frame or
// seal, and verdicts back. InProcess connects two pools in one process;
// handoff/grpcx streams over gRPC (TLS or, on a trusted network, plain)
// between processes and machines; handoff/tcpx does the same over TCP or
// TLS connections of its own, one per transfer, with length-prefixed
// frames and page views written by one writev each, at about half gRPC's
// CPU per byte (where both ends share a few cores, its handoffs are about
// twice as fast); handoff/ucxx moves the units over UCX, written into the
// decode pool's memory (see Remote memory below). All of them pass one
// conformance suite (handoff/internal/conformance). Three optional
// interfaces save copies
// of the page bytes: a ViewStream sends the exporting pool's pages
// themselves, with no staging copy (grpcx's does); an OwningStream takes
// over the sender's staged data frames instead of copying them; and a
// PartsEndpoint hands the receiver each message in the buffers it arrived
// in, from which the units are written into the decode pool directly
// (kvcache.Incoming.WriteUnitsFrom, WriteUnitRangeFrom).
//
// Two more let each end overlap its work with the transport's. A sender
// on a ViewStream sums the pages one frame ahead of the stream, on a
// goroutine of its own, so the writes (on loopback the busiest path: the
// kernel's copy and the receiver's protocol work run in them) never wait
// for a checksum. A receiver on a HoldingEndpoint (tcpx's) writes each
// data frame into the decode pool on a goroutine of its own while the
// transport reads the next; a frame's write ends before the next one
// begins, and every write before the end frame or seal is checked, so
// the order of the writes and what Complete vouches for are as before.
//
// # Remote memory
//
// A transport that writes remote memory (RDMA; handoff/ucxx, over UCX)
// moves the units without data frames, and the protocol around them stays
// as it is (remote.go). The receiver, once it has admitted the import,
// lends the import's units (kvcache.Incoming.LendPages: pinned, checked
// against the generations the import was admitted with, under the pool
// lock, as WriteUnits is), has its endpoint expose exactly that memory
// (MemoryEndpoint), and answers the manifest with a grant instead of the
// accept verdict: for every region of every group (a lane), where each of
// its units goes, in runs of adjacent pages, and the transport's remote
// keys, all under the shared key's MAC and bound to the transfer ID, so
// that a sender writes only into memory a holder of the key granted for
// this transfer. The sender checks that the grant places every unit once,
// inside its extents and on bytes of its own, then writes each chunk of
// units (MemoryStream, RemoteWriter: one put per run; a state slot is
// one chunk, whatever its size; a writer whose puts each cost a round
// trip asks for large ones, PutSizer, and gets chunks that hold that
// much of every region, up to 32 frames where the pages are a GPU's and
// each chunk is staged), summed one chunk ahead as before, and
// once a chunk's writes have landed sends a landed note: the units, with
// their generations, as a data frame's head. The receiver checks each
// note as it checks a data frame and sums the landed units where they lie
// (kvcache.PageLoan.Landed) while the next chunk is written. Where the
// transport lands the bytes on the receiver's own threads (UCX's
// emulated puts over shared memory, its receives over TCP), it has the
// receiver sum each block right where and when it landed, in the cache
// of the core that wrote it (LandingWatcher, kvcache.PageLoan.Watch),
// and the note's sums take those; a block summed before all of it had
// landed shows as a checksum that falls short of the seal's, and its
// units are summed again from memory once the memory is taken back,
// before the verdict (kvcache.PageLoan.Resum). Where the
// fabric moves the bytes, those sums are the transfer's one cost per
// byte on the hosts' cores, so on a machine of 16 cores or more both
// ends split each chunk's units among 2 to 4 goroutines (sums.go). At
// the seal the receiver has the transport take the memory back (revoke:
// the sender acknowledges that it writes no more, or its connection is
// cut), returns the loan, and completes the import against the seal's
// checksum. Every failure takes the memory back the same way before the
// import is aborted, so no page is scrubbed or reused while a sender can
// still write it. A pool whose pages are not host memory, or a transport
// that cannot expose them (ErrNoRemoteMemory), accepts with the plain
// verdict, and the units come in data frames.
package handoff
