// Package tcpx is a handoff.Transport over plain TCP connections, or TLS
// ones, with a framing of its own: the data path beside handoff/grpcx for
// prefill and decode pools on a fabric where gRPC's CPU cost per byte is
// what limits a handoff.
//
// # Model
//
// One connection carries one transfer (Transport.Open dials it; the end
// of the transfer closes it). A pool of connections would save the TCP
// and TLS handshakes, a few round trips against the milliseconds to
// seconds a prompt's KV takes to move, and would cost what one connection
// per transfer gives for nothing: a transfer that fails, is cancelled or
// stalls is ended by closing its connection, with nothing else on it to
// spare, and no connection's state (a half-written frame, an unread
// verdict) outlives its transfer.
//
// On the wire, each end first sends an 8-byte hello, "KVFTCPX" and the
// protocol version (Version, 1). The client sends its hello as soon as it
// has connected (and, with TLS, finished the handshake); the server reads
// it, refuses what is not a tcpx client by closing the connection without
// a word (and logs what it got: an HTTP request, a gRPC preface, a TLS
// handshake on a plain-TCP server), answers a client of another version
// with its own hello, so that the client can say which, before it closes,
// and otherwise sends its hello and serves the transfer. The client checks
// the server's hello before it reads any message from it, but does not
// wait for it to send the manifest: the transfer spends no round trip on
// the hellos.
//
// After the hello, each direction is a sequence of frames:
//
//	length  u32, little-endian   1 … Options.MaxMessageBytes
//	body    length bytes         one handoff message, unchanged: its first
//	                             byte is its kind ('M' manifest, 'D' data,
//	                             'S' seal, 'E' end from the sender; 'V'
//	                             verdict from the receiver)
//
// and a zero length is the end of that side's messages: the sender's
// CloseSend, after its seal; the receiver's after its last verdict. A
// connection that closes anywhere else breaks the transfer (Recv never
// reports that as io.EOF). A whole transfer is thus, sender to receiver,
//
//	"KVFTCPX" 01 | len 'M' manifest | len 'D' pages … | len 'S' seal | 00000000
//
// and back "KVFTCPX" 01 | len 'V' 1 0 (accepted) | len 'V' 2 0 (imported) |
// 00000000, where a refusal is a verdict with a reason code and text
// instead, after which the receiver ends its messages at once.
//
// # Data path
//
// The sender writes each data frame with one vectored write (writev on
// TCP: net.Buffers) of its length prefix and head (copied together, a
// few dozen bytes, so that TLS does not send the prefix as a record of
// its own) and the exporting pool's pages themselves (handoff.ViewStream),
// so the page bytes are copied once, by the kernel, and given back (done)
// when the write returns. The server reads each frame's body straight
// from the socket into a read buffer (kept between connections), which
// the receiver sums and writes into the decode pool's pages
// (handoff.PartsEndpoint, in one part: a frame is read whole). The
// buffer goes with the frame (handoff.HoldingEndpoint) and the next frame
// is read into a second one meanwhile, so a transfer circulates two read
// buffers and the receiver's writes overlap the reads.
// A goroutine per transfer reads the receiver's messages as they come, so
// that a sender the receiver has refused stops at its next frame instead
// of sending the rest of the prompt.
//
// # Cost
//
// This package exists because gRPC's CPU cost per byte, not the wire,
// limits a handoff where both ends share a few cores (handoff/grpcx's
// package doc). On bench/README.md's two cores, in 10 rounds alternating
// with the code before the sender summed ahead and the receiver
// overlapped its writes (bench/results/2026-12-02-stop26.txt), a
// 256 MiB handoff ran at x-tcp 0.86 at the median (0.81–0.93; before,
// 0.72, 0.70–0.79), on 201–232 ms of CPU (both ends, checksums, decode
// writes and the scrub included). tcpx's own share (BenchmarkTCPXStream:
// no checksums, no pools) costs less CPU than the raw copy, whose reader
// writes into 256 MiB of cold memory where tcpx's reads into a buffer
// that stays in cache. Timed by phase, the pages now cross at the raw
// copy's speed: the sender's XXH3 over the pages (about 44 ms of CPU per
// 256 MiB: it reads them from memory, the write then from cache) runs
// beside its writes, and the receiver's sums and copy into the decode
// pages (about 30 ms) beside its reads. What is left is serial, at the
// ends: the scrub of the prefill pages after the ack (7–15 ms, a memset
// at memory bandwidth on the host backend; a fill kernel queued on a
// GPU), the manifest and import verdicts and the dial (about 1 ms).
// Where the ends do not share a core, the busiest goroutine is the
// sender's writer; that was not measured. TLS (BenchmarkHandoffTLS,
// AES-GCM) costs about three times the CPU of plain TCP: 460–580 ms per
// 256 MiB here (measured before the sums ran ahead).
//
// # Security
//
// Security is explicit: Dial and NewServer take a Security and refuse the
// zero one (ErrNoSecurity), so that plain TCP is asked for by name
// (Insecure), never had by leaving a field out. The handoff's own MACs
// (HMAC-SHA256 under the key both pools share) protect the manifest and
// the seal on any connection: a peer or a man in the middle cannot forge,
// alter or replay an admission, and the content checksum the seal carries
// is the sender's. But that checksum is XXH3, not a MAC: it catches a
// corrupted or torn page, not an attacker who rewrites page bytes so that
// they still sum alike (XXH3 has no key and is no cryptographic hash).
// So across anything but loopback or a trusted fabric use TLS: it is what
// keeps the page bytes (other tenants' prompts, in KV form) confidential,
// and what protects them against an active attacker. TLS also
// authenticates the server (cfg.RootCAs, cfg.ServerName, which defaults to
// the dialed host); a server that wants to know its clients sets
// ClientAuth and ClientCAs in its config.
//
// # Bounds
//
// A peer cannot make a server allocate more than it sends: a length
// prefix over Options.MaxMessageBytes is refused before anything is read
// for it (ErrMessageTooLarge), and the read buffer grows only as bytes
// arrive, at most doubling. Options.MaxConns bounds the connections a
// server serves at once (256): one over it is closed unread, so that
// connections that are no transfers cannot pile up goroutines and read
// buffers without end. Nor can they fill the server's log: a refusal,
// over MaxConns or at a failed handshake, is logged at once only if it
// is the first of its kind in a second; the rest of the second's are
// counted, and summarised in one record when it ends, so that a flood
// costs at most two records a second per kind, not one per connection
// (ServerStats counts each). Options.HandshakeTimeout bounds connecting,
// TLS and the hellos (a client that connects and says nothing holds a
// server goroutine that long); Options.MessageTimeout bounds each frame's
// write (so a receiver that stops reading pins the sender's pages no
// longer), each wait of the server for the sender's next message (so a
// stalled sender holds the decode pages no longer: the receiver aborts
// the import) and each wait of the sender for a verdict. The receiver's
// TransferTimeout bounds the whole transfer, however slowly its frames
// come: when it aborts the import, the server stops waiting for the next
// frame at once (handoff.InterruptibleEndpoint) and sends the verdict,
// whatever is left of MessageTimeout. The sender's
// context, when done, closes the connection: every call on the stream
// then fails with handoff.ErrTransport naming its cause.
//
// # Buffers and concurrency
//
// SendViews reads the views only within its write and calls done before
// it returns; Send keeps nothing of msg. A received message is valid
// until the next receive: on the server it lies in the connection's read
// buffer, on the sender's side in a copy of its own. A Transport and a
// Server are safe for concurrent use (Opens from many goroutines, Serve
// on several listeners); a stream is one transfer's, used by the
// goroutine that runs it (handoff.Export.Send), though Close, the
// context's end and Transport.Close may come from anywhere. Server.Close
// returns once every connection's goroutine has, so every import the
// server had begun has ended; Server.Shutdown waits for the transfers in
// flight first.
//
// # Errors
//
// Every error the package returns wraps ErrNoSecurity, ErrServerClosed or
// one of handoff's sentinels: handoff.ErrTransport for anything the
// network or the peer did (ErrMessageTooLarge and ErrHandshake wrap it;
// the sender's Send then wraps it again, or turns it into the receiver's
// verdict), handoff.ErrInvalidConfig for Options or a server TLS config
// that cannot work, handoff.ErrInvalidArgument for a nil server,
// receiver, listener, transport or context, or an address without a
// port. A transfer's refusals are the handoff package's; they travel as
// verdicts.
package tcpx
