// Package grpcx is a handoff.Transport over gRPC streaming, for prefill
// and decode pools in different processes or on different machines.
//
// # Model
//
// One bidirectional-streaming RPC, /kvfence.handoff.v1.Handoff/Transfer,
// carries one transfer: the handoff package's messages (manifest, data
// frames of whole pages, end frame; verdicts back) each travel as one gRPC
// message, unchanged, through a raw-bytes codec. There is no .proto file
// and no protoc step: the service is a hand-written grpc.ServiceDesc, and
// the codec (encoding.CodecV2) is forced on both ends rather than
// registered globally, so it cannot clash with an engine's own gRPC use.
//
// Security is explicit: NewServer and Dial take transport credentials and
// refuse nil. Use credentials.NewTLS across machines (the manifest is
// MAC'd, but the page bytes are authenticated only by the content
// checksum against the MAC'd manifest and by the channel); use
// insecure.NewCredentials only on loopback or a trusted fabric.
//
// The sender's data frames go to gRPC as the exporting pool's pages
// themselves when it lends them (handoff.ViewStream: a pool of host
// memory): gRPC's writer copies them from the pages into its write
// buffer, and gives them back (the pages stay pinned until then) once it
// has, or once it has dropped them; see SendViews for a dead connection.
//
// gRPC bounds no wait for a message, so a sender that stalls on a stream
// it keeps open is bounded by the receiver's TransferTimeout: when that
// aborts the import, the server stops waiting for the next frame
// (handoff.InterruptibleEndpoint), sends the verdict and ends the RPC.
// For that, the server reads each stream on a goroutine of its own.
//
// Flow-control windows are large (WindowBytes) because a transfer is one
// long bulk stream: the default 64 KiB window would cap a loopback
// transfer far below memory bandwidth. They are not larger than that,
// because the window is also how far gRPC's reader runs ahead of the
// receiver: within a few MiB, the bytes the receiver sums and writes are
// still in cache (on loopback, 4–8 MiB moved a 256 MiB handoff 10–15%
// faster than 32 MiB). A link whose bandwidth-delay product is larger
// (hundreds of Gb/s at more than ~150 µs) wants a larger window: pass
// grpc.InitialWindowSize and grpc.WithInitialWindowSize (and the
// connection variants) as extra options, which override these.
//
// # Cost
//
// gRPC costs more CPU per byte than the socket under it, and this package
// does not take that away: grpc-go writes every message in 16 KiB HTTP/2
// frames through one writer goroutine per connection, which copies them
// into its write buffer so that it can hand the kernel large writes, and
// its reader copies every frame out of its read buffer into a buffer of
// its own (the one RecvParts hands on). Writing each frame, or reading
// each, with its own system call instead (writev of header and payload,
// readv of payload and next header) was measured, and on loopback it
// costs more CPU than the copies it saves: a 16 KiB send or receive on
// loopback pays the kernel's per-segment work. On bench/README.md's two
// cores, where both ends of a loopback handoff share the CPU, gRPC alone
// (BenchmarkGRPCStream: no checksums, no decode pool) takes about twice
// the CPU of a raw TCP copy of the same bytes (272 against 132 ms per
// 256 MiB at the median of 10 rounds), and a handoff, which also sums
// every byte on each side, writes the decode pages and scrubs the prefill
// pages, about three times (388 against 129 ms); those ratios, not the
// wire, set the handoff's speed there: x-tcp 0.36 at the median, and gRPC
// alone, the ceiling, 0.52. Where each end has cores of its own, the
// busiest single goroutine is the likely limit: by the profiles, the
// connection's writer (about 100–130 ms of CPU per 256 MiB on the two
// cores); that was not measured.
//
// # Errors
//
// Every error the package returns wraps ErrNoCredentials or one of
// handoff's sentinels: handoff.ErrTransport for anything gRPC or the
// network reports (the sender's Send then wraps it again, or turns it into
// the receiver's verdict), handoff.ErrInvalidArgument for a nil server,
// receiver, transport or context. A transfer's refusals are the handoff
// package's; they travel as verdicts, not as gRPC status errors.
package grpcx

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/mem"

	"github.com/kvfence/kvfence/handoff"
)

