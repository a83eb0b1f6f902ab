package kvevents

import (
	"net"
	"strings"
	"time"
	"weak"
)

// Subscribed returns how many connected subscribers have at least one
// subscription, so that tests publish only once a subscriber will get it
// (ZMQ's PUB sends nothing before a subscription arrives).
func (p *Publisher) Subscribed() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for s := range p.mu.subs {
		s.mu.Lock()
		if len(s.topics) > 0 {
			n++
		}
		s.mu.Unlock()
	}
	return n
}

// Peer is a ZMTP peer made of the package's own handshake and frames, for
// tests that play a subscriber or a replay client and need to send what
// no well-behaved one would.
type Peer struct {
	z *zconn
}

// DialPeer connects to addr as a sockType socket, and returns once the
// handshake is done.
func DialPeer(addr, sockType string, timeout time.Duration) (*Peer, error) {
	network := "tcp"
	if path, ok := strings.CutPrefix(addr, "ipc://"); ok {
		network, addr = "unix", path
	}
	c, err := net.DialTimeout(network, addr, timeout)
	if err != nil {
		return nil, err
	}
	z, err := handshake(c, sockType, []string{"PUB", "ROUTER"}, timeout, nil)
	if err != nil {
		c.Close()
		return nil, err
	}
	return &Peer{z: z}, nil
}

// Conn is the peer's connection, for raw bytes.
func (p *Peer) Conn() net.Conn { return p.z.c }

// Send sends one message of frames.
func (p *Peer) Send(frames ...[]byte) error { return p.z.writeMessage(frames...) }

// Command sends one command frame.
func (p *Peer) Command(name string, body []byte) error { return p.z.writeCommand(name, body) }

// Frame reads one frame, commands included.
func (p *Peer) Frame() (body []byte, more, command bool, err error) { return p.z.readFrame(1 << 30) }

// Message reads one message, skipping commands.
func (p *Peer) Message() ([][]byte, error) { return p.z.readMessage(1 << 30) }

// NewestBatch is a weak pointer to the payload of the newest batch in
// the replay buffer, which tells when nothing holds it any more.
func (p *Publisher) NewestBatch() weak.Pointer[byte] {
	r := &p.ring
	r.mu.Lock()
	defer r.mu.Unlock()
	return weak.Make(&r.entries[(r.head+r.n-1)%r.maxSteps].payload[0])
}

// SendTampered sends one frame as Send does, with one bit of what goes on
// the wire flipped: under CURVE, a MESSAGE whose box does not open.
func (p *Peer) SendTampered(frame []byte) error {
	var b []byte
	if s := p.z.curve; s != nil {
		s.mu.Lock()
		b = s.sealLocked(nil, 0, frame)
		s.mu.Unlock()
	} else {
		b = appendMessage(nil, frame)
	}
	b[len(b)-1] ^= 1
	_, err := p.z.c.Write(b)
	return err
}
