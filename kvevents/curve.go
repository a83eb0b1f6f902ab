package kvevents

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"

	"golang.org/x/crypto/curve25519"
	"golang.org/x/crypto/nacl/box"
	"golang.org/x/crypto/nacl/secretbox"
)

// This file is the server side of ZMTP CURVE (RFC 26, the CurveZMQ
// handshake of RFC 25 carried in ZMTP commands): the handshake that
// authenticates the server to every client and, optionally, clients to
// the server, and the MESSAGE commands that carry every frame after it,
// encrypted and authenticated. The cryptography is NaCl's box
// (Curve25519, XSalsa20, Poly1305) and secretbox, from
// golang.org/x/crypto; this file only lays out what RFC 26 puts in them.

// CurveKey is a CURVE key: a Curve25519 public or secret key. Its text
// form is Z85 (ZeroMQ's RFC 32, 40 characters), as zmq_curve_keypair and
// libzmq's tools print keys; ParseCurveKey reads that or 64 hex digits.
type CurveKey [32]byte

// NewCurveKeyPair returns a fresh key pair, as zmq_curve_keypair does.
func NewCurveKeyPair() (public, secret CurveKey, err error) {
	pub, sec, err := box.GenerateKey(rand.Reader)
	if err != nil {
		return CurveKey{}, CurveKey{}, fmt.Errorf("%w: curve key pair: %w", ErrInvalidConfig, err)
	}
	return *pub, *sec, nil
}

// Public returns the public key of a secret key, as zmq_curve_public
// does.
func (k CurveKey) Public() CurveKey {
	var pub CurveKey
	curve25519.ScalarBaseMult((*[32]byte)(&pub), (*[32]byte)(&k))
	return pub
}

// String is the key in Z85.
func (k CurveKey) String() string { return z85Encode(k[:]) }

// ParseCurveKey reads a key in Z85 (40 characters) or hex (64 digits).
func ParseCurveKey(s string) (CurveKey, error) {
	var k CurveKey
	switch len(s) {
	case 40:
		b, err := z85Decode(s)
		if err != nil {
			return k, err
		}
		copy(k[:], b)
	case 64:
		if _, err := hex.Decode(k[:], []byte(s)); err != nil {
			return k, fmt.Errorf("%w: curve key: %w", ErrInvalidConfig, err)
		}
	default:
		return k, fmt.Errorf("%w: curve key of %d characters: want 40 (Z85) or 64 (hex)", ErrInvalidConfig, len(s))
	}
	return k, nil
}

// CurveConfig secures both sockets of a publisher with CURVE.
type CurveConfig struct {
	// SecretKey is the publisher's long-term secret key, which the
	// operator keeps secret. Subscribers and replay clients configure its
	// public key (SecretKey.Public()) as their server key
	// (ZMQ_CURVE_SERVERKEY); a client with another server key completes
	// no handshake and gets nothing. Required: the zero key is refused.
	SecretKey CurveKey
	// Clients, if not empty, are the public keys of the clients let in:
	// a client whose long-term key is not one of them is refused after
	// it has proven it holds that key. Empty lets in every client that
	// knows the publisher's public key, which is then a credential to
	// be handed out as carefully as the stream's contents require.
	Clients []CurveKey
}

func (c *CurveConfig) validate() error {
	if c.SecretKey == (CurveKey{}) {
		return fmt.Errorf("%w: Curve.SecretKey is zero", ErrInvalidConfig)
	}
	return nil
}

func (c *CurveConfig) admits(client CurveKey) bool {
	if len(c.Clients) == 0 {
		return true
	}
	for _, k := range c.Clients {
		if k == client {
			return true
		}
	}
	return false
}

// curveServer is what a publisher's sockets know for CURVE: their keys.
type curveServer struct {
	cfg    CurveConfig
	public CurveKey
}

func newCurveServer(cfg *CurveConfig) *curveServer {
	if cfg == nil {
		return nil
	}
	return &curveServer{cfg: *cfg, public: cfg.SecretKey.Public()}
}

// Command bodies and nonce prefixes, RFC 26.
const (
	helloBodyLen    = 1 + 5 + 2 + 72 + 32 + 8 + 80                         // name, version, padding, C', nonce, box
	cookieLen       = 16 + 80                                              // nonce, box[C' + s']
	vouchLen        = 16 + 80                                              // nonce, box[C' + S]
	initiateMinLen  = 1 + 8 + cookieLen + 8 + box.Overhead + 32 + vouchLen // name, cookie, nonce, box[C + vouch]
	messageOverhead = 1 + 7 + 8 + box.Overhead + 1                         // name, nonce, MAC, flags
	msgFlagMore     = 0x01
	msgFlagCommand  = 0x02
)