const (
	// ServiceName and Method name the RPC on the wire.
	ServiceName = "kvfence.handoff.v1.Handoff"
	Method      = "/" + ServiceName + "/Transfer"
	// MaxMessageBytes bounds one message: a data frame holds at least one
	// whole page, so pages (over all regions) must be smaller than this.
	MaxMessageBytes = 256 << 20
	// WindowBytes is the per-stream and per-connection flow-control
	// window: the most bytes in flight.
	WindowBytes = 8 << 20
	// bufferBytes sizes the connection's read and write buffers: fewer,
	// larger syscalls for bulk data.
	bufferBytes = 1 << 20
)

// ErrNoCredentials: NewServer or Dial without transport credentials.
var ErrNoCredentials = errors.New("grpcx: transport credentials required (TLS, or insecure for loopback)")

// frame is what passes through the codec: one handoff message, either
// bytes to copy or a pooled buffer gRPC takes over; received, either
// copied into b or, if keep is set, kept as the buffers it arrived in.
type frame struct {
	b     []byte
	owned mem.BufferSlice // buffers gRPC takes over, if set
	// marshaled: gRPC took the frame's buffers (Marshal ran), so it frees
	// them; otherwise the sender must.
	marshaled bool
	keep      bool
	kept      mem.BufferSlice // referenced until release
	parts     [][]byte        // kept's bytes
}

// release frees the buffers a received frame kept.
func (f *frame) release() {
	if f.kept != nil {
		f.kept.Free()
		f.kept, f.parts = nil, f.parts[:0]
	}
}

// rawCodec moves frames as their bytes. It is forced only on this
// package's streams, so a value that is not a *frame is this package's
// bug; gRPC reports the codec's error to SendMsg or RecvMsg, where it
// fails the transfer (handoff.ErrTransport). Marshal copies into a pooled
// buffer, which gRPC frees once written (the caller may reuse its slice as
// soon as Send returns, as handoff.Stream promises), unless the frame
// carries a buffer gRPC owns. Unmarshal copies into the frame's own
// buffer, reused from message to message, or keeps gRPC's buffers
// (16 KiB each, one per HTTP/2 data frame) for the receiver to write
// pages from without that copy.
type rawCodec struct{}

func (rawCodec) Name() string { return "kvfence-raw" }

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	f, ok := v.(*frame)
	if !ok {
		return nil, fmt.Errorf("%w: grpcx codec cannot marshal %T", handoff.ErrTransport, v)
	}
	if f.owned != nil {
		f.marshaled = true
		return f.owned, nil
	}
	return mem.BufferSlice{mem.Copy(f.b, mem.DefaultBufferPool())}, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	f, ok := v.(*frame)
	if !ok {
		return fmt.Errorf("%w: grpcx codec cannot unmarshal into %T", handoff.ErrTransport, v)
	}
	if f.keep {
		data.Ref() // gRPC frees its reference when Unmarshal returns
		f.kept = data
		for _, b := range data {
			f.parts = append(f.parts, b.ReadOnlyData())
		}
		return nil
	}
	n := data.Len()
	if cap(f.b) < n {
		f.b = make([]byte, n)
	}
	f.b = f.b[:n]
	data.CopyTo(f.b)
	return nil
}

type transferServer interface{ transfer(grpc.ServerStream) error }

var streamDesc = grpc.StreamDesc{
	StreamName:    "Transfer",
	ServerStreams: true,
	ClientStreams: true,
	Handler: func(srv any, stream grpc.ServerStream) error {
		return srv.(transferServer).transfer(stream)
	},
}

var serviceDesc = grpc.ServiceDesc{
	ServiceName: ServiceName,
	HandlerType: (*transferServer)(nil),
	Streams:     []grpc.StreamDesc{streamDesc},
}

type service struct{ r *handoff.Receiver }

