package handoff

import (
	"context"
	"fmt"
	"io"
	"sync"
)

// Transport opens transfers from a prefill pool to one decode receiver.
// Implementations: InProcess (both pools in one process),
// handoff/grpcx (gRPC streaming across processes and machines),
// handoff/tcpx (frames of its own over TCP or TLS, at about half gRPC's
// CPU per byte) and handoff/ucxx (UCX: the units written into the decode
// pool's memory).
type Transport interface {
	// Open starts a transfer. The stream ends when ctx is done.
	Open(ctx context.Context) (Stream, error)
}

// Stream is the sender's end of one transfer: an ordered, reliable
// sequence of messages to the receiver and of verdicts back.
type Stream interface {
	// Send transmits msg; the stream does not keep msg after Send
	// returns. It must not be called concurrently with itself or CloseSend.
	Send(msg []byte) error
	// CloseSend tells the receiver no more messages follow.
	CloseSend() error
	// Recv returns the receiver's next message, valid until the next
	// Recv; io.EOF once the receiver has finished.
	Recv() ([]byte, error)
	// Close abandons the transfer (if it is still going) and frees the
	// stream. The receiver sees the transfer fail.
	Close() error
}

// OwningStream is a Stream that can take over a message instead of
// copying it. The sender transmits its data frames this way when the
// stream offers it: the buffer the pages were staged in goes to the wire
// without another copy.
type OwningStream interface {
	Stream
	// SendOwned transmits msg, which the stream owns from the call on:
	// it calls done exactly once, when it no longer needs msg's bytes,
	// whether or not the send succeeds (possibly before SendOwned
	// returns). The caller does not touch msg after the call.
	SendOwned(msg []byte, done func()) error
}

// ViewStream is a Stream that can send a data frame whose pages it reads
// where they lie, in the exporting pool's memory, instead of from a copy.
// The sender uses it when the pool lends its pages
// (kvcache.Outgoing.Viewable: host memory), so that no byte is staged
// between the pages and the transport: the pages stay pinned, and every
// end of the export waits, until the stream calls done.
type ViewStream interface {
	Stream
	// SendViews transmits one message: head followed by the bytes of
	// views, in order. The stream does not keep head or the views slice
	// after SendViews returns; it reads the views' bytes until it calls
	// done, exactly once, when it will read none of them again, whether
	// or not the send succeeds (possibly before SendViews returns). It
	// must not write them.
	SendViews(head []byte, views [][]byte, done func()) error
}

// Endpoint is the receiver's end of one transfer, what a transport
// passes to Receiver.Serve.
type Endpoint interface {
	// Recv returns the sender's next message, valid until the next Recv;
	// io.EOF after the sender's CloseSend, another error if the transfer
	// broke.
	Recv() ([]byte, error)
	// Send transmits msg to the sender; the endpoint does not keep msg.
	Send(msg []byte) error
}

// PartsEndpoint is an Endpoint that can hand over a message in the parts
// it arrived in, saving the copy into one buffer: the receiver writes
// page bytes from the parts straight into the decode pool's pages.
type PartsEndpoint interface {
	Endpoint
	// RecvParts returns the sender's next message as consecutive parts,
	// valid until the next Recv or RecvParts; errors as Recv's.
	RecvParts() ([][]byte, error)
}

// HoldingEndpoint is a PartsEndpoint that can keep a message past the
// next receive: the receiver writes one data frame's pages into the
// decode pool on a goroutine of its own while the transport reads the
// next frame from the connection, so that the two overlap instead of
// taking turns. handoff/tcpx implements it.
type HoldingEndpoint interface {
	PartsEndpoint
	// RecvHeld is RecvParts whose message stays valid, and untouched by
	// the endpoint, until release is called rather than until the next
	// receive; errors are RecvParts'. The caller calls release exactly
	// once, from any goroutine, and holds at most two messages at a time.
	// A Recv or RecvParts between RecvHeld calls is allowed; its message
	// is valid until the next receive, as always.
	RecvHeld() (parts [][]byte, release func(), err error)
}

// InterruptibleEndpoint is an Endpoint whose wait for the sender's next
// message can be ended from another goroutine. Receiver.Serve ends it
// when its TransferTimeout aborts the import, so that a sender that
// stalls holds neither the goroutine serving it, nor its connection, nor
// its request ID any longer than that. On an Endpoint that is not one,
// Serve waits until Recv returns on its own (the transport's read
// deadline, the peer's close). InProcess, handoff/tcpx and handoff/grpcx
// implement it.
type InterruptibleEndpoint interface {
	Endpoint
	// InterruptRecv makes a Recv (or RecvParts) in progress, and every
	// later one, return an error at once. Send still delivers where the
	// transport can, so that the receiver's verdict reaches the sender.
	// It may be called from any goroutine, concurrently with Recv and
	// Send, and more than once; never after Serve has returned.
	InterruptRecv()
}

// errRecvInterrupted is what an in-process receiver's Recv returns once
// InterruptRecv was called.
var errRecvInterrupted = fmt.Errorf("%w: in-process receive interrupted", ErrTransport)