// curveSession is one connection's state after the handshake: the key
// both sides precomputed from their transient keys, and the short nonces
// of each direction, which must only grow. Writes take mu, so that what
// goes on the wire carries nonces in the order it is sent.
type curveSession struct {
	key [32]byte
	// The nonce prefixes of MESSAGE commands this side sends and receives:
	// "CurveZMQMESSAGES" from the server, "CurveZMQMESSAGEC" from the
	// client.
	sendPrefix, recvPrefix string
	mu                     sync.Mutex
	sendNonce              uint64 // the last used; guarded by mu
	recvNonce              uint64 // the last received; the reader's alone
	plain                  []byte // seal's scratch; guarded by mu
}

func shortNonce(prefix string, n uint64) *[24]byte {
	var nonce [24]byte
	copy(nonce[:], prefix)
	binary.BigEndian.PutUint64(nonce[16:], n)
	return &nonce
}

func longNonce(prefix string, n []byte) *[24]byte {
	var nonce [24]byte
	copy(nonce[:], prefix)
	copy(nonce[8:], n)
	return &nonce
}

// curveHandshake runs CURVE's handshake, as the server, on z (whose
// greetings are exchanged) and returns the peer's metadata. Failures that
// mean the peer holds no key this server accepts wrap ErrAuth.
func (s *curveServer) handshake(z *zconn) (map[string]string, *curveSession, error) {
	auth := func(format string, args ...any) error {
		return fmt.Errorf("%w: %w: "+format, append([]any{ErrPeer, ErrAuth}, args...)...)
	}
	// HELLO: the client's transient public key C', and a box of 64 zero
	// bytes from C' to the server's long-term key: only a client that has
	// the server's public key makes one that opens.
	hello, err := z.readCommand("HELLO")
	if err != nil {
		return nil, nil, err
	}
	if len(hello) != helloBodyLen || hello[6] != 1 {
		return nil, nil, fmt.Errorf("%w: a HELLO of %d bytes, version %d: want %d bytes, version 1", ErrPeer, len(hello), hello[min(6, len(hello)-1)], helloBodyLen)
	}
	var clientTransient [32]byte
	copy(clientTransient[:], hello[80:112])
	helloNonce := binary.BigEndian.Uint64(hello[112:120])
	secret := [32]byte(s.cfg.SecretKey)
	opened, ok := box.Open(nil, hello[120:], shortNonce("CurveZMQHELLO---", helloNonce), &clientTransient, &secret)
	if !ok || !bytes.Equal(opened, make([]byte, 64)) {
		return nil, nil, auth("the HELLO box does not open: the client has another server key")
	}

	// WELCOME: the server's transient public key S' and a cookie that
	// holds C' and s' under a key of this connection alone, in a box to C'.
	serverTransient, serverTransientSecret, err := box.GenerateKey(rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: curve: %w", ErrPeer, err)
	}
	var cookieKey [32]byte
	var cookieNonce, welcomeNonce [16]byte
	for _, b := range [][]byte{cookieKey[:], cookieNonce[:], welcomeNonce[:]} {
		if _, err := rand.Read(b); err != nil {
			return nil, nil, fmt.Errorf("%w: curve: %w", ErrPeer, err)
		}
	}
	cookie := append(cookieNonce[:0:0], cookieNonce[:]...)
	cookie = secretbox.Seal(cookie, append(clientTransient[:], serverTransientSecret[:]...), longNonce("COOKIE--", cookieNonce[:]), &cookieKey)
	welcome := box.Seal(append([]byte(nil), welcomeNonce[:]...), append(serverTransient[:], cookie...),
		longNonce("WELCOME-", welcomeNonce[:]), &clientTransient, &secret)
	if err := z.writeCommand("WELCOME", welcome); err != nil {
		return nil, nil, err
	}

	// INITIATE: the cookie back, and a box from C' to S' with the client's
	// long-term key C, a vouch (a box from C to S' of C' and S: the client
	// holds C's secret key) and its metadata.
	initiate, err := z.readCommand("INITIATE")
	if err != nil {
		return nil, nil, err
	}
	if len(initiate) < initiateMinLen {
		return nil, nil, fmt.Errorf("%w: an INITIATE of %d bytes", ErrPeer, len(initiate))
	}
	body := initiate[9:] // after the name
	back, ok := secretbox.Open(nil, body[16:cookieLen], longNonce("COOKIE--", body[:16]), &cookieKey)
	if !ok || !bytes.Equal(back[:32], clientTransient[:]) || !bytes.Equal(back[32:], serverTransientSecret[:]) {
		return nil, nil, auth("the INITIATE's cookie is not this connection's")
	}
	initNonce := binary.BigEndian.Uint64(body[cookieLen : cookieLen+8])
	if initNonce <= helloNonce {
		return nil, nil, auth("INITIATE's nonce %d after HELLO's %d", initNonce, helloNonce)
	}
	sess := &curveSession{recvNonce: initNonce, sendPrefix: "CurveZMQMESSAGES", recvPrefix: "CurveZMQMESSAGEC"}
	box.Precompute(&sess.key, &clientTransient, serverTransientSecret)
	inner, ok := box.OpenAfterPrecomputation(nil, body[cookieLen+8:], shortNonce("CurveZMQINITIATE", initNonce), &sess.key)
	if !ok || len(inner) < 32+vouchLen {
		return nil, nil, auth("the INITIATE box does not open")
	}
	var client [32]byte
	copy(client[:], inner[:32])
	vouch, ok := box.Open(nil, inner[32+16:32+vouchLen], longNonce("VOUCH---", inner[32:48]), &client, serverTransientSecret)
	if !ok || !bytes.Equal(vouch[:32], clientTransient[:]) || !bytes.Equal(vouch[32:], s.public[:]) {
		return nil, nil, auth("the vouch does not prove the client's key")
	}
	meta, err := parseProps(inner[32+vouchLen:])
	if err != nil {
		return nil, nil, err
	}
	if !s.cfg.admits(CurveKey(client)) {
		z.writeCommand("ERROR", append([]byte{byte(len("client key not authorized"))}, "client key not authorized"...))
		return nil, nil, auth("client key %s is not among Curve.Clients", CurveKey(client))
	}
	return meta, sess, nil
}