// transfer serves one stream. The receiver's verdicts already told the
// sender how it ended, so the RPC itself ends without a status error.
func (s *service) transfer(stream grpc.ServerStream) error {
	e := newServerEnd(stream)
	defer e.close()
	s.r.Serve(stream.Context(), e)
	return nil
}

// serverEnd is the receiver's end of one stream. gRPC offers no way to
// end a RecvMsg short of ending the RPC, which would take the verdict
// with it, so the stream is read on a goroutine of its own (reader), one
// message per Recv, and a Recv that InterruptRecv ends leaves that read
// to finish when the handler returns.
type serverEnd struct {
	stream grpc.ServerStream
	// in is the message read last: the reader's from a request on reads
	// until its answer on read, the receiver's from then until its next
	// Recv.
	in          frame
	reads       chan bool  // to the reader: read a message; keep its buffers (RecvParts)?
	read        chan error // from the reader: the read's error
	interrupted chan struct{}
	interrupt   sync.Once
}

var (
	_ handoff.PartsEndpoint         = (*serverEnd)(nil)
	_ handoff.InterruptibleEndpoint = (*serverEnd)(nil)
)

// errInterrupted is what Recv returns once the receiver has stopped
// waiting for the sender (InterruptRecv).
var errInterrupted = fmt.Errorf("%w: grpcx: the receiver stopped waiting for the sender", handoff.ErrTransport)

func newServerEnd(stream grpc.ServerStream) *serverEnd {
	e := &serverEnd{stream: stream, reads: make(chan bool), read: make(chan error, 1), interrupted: make(chan struct{})}
	go e.reader()
	return e
}

// reader reads a message for each request until close; its read in
// progress then, if any, ends with the RPC.
func (e *serverEnd) reader() {
	for keep := range e.reads {
		e.in.release()
		e.in.keep = keep
		e.read <- e.stream.RecvMsg(&e.in)
	}
	e.in.release()
}

// close ends the reader once the receiver is done with the stream; the
// reader frees the last message's buffers.
func (e *serverEnd) close() { close(e.reads) }

// recv has the reader read one message into e.in.
func (e *serverEnd) recv(keep bool) error {
	select {
	case <-e.interrupted:
		return errInterrupted
	default:
	}
	// The reader is idle: it answered every request before this one (an
	// interrupted Recv returns above from then on).
	e.reads <- keep
	select {
	case err := <-e.read:
		return err
	case <-e.interrupted:
		return errInterrupted
	}
}

func (e *serverEnd) Recv() ([]byte, error) {
	if err := e.recv(false); err != nil {
		return nil, err
	}
	return e.in.b, nil
}

// RecvParts implements handoff.PartsEndpoint: the message stays in gRPC's
// receive buffers until the next receive.
func (e *serverEnd) RecvParts() ([][]byte, error) {
	if err := e.recv(true); err != nil {
		return nil, err
	}
	return e.in.parts, nil
}

// InterruptRecv implements handoff.InterruptibleEndpoint. Send goes on
// working: the RPC lives until the handler returns.
func (e *serverEnd) InterruptRecv() { e.interrupt.Do(func() { close(e.interrupted) }) }

// Send implements handoff.Endpoint. Its errors, and Recv's, go to
// handoff.Receiver only, which wraps each in handoff.ErrTransport (and
// needs Recv's io.EOF as it is, the end of the sender's messages).
func (e *serverEnd) Send(msg []byte) error { return e.stream.SendMsg(&frame{b: msg}) }

// Register adds the handoff service, served by r, to s. s must have been
// built with ServerOptions (the codec and message limits). A nil s or r is
// refused with handoff.ErrInvalidArgument and nothing is registered: a nil
// receiver would otherwise panic in the handler of the first transfer,
// taking the decode process down.
func Register(s *grpc.Server, r *handoff.Receiver) error {
	switch {
	case s == nil:
		return fmt.Errorf("%w: Register on a nil gRPC server", handoff.ErrInvalidArgument)
	case r == nil:
		return fmt.Errorf("%w: Register of a nil receiver", handoff.ErrInvalidArgument)
	}
	s.RegisterService(&serviceDesc, &service{r: r})
	return nil
}

