//go:build cgo && ucx

package ucxx

import (
	"context"
	"fmt"
	"net"

	"github.com/kvfence/kvfence/handoff"
)

// Lanes describes the transports under a stream Open returned.
func Lanes(st handoff.Stream) string { return st.(*clientStream).c.lanes() }

// NewRawServer is a server whose every connection runs serve instead of
// a receiver's: for tests and benchmarks of the transport alone.
func NewRawServer(serve func(context.Context, handoff.Endpoint) error, opts Options) (*Server, error) {
	return newServer(serve, opts)
}

// Cut breaks the connection under a stream Open returned as a network
// failure would: the endpoint goes, and the connection the ends met over
// is reset.
func Cut(st handoff.Stream) {
	c := st.(*clientStream).c
	if tc, ok := c.ctrl.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	c.fail(fmt.Errorf("%w: cut by the test", handoff.ErrTransport))
}

// ForgeWrite sends src by rendezvous as a write at offset off of extent
// ext of the receiver's exposed memory (as over TCP alone), past none of the
// sender's checks of the grant, as a sender that lies would, and waits
// for the send to end. It writes after the receiver's revoke too.
func ForgeWrite(st handoff.Stream, ext int, off int64, src []byte) error {
	c := st.(*clientStream).c
	c.w.mu.Lock()
	c.revoked = false
	c.w.mu.Unlock()
	w := &remoteWriter{s: st.(*clientStream), bytes: []int64{1 << 62, 1 << 62}, receives: true}
	wait, err := w.Write([]handoff.RemotePut{{Mem: ext, Off: off, Src: [][]byte{src}}})
	if err != nil {
		return err
	}
	return wait()
}

// Workers reports how many UCX workers the transport's or the server's
// context has made and destroyed.
func Workers(v any) (made, destroyed int) {
	var x *ucxContext
	switch v := v.(type) {
	case *Transport:
		x = v.x
	case *Server:
		x = v.x
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.mu.made, x.mu.destroyed
}
