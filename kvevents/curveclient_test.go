package kvevents

import (
	"net"
	"strings"
	"time"
)

// CurveClientStop says where DialCurvePeer stops a handshake short.
type CurveClientStop = curveStop

const (
	CurveComplete      = curveComplete
	CurveAfterHello    = curveAfterHello    // send HELLO, then nothing
	CurveAfterGreeting = curveAfterGreeting // send the greeting, then nothing
)

// DialCurvePeer connects to addr as a sockType CURVE client that takes
// server as the publisher's public key and holds the key pair of secret,
// and returns once the handshake is done (or, with stop, once it has sent
// what stop says, with the connection left open).
func DialCurvePeer(addr, sockType string, server, secret CurveKey, stop CurveClientStop, timeout time.Duration) (*Peer, error) {
	network := "tcp"
	if path, ok := strings.CutPrefix(addr, "ipc://"); ok {
		network, addr = "unix", path
	}
	c, err := net.DialTimeout(network, addr, timeout)
	if err != nil {
		return nil, err
	}
	z, err := curveClient(c, sockType, server, secret, stop, timeout)
	if err != nil {
		c.Close()
		return nil, err
	}
	return &Peer{z: z}, nil
}
