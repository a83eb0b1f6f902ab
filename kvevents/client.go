package kvevents

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strings"
	"time"

	"golang.org/x/crypto/nacl/box"
)

// This file is the client side: a subscriber for Go routers (and the
// tests and benchmarks), over NULL or CURVE. go-zeromq/zmq4 serves NULL
// as well, but has no CURVE.

// ClientCurve makes a client connect with CURVE.
type ClientCurve struct {
	// ServerKey is the publisher's public key (CurveConfig.SecretKey's).
	ServerKey CurveKey
	// SecretKey is the client's own long-term secret key, whose public
	// key the publisher may list in CurveConfig.Clients.
	SecretKey CurveKey
}

// Subscriber is a SUB socket's connection to one publisher.
type Subscriber struct {
	z *zconn
}

// DialSubscriber connects to a publisher's PUB socket at endpoint
// ("tcp://HOST:PORT" or "ipc://PATH"), completes the handshake within
// timeout, with CURVE if curve is set, and subscribes to topic (a prefix;
// "" for every message).
func DialSubscriber(endpoint, topic string, curve *ClientCurve, timeout time.Duration) (*Subscriber, error) {
	network, addr := "tcp", strings.TrimPrefix(endpoint, "tcp://")
	if path, ok := strings.CutPrefix(endpoint, "ipc://"); ok {
		network, addr = "unix", path
	}
	c, err := net.DialTimeout(network, addr, timeout)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrPeer, endpoint, err)
	}
	var z *zconn
	if curve != nil {
		z, err = curveClient(c, "SUB", curve.ServerKey, curve.SecretKey, curveComplete, timeout)
	} else {
		z, err = handshake(c, "SUB", []string{"PUB", "XPUB"}, timeout, nil)
	}
	if err == nil {
		c.SetWriteDeadline(time.Now().Add(timeout))
		err = z.writeMessage(append([]byte{1}, topic...))
		c.SetWriteDeadline(time.Time{})
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	return &Subscriber{z: z}, nil
}

// Recv returns the next message: its topic, sequence number and payload
// (an EventBatch).
func (s *Subscriber) Recv() (topic string, seq uint64, payload []byte, err error) {
	msg, err := s.z.readMessage(1 << 30)
	if err != nil {
		return "", 0, nil, err
	}
	if len(msg) != 3 || len(msg[1]) != 8 {
		return "", 0, nil, fmt.Errorf("%w: a message of %d frames, not [topic, seq, payload]", ErrPeer, len(msg))
	}
	return string(msg[0]), binary.BigEndian.Uint64(msg[1]), msg[2], nil
}

// Close closes the connection; a Recv blocked on it returns an error.
func (s *Subscriber) Close() error { return s.z.c.Close() }

// curveStop says where curveClient stops a handshake short (for tests).
type curveStop int

const (
	curveComplete curveStop = iota
	curveAfterHello
	curveAfterGreeting
)

// curveClient runs CURVE's handshake as the client on c: the greetings,
// HELLO, WELCOME, INITIATE (with a vouch for the client's key), READY.
func curveClient(c net.Conn, sockType string, server, secret CurveKey, stop curveStop, timeout time.Duration) (*zconn, error) {
	c.SetDeadline(time.Now().Add(timeout))
	defer c.SetDeadline(time.Time{})
	z := &zconn{c: c, r: bufio.NewReaderSize(c, 4096), timeout: timeout}
	g := greetingFor("CURVE", false)
	if _, err := c.Write(g[:]); err != nil {
		return nil, fmt.Errorf("%w: sending the greeting: %w", ErrPeer, err)
	}
	if stop == curveAfterGreeting {
		return z, nil
	}
	var theirs [greetingLen]byte
	if _, err := io.ReadFull(z.r, theirs[:]); err != nil {
		return nil, fmt.Errorf("%w: the server's greeting: %w", ErrPeer, err)
	}
	if string(bytes.TrimRight(theirs[12:32], "\x00")) != "CURVE" { // libzmq leaves as-server 0
		return nil, fmt.Errorf("%w: %w: not a CURVE server (mechanism %q)", ErrPeer, ErrAuth, bytes.TrimRight(theirs[12:32], "\x00"))
	}
	transient, transientSecret, err := box.GenerateKey(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("%w: curve: %w", ErrPeer, err)
	}
	serverKey := [32]byte(server)
	nonce := uint64(1)
	hello := append([]byte{1, 0}, make([]byte, 72)...)
	hello = append(hello, transient[:]...)
	hello = binary.BigEndian.AppendUint64(hello, nonce)
	hello = box.Seal(hello, make([]byte, 64), shortNonce("CurveZMQHELLO---", nonce), &serverKey, transientSecret)
	if err := z.writeCommand("HELLO", hello); err != nil {
		return nil, err
	}
	if stop == curveAfterHello {
		return z, nil
	}
	welcome, err := z.readCommand("WELCOME")
	if err != nil {
		return nil, err
	}
	if len(welcome) != 8+16+144 {
		return nil, fmt.Errorf("%w: a WELCOME of %d bytes", ErrPeer, len(welcome))
	}
	inner, ok := box.Open(nil, welcome[24:], longNonce("WELCOME-", welcome[8:24]), &serverKey, transientSecret)
	if !ok {
		return nil, fmt.Errorf("%w: %w: the WELCOME box does not open: another server key", ErrPeer, ErrAuth)
	}
	var serverTransient [32]byte
	copy(serverTransient[:], inner[:32])
	cookie := inner[32:]

	var vouchNonce [16]byte
	if _, err := rand.Read(vouchNonce[:]); err != nil {
		return nil, fmt.Errorf("%w: curve: %w", ErrPeer, err)
	}
	permanent := [32]byte(secret)
	public := secret.Public()
	vouch := box.Seal(append([]byte(nil), vouchNonce[:]...), append(transient[:], server[:]...),
		longNonce("VOUCH---", vouchNonce[:]), &serverTransient, &permanent)
	plain := append(append(append([]byte(nil), public[:]...), vouch...), props("Socket-Type", sockType)...)
	sess := &curveSession{sendPrefix: "CurveZMQMESSAGEC", recvPrefix: "CurveZMQMESSAGES"}
	box.Precompute(&sess.key, &serverTransient, transientSecret)
	nonce++
	initiate := binary.BigEndian.AppendUint64(append([]byte(nil), cookie...), nonce)
	initiate = box.SealAfterPrecomputation(initiate, plain, shortNonce("CurveZMQINITIATE", nonce), &sess.key)
	if err := z.writeCommand("INITIATE", initiate); err != nil {
		return nil, err
	}
	ready, err := z.readCommand("READY")
	if err != nil {
		return nil, err // an ERROR, for a client not let in
	}
	if len(ready) < 6+8+box.Overhead {
		return nil, fmt.Errorf("%w: a READY of %d bytes", ErrPeer, len(ready))
	}
	n := binary.BigEndian.Uint64(ready[6:14])
	meta, ok := box.OpenAfterPrecomputation(nil, ready[14:], shortNonce("CurveZMQREADY---", n), &sess.key)
	if !ok {
		return nil, fmt.Errorf("%w: %w: the READY box does not open", ErrPeer, ErrAuth)
	}
	m, err := parseProps(meta)
	if err != nil {
		return nil, err
	}
	sess.sendNonce, sess.recvNonce = nonce, n
	z.curve, z.peerType = sess, m["socket-type"]
	return z, nil
}
