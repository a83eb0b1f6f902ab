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

// This file is the client side of CURVE, for tests: a subscriber or
// replay client made of the package's frames, which can also stop short
// or misbehave where a libzmq client would not. (libzmq's own client,
// through pyzmq, is the tests' independent one.)

// CurveClientStop says where DialCurvePeer stops a handshake short.
type CurveClientStop int

const (
	CurveComplete      CurveClientStop = iota
	CurveAfterHello                    // send HELLO, then nothing
	CurveAfterGreeting                 // send the greeting, then nothing
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
	p, err := curveClient(c, sockType, server, secret, stop, timeout)
	if err != nil {
		c.Close()
		return nil, err
	}
	return p, nil
}

func curveClient(c net.Conn, sockType string, server, secret CurveKey, stop CurveClientStop, timeout time.Duration) (*Peer, error) {
	c.SetDeadline(time.Now().Add(timeout))
	defer c.SetDeadline(time.Time{})
	z := &zconn{c: c, r: bufio.NewReaderSize(c, 4096), timeout: timeout}
	g := greetingFor("CURVE", false)
	if _, err := c.Write(g[:]); err != nil {
		return nil, err
	}
	if stop == CurveAfterGreeting {
		return &Peer{z: z}, nil
	}
	var theirs [greetingLen]byte
	if _, err := io.ReadFull(z.r, theirs[:]); err != nil {
		return nil, fmt.Errorf("the server's greeting: %w", err)
	}
	if string(bytes.TrimRight(theirs[12:32], "\x00")) != "CURVE" { // libzmq leaves as-server 0
		return nil, fmt.Errorf("not a CURVE server: % x", theirs[12:33])
	}
	transient, transientSecret, err := box.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
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
	if stop == CurveAfterHello {
		return &Peer{z: z}, nil
	}
	welcome, err := z.readCommand("WELCOME")
	if err != nil {
		return nil, err
	}
	if len(welcome) != 8+16+144 {
		return nil, fmt.Errorf("a WELCOME of %d bytes", len(welcome))
	}
	inner, ok := box.Open(nil, welcome[24:], longNonce("WELCOME-", welcome[8:24]), &serverKey, transientSecret)
	if !ok {
		return nil, fmt.Errorf("the WELCOME box does not open")
	}
	var serverTransient [32]byte
	copy(serverTransient[:], inner[:32])
	cookie := inner[32:]

	var vouchNonce [16]byte
	rand.Read(vouchNonce[:])
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
	n := binary.BigEndian.Uint64(ready[6:14])
	meta, ok := box.OpenAfterPrecomputation(nil, ready[14:], shortNonce("CurveZMQREADY---", n), &sess.key)
	if !ok {
		return nil, fmt.Errorf("the READY box does not open")
	}
	m, err := parseProps(meta)
	if err != nil {
		return nil, err
	}
	sess.sendNonce, sess.recvNonce = nonce, n
	z.curve, z.peerType = sess, m["socket-type"]
	return &Peer{z: z}, nil
}