// sealReady returns READY's body: a short nonce and a box of the
// server's metadata.
func (sess *curveSession) sealReady(meta []byte) []byte {
	sess.sendNonce++
	b := binary.BigEndian.AppendUint64(nil, sess.sendNonce)
	return box.SealAfterPrecomputation(b, meta, shortNonce("CurveZMQREADY---", sess.sendNonce), &sess.key)
}

// sealLocked appends to dst the frame (header and body) of a MESSAGE
// command carrying one frame of data with flags (msgFlagMore,
// msgFlagCommand). The caller holds mu.
func (sess *curveSession) sealLocked(dst []byte, flags byte, data []byte) []byte {
	sess.sendNonce++
	// A data frame, as libzmq sends it (and reads it: a MESSAGE in a
	// command frame never reaches its socket); its flags are inside.
	dst = appendHeader(dst, messageOverhead+len(data), 0)
	dst = append(dst, 7)
	dst = append(dst, "MESSAGE"...)
	dst = binary.BigEndian.AppendUint64(dst, sess.sendNonce)
	sess.plain = append(append(sess.plain[:0], flags), data...)
	return box.SealAfterPrecomputation(dst, sess.plain, shortNonce(sess.sendPrefix, sess.sendNonce), &sess.key)
}

// open decrypts the body of a MESSAGE command from the peer: it
// returns the frame it carries and its flags.
func (sess *curveSession) open(cmd []byte) (data []byte, flags byte, err error) {
	if len(cmd) < messageOverhead || string(cmd[:8]) != "\x07MESSAGE" {
		return nil, 0, fmt.Errorf("%w: after a CURVE handshake, a frame that is no MESSAGE", ErrPeer)
	}
	n := binary.BigEndian.Uint64(cmd[8:16])
	if n <= sess.recvNonce {
		return nil, 0, fmt.Errorf("%w: %w: MESSAGE nonce %d after %d (a replayed message)", ErrPeer, ErrAuth, n, sess.recvNonce)
	}
	plain, ok := box.OpenAfterPrecomputation(nil, cmd[16:], shortNonce(sess.recvPrefix, n), &sess.key)
	if !ok {
		return nil, 0, fmt.Errorf("%w: %w: a MESSAGE that does not open", ErrPeer, ErrAuth)
	}
	sess.recvNonce = n
	return plain[1:], plain[0], nil
}

// Z85, ZeroMQ's RFC 32: 4 bytes, big-endian, as 5 base-85 digits.
const z85Alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"

func z85Encode(b []byte) string {
	var sb strings.Builder
	for i := 0; i+4 <= len(b); i += 4 {
		v := binary.BigEndian.Uint32(b[i:])
		var d [5]byte
		for j := 4; j >= 0; j-- {
			d[j] = z85Alphabet[v%85]
			v /= 85
		}
		sb.Write(d[:])
	}
	return sb.String()
}

func z85Decode(s string) ([]byte, error) {
	if len(s)%5 != 0 {
		return nil, fmt.Errorf("%w: Z85 of %d characters, not a multiple of 5", ErrInvalidConfig, len(s))
	}
	out := make([]byte, 0, len(s)/5*4)
	for i := 0; i < len(s); i += 5 {
		var v uint64
		for j := range 5 {
			d := strings.IndexByte(z85Alphabet, s[i+j])
			if d < 0 {
				return nil, fmt.Errorf("%w: %q is not a Z85 character", ErrInvalidConfig, s[i+j])
			}
			v = v*85 + uint64(d)
		}
		if v > 0xffffffff {
			return nil, fmt.Errorf("%w: Z85 group %q out of range", ErrInvalidConfig, s[i:i+5])
		}
		out = binary.BigEndian.AppendUint32(out, uint32(v))
	}
	return out, nil
}