// ServerOptions are the options a server carrying handoffs needs, with
// creds (required).
func ServerOptions(creds credentials.TransportCredentials) ([]grpc.ServerOption, error) {
	if creds == nil {
		return nil, ErrNoCredentials
	}
	return []grpc.ServerOption{
		grpc.Creds(creds),
		grpc.ForceServerCodecV2(rawCodec{}),
		grpc.MaxRecvMsgSize(MaxMessageBytes),
		grpc.MaxSendMsgSize(MaxMessageBytes),
		grpc.InitialWindowSize(WindowBytes),
		grpc.InitialConnWindowSize(WindowBytes),
		grpc.WriteBufferSize(bufferBytes),
		grpc.ReadBufferSize(bufferBytes),
		experimental.BufferPool(buffers),
		// Stop and GracefulStop return once every transfer's handler has:
		// the imports it began have ended (scrubbed, if they failed).
		grpc.WaitForHandlers(true),
	}, nil
}

// NewServer returns a gRPC server that imports transfers with r. Serve it
// on a listener; stop it with Stop or GracefulStop, which return once the
// imports of the transfers in flight have ended. Without credentials it
// fails with ErrNoCredentials, without a receiver with
// handoff.ErrInvalidArgument.
func NewServer(r *handoff.Receiver, creds credentials.TransportCredentials, extra ...grpc.ServerOption) (*grpc.Server, error) {
	opts, err := ServerOptions(creds)
	if err != nil {
		return nil, err
	}
	if r == nil {
		return nil, fmt.Errorf("%w: server without a receiver", handoff.ErrInvalidArgument)
	}
	s := grpc.NewServer(append(opts, extra...)...)
	if err := Register(s, r); err != nil {
		return nil, err
	}
	return s, nil
}

// Transport is a handoff.Transport to one gRPC server.
type Transport struct{ cc *grpc.ClientConn }

var _ handoff.Transport = (*Transport)(nil)

// Dial returns a transport to target (host:port) with creds (required).
// The connection is made lazily, on the first Open.
func Dial(target string, creds credentials.TransportCredentials, extra ...grpc.DialOption) (*Transport, error) {
	if creds == nil {
		return nil, ErrNoCredentials
	}
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithInitialWindowSize(WindowBytes),
		grpc.WithInitialConnWindowSize(WindowBytes),
		grpc.WithWriteBufferSize(bufferBytes),
		grpc.WithReadBufferSize(bufferBytes),
		experimental.WithBufferPool(buffers),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(rawCodec{}),
			grpc.MaxCallRecvMsgSize(MaxMessageBytes), grpc.MaxCallSendMsgSize(MaxMessageBytes)),
	}, extra...)
	cc, err := grpc.NewClient(target, opts...)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", handoff.ErrTransport, err)
	}
	return &Transport{cc: cc}, nil
}

// errNoConn is what a nil or zero Transport answers: one not made by Dial.
var errNoConn = fmt.Errorf("%w: transport without a connection (Dial failed?)", handoff.ErrInvalidArgument)

// Close closes the connection.
func (t *Transport) Close() error {
	if t == nil || t.cc == nil {
		return errNoConn
	}
	if err := t.cc.Close(); err != nil {
		return fmt.Errorf("%w: close: %w", handoff.ErrTransport, err)
	}
	return nil
}

// Open implements handoff.Transport. A nil or zero transport, or a nil
// context, is handoff.ErrInvalidArgument.
func (t *Transport) Open(ctx context.Context) (handoff.Stream, error) {
	switch {
	case t == nil || t.cc == nil:
		return nil, errNoConn
	case ctx == nil:
		return nil, fmt.Errorf("%w: Open with a nil context", handoff.ErrInvalidArgument)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("%w: %w", handoff.ErrTransport, context.Cause(ctx))
	}
	sctx, cancel := context.WithCancel(ctx)
	st, err := t.cc.NewStream(sctx, &streamDesc, Method)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("%w: %w", handoff.ErrTransport, err)
	}
	return &clientStream{st: st, ctx: ctx, cancel: cancel}, nil
}