// errPipeClosed is what an in-process stream returns once either end
// closed it: the in-process form of a dropped connection.
var errPipeClosed = fmt.Errorf("%w: in-process stream closed", ErrTransport)

// InProcess is a Transport to a Receiver in the same process: each Open
// starts Receiver.Serve on a goroutine, connected by a pair of channels.
// Messages are copied, so neither side keeps the other's buffers.
type InProcess struct {
	r      *Receiver
	serves sync.WaitGroup
}

// NewInProcess returns a transport that delivers to r. Open refuses to
// start a transfer if r is nil.
func NewInProcess(r *Receiver) *InProcess { return &InProcess{r: r} }

// Open implements Transport. A nil transport, receiver or context is
// ErrInvalidArgument (the receiver's nil would otherwise panic later, on
// the goroutine that serves the transfer, where no caller could recover).
func (t *InProcess) Open(ctx context.Context) (Stream, error) {
	switch {
	case t == nil || t.r == nil:
		return nil, fmt.Errorf("%w: in-process transport without a receiver", ErrInvalidArgument)
	case ctx == nil:
		return nil, fmt.Errorf("%w: Open with a nil context", ErrInvalidArgument)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrTransport, err)
	}
	p := newPipe()
	stop := context.AfterFunc(ctx, p.close)
	t.serves.Add(1)
	go func() {
		defer t.serves.Done()
		defer stop()
		t.r.Serve(ctx, &pipeEnd{p: p, server: true})
		p.finish()
	}()
	return &pipeEnd{p: p}, nil
}

// Wait blocks until every transfer this transport started has ended on
// the receiver's side.
func (t *InProcess) Wait() {
	if t != nil {
		t.serves.Wait()
	}
}

// pipe is a bidirectional in-process channel pair. toServer is closed by
// CloseSend; done by Close (a dropped connection); served when the
// receiver has returned, after its last verdict; interrupted by the
// receiver's InterruptRecv.
type pipe struct {
	toServer, toClient        chan []byte
	done, served, interrupted chan struct{}
	closeOnce                 sync.Once
	finishOnce                sync.Once
	interruptOnce             sync.Once
	sendClosed                bool // sender side only
}

func newPipe() *pipe {
	return &pipe{toServer: make(chan []byte, 4), toClient: make(chan []byte, 4),
		done: make(chan struct{}), served: make(chan struct{}), interrupted: make(chan struct{})}
}

func (p *pipe) close()     { p.closeOnce.Do(func() { close(p.done) }) }
func (p *pipe) finish()    { p.finishOnce.Do(func() { close(p.served) }) }
func (p *pipe) interrupt() { p.interruptOnce.Do(func() { close(p.interrupted) }) }

type pipeEnd struct {
	p      *pipe
	server bool
}

var (
	_ Stream                = (*pipeEnd)(nil)
	_ InterruptibleEndpoint = (*pipeEnd)(nil)
)

func (e *pipeEnd) Send(msg []byte) error {
	out := e.p.toServer
	if e.server {
		out = e.p.toClient
	} else if e.p.sendClosed {
		return fmt.Errorf("%w: send after CloseSend", ErrTransport)
	}
	select {
	case <-e.p.done:
		return errPipeClosed
	default:
	}
	select {
	case out <- append([]byte(nil), msg...):
		return nil
	case <-e.p.done:
		return errPipeClosed
	case <-e.p.served:
		return fmt.Errorf("%w: receiver has ended the transfer", ErrTransport)
	}
}

func (e *pipeEnd) CloseSend() error {
	if e.server || e.p.sendClosed {
		return nil
	}
	e.p.sendClosed = true
	close(e.p.toServer)
	return nil
}

func (e *pipeEnd) Recv() ([]byte, error) {
	in := e.p.toClient
	var ended, interrupted <-chan struct{}
	if e.server {
		in, interrupted = e.p.toServer, e.p.interrupted
		select {
		case <-interrupted:
			return nil, errRecvInterrupted
		default:
		}
	} else {
		ended = e.p.served
	}
	// Messages already delivered are read before a close is noticed, as
	// on a socket.
	select {
	case msg, ok := <-in:
		return recvResult(msg, ok)
	default:
	}
	select {
	case msg, ok := <-in:
		return recvResult(msg, ok)
	case <-e.p.done:
		return nil, errPipeClosed
	case <-interrupted:
		return nil, errRecvInterrupted
	case <-ended:
		select {
		case msg, ok := <-in:
			return recvResult(msg, ok)
		default:
			return nil, io.EOF
		}
	}
}

// InterruptRecv implements InterruptibleEndpoint on the receiver's end;
// on the sender's it does nothing.
func (e *pipeEnd) InterruptRecv() {
	if e.server {
		e.p.interrupt()
	}
}

func recvResult(msg []byte, ok bool) ([]byte, error) {
	if !ok {
		return nil, io.EOF
	}
	return msg, nil
}

func (e *pipeEnd) Close() error {
	e.p.close()
	return nil
}
