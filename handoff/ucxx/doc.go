// Package ucxx is a handoff.Transport over UCX (openucx), the transfer
// library under NIXL and most RDMA deployments of disaggregated serving:
// the decode side exposes the import's pages to the sender, which writes
// the prefill pages straight into them with UCX's remote puts (or, over
// TCP, as rendezvous messages that the decode side receives into them),
// over whatever UCX finds (InfiniBand, RoCE, TCP, shared memory, and CUDA
// memory where UCX is built for it), with the handoff's manifest, MACs,
// checksum and verdicts around the bytes as over every transport
// (handoff's "Remote memory").
//
// It is built with UCX only under the build tag ucx, with cgo and UCX's
// headers and libraries (Debian's libucx-dev; UCX 1.13 or later):
//
//	go test -tags ucx ./handoff/ucxx
//
// Without the tag, or without cgo, every constructor returns
// ErrUnavailable (Available says which build this is), so that code that
// uses the package builds everywhere. The cgo is a thin layer of this
// package's own over UCX's ucp API (shim.c, worker.go); UCX's Go bindings
// are not used.
//
// # Model
//
// A Transport and a Server each own a UCX context (UCX's configuration,
// transports and memory registrations), and each of their connections a
// UCX worker of its own, which a goroutine progresses: it polls while
// operations move, and sleeps in Go's poller on the worker's event file
// descriptor otherwise. A connection ends with its worker. One that ends
// as the protocol says (its operations completed, its endpoint flushed
// and closed) hands the worker on to a later connection (a context keeps
// a few idle). One that fails (the peer gone, a timeout, a cut, Close)
// destroys it at once, and with it every operation still in flight:
// from then on UCX reads no page a sender lent to its writes and writes
// none a receiver exposed, whatever the peer still sends. That is the
// only end UCX 1.13 gives an endpoint in error mode NONE (below): it
// refuses to force one closed, and a close that flushes waits for a peer
// that may never answer. Every UCX call is made with the worker's lock
// held (UCS_THREAD_MODE_SERIALIZED); UCX's callbacks only queue events,
// which the progress loop hands to the goroutines waiting for them, so
// no Go code runs on a UCX callback and UCX keeps no Go pointer (the
// memory of an operation in flight is pinned with runtime.Pinner until
// it ends).
//
// One transfer is one connection, as with handoff/tcpx. The two ends
// meet over TCP (Server.Listen's address): each sends a hello with its
// worker's address and the connection's ID, and each creates a UCX
// endpoint to the other's worker from it, the way UCX's perftest and NIXL
// connect. (UCX 1.13's sockaddr connection manager would choose network
// transports only, never shared memory.) That TCP connection stays open,
// silent, until the transfer ends: its close tells either end at once
// that the other has gone (a failure, unless the other had ended its
// messages first), which UCX itself would learn only from a keepalive,
// and on shared memory not at all (the endpoints use UCX's
// error mode NONE with a handler: in 1.13 error mode PEER leaves out
// shared memory and every transport's remote memory access on an
// endpoint created from a worker address).
//
// Messages (the handoff's manifest, grant, landed notes, seal and
// verdicts) are UCX active messages, sent eagerly (writes by rendezvous
// alone: see Data path), each with a header
// naming the connection they are for at the receiving worker (a random
// 64-bit ID). A sender may have window (4) messages unread by the
// receiver; each one read earns a credit back, so a fast sender cannot
// queue a prompt at a slow receiver.
//
// # Data path
//
// Where the decode pool's pages are host memory (and Options.DataPath is
// PathAuto), the receiver lends the import's units, every cache group's
// (kvcache's Incoming.LendPages: the prompt's pages, a window's pages at
// the prompt's end, a state slot), and its endpoint maps each run of
// adjacent pages of a region with ucp_mem_map (registered with every
// transport that writes remote memory, for remote writes) and packs its
// remote key; the grant carries the runs' addresses and keys inside the
// handoff's signed grant, never beside it. The sender unpacks the keys on
// its endpoint, checks every put against the extent it was granted before
// posting it, and writes each chunk of units with one put per run of
// pages adjacent on both sides (ucp_put_nbx; a state slot of any size is
// one put per region), then flushes the endpoint: the flush's completion
// is the remote completion of the puts, after which the chunk's landed
// note goes out. Only the import's pages are mapped, and only for the
// life of the transfer: when the receiver takes the memory back
// (revoke), it asks the sender to stop writing, the sender stops posting
// (every post takes the worker's lock, so none is half posted), flushes,
// and acknowledges; past Options.RevokeTimeout the connection is cut.
// Then the memory is unmapped and the loan returned, and only then is
// the import completed, or aborted and scrubbed.
//
// What a put costs depends on the transport. Over InfiniBand and RoCE
// (rc, dc) the NIC writes the bytes. Over TCP and shared memory, UCX 1.13
// emulates puts with active messages (UCX_PROTO_INFO=y says "software
// emulation"): the sender's worker copies each segment of a put into the
// transport's buffer (a TCP segment; an element of the receiver's
// shared-memory queue, sysv or posix), the receiver's worker, as it
// progresses, copies it out to the address the put names and
// acknowledges it, and a flush completes once every acknowledgement is
// back. That is two copies in user space beside the kernel's, on the
// two ends' cores; cma, which copies once (process_vm_readv), serves
// only UCX's rendezvous.
//
// Where every lane of the receiver's endpoint is UCX's TCP transport
// (PathAuto), the sender writes by rendezvous instead: each run of pages
// goes as one
// active message sent by rendezvous (UCP_AM_SEND_FLAG_RNDV) whose header
// names the connection, the extent and the offset it is for; the
// receiver's worker hands its descriptor to the connection, which
// receives it (ucp_am_recv_data_nbx) straight into that place of the
// lent pages only if it lies wholly inside one extent and the memory is
// still open to writes, and fails the connection otherwise. Nothing is
// mapped and no key or address leaves the receiver (the grant's
// description says only which way the sender writes). A message costs a
// round trip (the rendezvous), and a model's cache has many regions: a
// chunk of 4 MiB of llama-3.1-8b's 64 regions would be a message of 64
// KiB a region. So this writer asks for puts of 1 MiB at least
// (handoff.PutSizer), and the sender's chunks hold 1 MiB of every region
// (up to 32 MiB a chunk where the prefill's pages are a GPU's and go
// through a copy); 256 MiB in that layout moved at 3.0-3.8 GB/s for
// 123-142 ms of CPU, against 1.9-2.1 GB/s and 243-254 ms in chunks of 4
// MiB. Over TCP the
// bytes then move once each way, by the kernel (UCX's zero-copy send
// and a receive into the pages), instead of through UCX's segments. A
// send ends once the receiver has taken the bytes, not once they have
// landed, so the receiver reads each message (a landed note) only once
// every receive it had posted when the message arrived has ended. The
// revoke closes the memory to writes (a later one is released unread),
// asks the sender to stop as above, and waits for the receives in
// flight: past RevokeTimeout it cuts the connection, whose worker's end
// ends them; a receive is counted ended only once UCX has said so or the
// worker is destroyed. Over shared memory the puts stay
// (cma's rendezvous ran at 5.5-5.8 GiB/s against the puts' 9.8-10 in
// ucx_perftest; a receiver that took the writes as eager messages and
// copied each into place and summed it in one pass, in C, moved a
// handoff at 6.0-6.5 GB/s against the puts' 7.5-8.1:
// bench/results/2026-12-05-ucx-7.txt), and over InfiniBand and RoCE the
// NIC writes a put.
//
// Over shared memory and over TCP the bytes land on the receiver's own
// threads: UCX's worker copies each element of an emulated put out of
// its queue, or receives a rendezvous message, into the lent pages as
// it progresses. So the server watches the memory it exposed
// (handoff.LandingWatcher, kvcache.PageLoan.Watch): after each progress
// that did something, the goroutine that progressed the worker sums
// every 4 KiB block that has landed since, while the block is still in
// its core's cache, and the landed notes take those sums instead of
// reading the pages back from memory; a block summed before all of it
// landed shows as a checksum short of the seal's, and its units are
// summed again once the memory is taken back, before the verdict. That
// read back was what held a handoff over shared memory below UCX's own
// put rate on a machine whose two cores both ends share: a 256 MiB
// handoff went from x0.72 of ucx_perftest's put bandwidth to x0.88 at the
// median, for 59 ms of CPU instead of 68 (bench/results/2026-12-05-ucx-8.txt).
// Where a NIC writes the memory (rc, dc, ud) the server does not watch
// (LandsHere): no core has the bytes in its cache.
// Over TCP, UCX's emulated puts are not only dearer: a put that arrives
// after its sender's side of the connection failed (the prefill process
// killed mid-write, its worker destroyed) aborts the receiving process,
// for UCX's put handler treats the failure of the acknowledgement it
// sends as fatal (ucp_put_handler, "unexpected error: Endpoint timeout",
// in UCX 1.13 and in UCX's main branch alike); a rendezvous receive
// ends with an error instead. So ucxx never puts over TCP alone. What
// rendezvous gains over TCP on the machine of bench/README.md: the
// transport alone (BenchmarkPut, 4 MiB chunks) 80 ms of CPU per 256 MiB
// against the puts' 100, at 5.3-5.5 GB/s against 3.8; a whole handoff
// 7 % less CPU and 7 % more GB/s at the medians (less CPU in each of 6
// rounds), still about 1.5x tcpx's CPU
// (bench/results/2026-12-05-ucx-4.txt). No handoff over UCX's TCP can
// cost as little CPU as tcpx's: UCX's own ucx_perftest moves 256 MiB from
// real pages over TCP for 69-72 ms of CPU (UCX 1.13 and 1.23 alike), and
// with the scrub and the two checksums every handoff makes that is 87-94
// against tcpx's whole handoff at 78-85, for tcpx writes each frame from
// the cache its checksum just filled, which UCX's API gives no way to do
// (bench/results/2026-12-05-ucx-10.txt, scripts/ucx-floor.sh). Where the
// fabric is TCP alone, tcpx costs less; ucxx serves the fabrics UCX is for
// (shared memory, where a handoff costs less CPU than tcpx's, and RDMA).
//
// Where the pages cannot be lent (the decode pool's pages are not host
// memory) or Options.DataPath is PathMessages, the pages travel in the
// handoff's data frames, as active messages from the prefill pages
// themselves (handoff.ViewStream), copied into the decode pool by the
// receiver: the data path of handoff/tcpx.
//
// # Configuration
//
// UCX's own environment picks the transports and devices: UCX_TLS (tcp;
// sm,self for shared memory; rc,ud,... for InfiniBand and RoCE),
// UCX_NET_DEVICES (mlx5_0:1, eth0, ...) and the rest (ucx_info -c lists
// them). Two defaults differ from UCX's, each only where the environment
// does not set it. Where it sets neither UCX_TCP_TX_SEG_SIZE nor
// UCX_TCP_RX_SEG_SIZE, the TCP transport moves 1M segments instead of 8K
// ones (a put over TCP then runs at about 3x the rate for a quarter of the
// CPU, and a handoff takes 3-11 % less CPU at the median than with 256K
// segments); a connection's UCX send and receive buffers are of that size.
// Where it does not set UCX_MM_SEG_SIZE, shared memory moves 32K elements
// instead of 8K ones (a quarter of the elements to copy in, copy out and
// acknowledge). Do not set UCX_MM_SEG_SIZE to 64K or more: UCX 1.13 keeps
// an element's length in 16 bits and delivers a longer one cut short (a
// handoff then fails its checksum, refused, as any corrupted transfer is).
// Options bound messages, connecting, each message and chunk of writes,
// the revoke, and a server's connections.
//
// Two nodes on RoCE or InfiniBand, on paper (this package was tested on
// one machine only: see below): on the decode node, with the fabric's
// device named,
//
//	UCX_TLS=rc,ud,sm,self UCX_NET_DEVICES=mlx5_0:1 decode-server
//	    srv, _ := ucxx.NewServer(recv, ucxx.Options{})
//	    addr, _ := srv.Listen("10.0.0.2:13337") // an address the prefill node reaches
//
// and on the prefill node
//
//	UCX_TLS=rc,ud,sm,self UCX_NET_DEVICES=mlx5_0:1 prefill-engine
//	    tr, _ := ucxx.Dial("10.0.0.2:13337", ucxx.Options{})
//	    exp.Send(ctx, tr)
//
// The TCP connection the ends meet over needs an IP route between them
// (IPoIB, or the RoCE interface's own address); the pages go over the
// verbs transports UCX_TLS names, written by the prefill node's NIC into
// the decode pool's registered pages. With RoCE, the GID index
// (UCX_IB_GID_INDEX) may need setting as for any UCX program. A decode
// pool on a GPU is lent only once kvcache lends device memory, which it
// does not yet: such pools take the message path, through host staging.
//
// On one machine the package is tested over UCX_TLS=tcp (loopback) and
// over shared memory, UCX_TLS=sm,self (sysv and posix, the puts emulated
// over them), in one process and in two (the peer binary in
// internal/peer); CI runs both (scripts/ci-ucx.sh).
//
// # Security
//
// UCX encrypts nothing: the page bytes cross the fabric in the clear, so
// use it on a trusted fabric, as RDMA deployments do. The handoff's MACs
// still hold: a manifest, a grant and a seal that a holder of the shared
// key did not sign are refused, so a sender writes only into memory a
// receiver holding the key granted for this very transfer, and a receiver
// admits only what such a sender manifested. What enforces a remote key
// is the transport: an RDMA NIC refuses a write outside the memory
// registered for the key, and after its unmap; over shared memory
// nothing checks (the receiver's own UCX worker
// copies an emulated put's bytes to the address the put names), so there
// the bounds checks of the sender (this package's, and handoff's check of
// the grant) and the revoke's handshake are what keep a sender's writes
// inside the import's pages and within its life. With rendezvous
// (PathAuto over TCP) the receiver itself checks every write against the
// memory it exposed before it receives a byte of it, and receives none
// after the revoke: a sender cannot write outside the import's pages.
//
// # Bounds
//
// A peer cannot make a server allocate more than it sends: a message over
// Options.MaxMessageBytes is refused before anything is allocated for it
// (ErrMessageTooLarge), and the messages a peer may queue unread are
// bounded (window, and a few more for the receiver's verdicts). A server
// serves at most Options.MaxConns connections at once, from their
// accept; one more is closed unread (ServerStats.OverMaxConns). A
// connection whose hello is not a ucxx peer's of this version is closed
// (ErrHandshake, ServerStats.FailedHandshakes). Refusals are logged at
// most one a second.
//
// # Errors
//
// Every error the package returns wraps ErrUnavailable, ErrServerClosed or
// one of handoff's sentinels: handoff.ErrTransport for anything UCX, the
// network or the peer did (ErrMessageTooLarge and ErrHandshake wrap it),
// handoff.ErrProtocol for a put outside the granted memory or a remote
// key that does not unpack, handoff.ErrInvalidConfig for Options that
// cannot work, handoff.ErrInvalidArgument
// for a nil server, receiver, transport or context, or an address
// without a port.
package ucxx