type clientStream struct {
	st     grpc.ClientStream
	ctx    context.Context // the caller's: its end names the failures it causes
	cancel context.CancelFunc
	in     frame
	lent   []*lentState // of SendViews, for Close
}

var (
	_ handoff.OwningStream = (*clientStream)(nil)
	_ handoff.ViewStream   = (*clientStream)(nil)
)

// bufferPool is the connection's buffer pool: gRPC reads every incoming
// HTTP/2 frame into one of its buffers. gRPC's default pool clears each
// buffer it hands out and keeps none above 1 MiB; a transfer moves
// hundreds of MiB, and every buffer this pool hands out is overwritten up
// to its length before anyone reads it (io.ReadFull of a frame), so the
// clearing is pure cost. Buffers come in power-of-two size classes.
type bufferPool struct{ classes [40]sync.Pool }

var buffers = &bufferPool{}

func (bp *bufferPool) Get(n int) *[]byte {
	c := bits.Len(uint(max(n, 1) - 1))
	if c >= len(bp.classes) {
		b := make([]byte, n)
		return &b
	}
	if b, ok := bp.classes[c].Get().(*[]byte); ok {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<c)
	return &b
}

func (bp *bufferPool) Put(b *[]byte) {
	c := bits.Len(uint(cap(*b)) - 1)
	if cap(*b) == 1<<c && c < len(bp.classes) {
		bp.classes[c].Put(b)
	}
}

// donePool is the "pool" of one owned message: gRPC puts the buffer back
// once it has written it (or dropped it), which is when the sender may
// have it back.
type donePool struct{ done func() }

func (donePool) Get(int) *[]byte { panic("grpcx: donePool lends nothing") }
func (d donePool) Put(*[]byte)   { d.done() }

// SendOwned sends msg without copying it: gRPC writes the frames of the
// message straight from msg and frees it through done.
func (s *clientStream) SendOwned(msg []byte, done func()) error {
	if mem.IsBelowBufferPoolingThreshold(cap(msg)) {
		err := s.st.SendMsg(&frame{b: msg}) // mem.NewBuffer would not report back
		done()
		return s.fail(err)
	}
	return s.sendOwned(mem.BufferSlice{mem.NewBuffer(&msg, donePool{done})})
}

// SendViews implements handoff.ViewStream: the message is head (copied)
// and then each view, which gRPC writes to the connection straight from
// the exporting pool's pages. A view too small for gRPC to report its
// release is copied instead.
//
// done must run only when gRPC will read none of the views again. Each
// lent view is a gRPC buffer whose release comes back to lentViews.Put,
// and done runs when the last is back: gRPC frees a message's buffers
// once its writer has copied them out, or when it drops the stream. But
// when a connection dies, grpc-go (1.85) drops the messages still queued
// on its streams without freeing them; nothing reads them any more, and
// nothing would ever run done, so the export could never end. So every
// lent buffer also points into one array per message (lentViews.views),
// and a cleanup on that array runs done once it is unreachable: then no
// gRPC buffer of the message exists, freed or dropped, and gRPC reads a
// buffer's bytes only while it holds the buffer (the slices its writer
// takes from one are dropped before it lets the buffer go). That needs a
// garbage collection after gRPC dropped them: Close, on a stream that
// ends with views still lent, asks for a few (nudgeCollections). done
// must not reach the stream: it is the cleanup's argument, and through
// the stream's queues it would keep the views' array reachable for ever.
func (s *clientStream) SendViews(head []byte, views [][]byte, done func()) error {
	st := &lentState{done: done}
	st.left.Store(1) // SendViews' own, dropped below
	msg := make(mem.BufferSlice, 0, 1+len(views))
	msg = append(msg, mem.Copy(head, mem.DefaultBufferPool()))
	lent := &lentViews{views: make([][]byte, 0, len(views)), st: st}
	for _, v := range views {
		if mem.IsBelowBufferPoolingThreshold(len(v)) {
			msg = append(msg, mem.Copy(v, mem.DefaultBufferPool()))
			continue
		}
		st.left.Add(1)
		lent.views = append(lent.views, v[:len(v):len(v)]) // never reallocated: capacity len(views)
		msg = append(msg, mem.NewBuffer(&lent.views[len(lent.views)-1], lent))
	}
	if len(lent.views) > 0 {
		runtime.AddCleanup(&lent.views[0], (*lentState).collected, st)
		s.lent = append(s.lent, st)
	}
	err := s.sendOwned(msg)
	st.drop()
	return err
}

// lentViews is the "pool" of one message's lent views: gRPC puts each
// view's buffer back here when it frees it. views holds what the buffers
// point at (see SendViews).
type lentViews struct {
	views [][]byte
	st    *lentState
}

func (*lentViews) Get(int) *[]byte { panic("grpcx: lentViews lends nothing") }

func (l *lentViews) Put(*[]byte) { l.st.drop() }

// lentState counts one message's views gRPC holds (and SendViews itself,
// while it runs) and runs done once, when the count reaches zero or the
// message's buffers are gone. It must not reach the views' array, whose
// cleanup it is the argument of.
type lentState struct {
	left     atomic.Int32
	finished atomic.Bool
	done     func()
}

func (s *lentState) drop() {
	if s.left.Add(-1) == 0 {
		s.finish()
	}
}

func (s *lentState) finish() bool {
	if s.finished.CompareAndSwap(false, true) {
		s.done()
		return true
	}
	return false
}

// lentCollected counts messages whose views came back only through their
// cleanup: gRPC dropped buffers it never freed (tests read it).
var lentCollected atomic.Uint64

// collected is the cleanup of a message's views: none of its buffers
// exists any more.
func (s *lentState) collected() {
	if s.finish() {
		lentCollected.Add(1)
	}
}

// nudgeCollections runs a few garbage collections, spaced out, while any
// of lent is unfinished: the views of a stream whose connection died come
// back only through their cleanup (SendViews), and the export they belong
// to cannot end before. It gives up after about a minute; the runtime's
// own collections go on.
func nudgeCollections(lent []*lentState) {
	unfinished := func() bool {
		for _, s := range lent {
			if !s.finished.Load() {
				return true
			}
		}
		return false
	}
	if !unfinished() {
		return
	}
	go func() {
		for _, d := range []time.Duration{10 * time.Millisecond, 100 * time.Millisecond, time.Second, 10 * time.Second, time.Minute} {
			time.Sleep(d)
			if !unfinished() {
				return
			}
			runtime.GC()
		}
	}()
}

// sendOwned sends the buffers of msg, which gRPC frees once written; if
// gRPC refused the message before it took them, they are freed here.
func (s *clientStream) sendOwned(msg mem.BufferSlice) error {
	f := &frame{owned: msg}
	err := s.st.SendMsg(f)
	if !f.marshaled {
		msg.Free()
	}
	return s.fail(err)
}

// fail wraps err, a gRPC error, in handoff.ErrTransport and, when the
// caller's context has ended (which cancels the stream), names its cause.
func (s *clientStream) fail(err error) error {
	switch {
	case err == nil:
		return nil
	case s.ctx.Err() != nil:
		return fmt.Errorf("%w: %w (%w)", handoff.ErrTransport, err, context.Cause(s.ctx))
	}
	return fmt.Errorf("%w: %w", handoff.ErrTransport, err)
}

func (s *clientStream) Send(msg []byte) error {
	return s.fail(s.st.SendMsg(&frame{b: msg}))
}

func (s *clientStream) CloseSend() error {
	return s.fail(s.st.CloseSend())
}

func (s *clientStream) Recv() ([]byte, error) {
	if err := s.st.RecvMsg(&s.in); err != nil {
		return nil, s.fail(err)
	}
	return s.in.b, nil
}

func (s *clientStream) Close() error {
	s.cancel()
	nudgeCollections(s.lent)
	s.lent = nil
	return nil
}
