package kvevents

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// This file is the part of ZMTP 3.0 (ZeroMQ's wire protocol, RFC 23/ZMTP)
// that a publishing PUB socket and a replying ROUTER socket need: the
// greeting, the handshake (NULL security, or CURVE: curve.go), and frames.
// Everything here reads with a limit on what a peer can make it allocate.

const (
	greetingLen = 64
	// flag bits of a frame header.
	flagMore    = 0x01
	flagLong    = 0x02
	flagCommand = 0x04
	// maxCommand bounds a command frame (READY, SUBSCRIBE, PING, the
	// CURVE handshake's) from a peer: a few properties.
	maxCommand = 4 << 10
	// maxFrames bounds the frames of a message from a peer: a
	// subscription is one, a replay request two. Empty frames cost
	// nothing against a message's byte limit, so without it a message
	// that never ends would grow without bound.
	maxFrames = 16
)

// greetingFor is the greeting of a side: signature, version 3.0, the
// mechanism, and as-server (set by a CURVE server). Version 3.0 (not 3.1)
// makes libzmq peers send subscriptions as messages (0x01 + topic);
// SUBSCRIBE commands are accepted too.
func greetingFor(mechanism string, asServer bool) [greetingLen]byte {
	var g [greetingLen]byte
	g[0], g[9] = 0xff, 0x7f
	g[10], g[11] = 3, 0
	copy(g[12:32], mechanism)
	if asServer {
		g[32] = 1
	}
	return g
}

// zconn is one ZMTP connection after the handshake.
type zconn struct {
	c        net.Conn
	r        *bufio.Reader
	peerType string
	// timeout bounds each command's write (0: none). A PONG may follow a
	// long quiet spell, long after the deadline of the last write of the
	// connection's other writer, so it sets one of its own; it may thereby
	// extend that writer's by less than timeout, once, as it then waits
	// for that write to end before its own.
	timeout time.Duration
	// curve is the CURVE session once its handshake is done: every frame
	// after it travels in a MESSAGE command. Nil for NULL security.
	curve *curveSession
}

// handshake runs the greeting and the handshake (NULL, or CURVE as the
// server if curve is set) as the side that announces sockType, and
// accepts only peers whose Socket-Type is one of peers. A peer whose
// mechanism differs from ours, or that fails CURVE's authentication,
// gets an error that wraps ErrAuth.
func handshake(c net.Conn, sockType string, peers []string, timeout time.Duration, curve *curveServer) (*zconn, error) {
	if timeout > 0 {
		c.SetDeadline(time.Now().Add(timeout))
		defer c.SetDeadline(time.Time{})
	}
	z := &zconn{c: c, r: bufio.NewReaderSize(c, 4096), timeout: timeout}
	mech := "NULL"
	if curve != nil {
		mech = "CURVE"
	}
	ours := greetingFor(mech, curve != nil)
	if _, err := c.Write(ours[:]); err != nil {
		return nil, fmt.Errorf("%w: sending the greeting: %w", ErrPeer, err)
	}
	var g [greetingLen]byte
	if _, err := io.ReadFull(z.r, g[:]); err != nil {
		return nil, fmt.Errorf("%w: reading the greeting: %w", ErrPeer, err)
	}
	if g[0] != 0xff || g[9] != 0x7f {
		return nil, fmt.Errorf("%w: not a ZMTP greeting (signature % x)", ErrPeer, g[:10])
	}
	if g[10] < 3 {
		return nil, fmt.Errorf("%w: ZMTP version %d.%d, need 3.x", ErrPeer, g[10], g[11])
	}
	if theirs := string(bytes.TrimRight(g[12:32], "\x00")); theirs != mech {
		return nil, fmt.Errorf("%w: %w: security mechanism %q, this socket serves %s", ErrPeer, ErrAuth, theirs, mech)
	}
	ready := props("Socket-Type", sockType)
	var meta map[string]string
	if curve != nil {
		if g[32] != 0 {
			return nil, fmt.Errorf("%w: %w: a CURVE peer that claims to be the server", ErrPeer, ErrAuth)
		}
		m, sess, err := curve.handshake(z)
		if err != nil {
			return nil, err
		}
		if err := z.writeCommand("READY", sess.sealReady(ready)); err != nil {
			return nil, err
		}
		meta, z.curve = m, sess
	} else {
		if err := z.writeCommand("READY", ready); err != nil {
			return nil, err
		}
		body, err := z.readCommand("READY")
		if err != nil {
			return nil, err
		}
		if meta, err = parseProps(body[1+len("READY"):]); err != nil {
			return nil, err
		}
	}
	z.peerType = meta["socket-type"]
	for _, p := range peers {
		if z.peerType == p {
			return z, nil
		}
	}
	return nil, fmt.Errorf("%w: a %s socket cannot talk to a %q peer (want %v)", ErrPeer, sockType, z.peerType, peers)
}

// readCommand reads the next frame of the handshake, which must be the
// command name, and returns it whole (name included).
func (z *zconn) readCommand(name string) ([]byte, error) {
	frame, more, cmd, err := z.readFrame(maxCommand)
	if err != nil && !errors.Is(err, ErrPeer) {
		err = fmt.Errorf("%w: reading %s: %w", ErrPeer, name, err)
	}
	if err != nil {
		return nil, err
	}
	if !cmd || more {
		return nil, fmt.Errorf("%w: expected a %s command", ErrPeer, name)
	}
	got, _, err := parseCommand(frame)
	if err != nil {
		return nil, err
	}
	if got != name {
		return nil, fmt.Errorf("%w: expected %s, got command %q", ErrPeer, name, got)
	}
	return frame, nil
}

// props encodes ZMTP metadata: name length (1 byte), name, value length
// (4 bytes, big-endian), value.
func props(kv ...string) []byte {
	var b []byte
	for i := 0; i+1 < len(kv); i += 2 {
		b = append(b, byte(len(kv[i])))
		b = append(b, kv[i]...)
		b = binary.BigEndian.AppendUint32(b, uint32(len(kv[i+1])))
		b = append(b, kv[i+1]...)
	}
	return b
}

// parseProps decodes ZMTP metadata; names are case-insensitive, so they
// come back in lower case.
func parseProps(b []byte) (map[string]string, error) {
	m := map[string]string{}
	for len(b) > 0 {
		n := int(b[0])
		if len(b) < 1+n+4 {
			return nil, fmt.Errorf("%w: truncated metadata", ErrPeer)
		}
		name := string(bytes.ToLower(b[1 : 1+n]))
		v := int(binary.BigEndian.Uint32(b[1+n:]))
		b = b[1+n+4:]
		if v > len(b) {
			return nil, fmt.Errorf("%w: metadata value of %d bytes, %d left", ErrPeer, v, len(b))
		}
		m[name] = string(b[:v])
		b = b[v:]
	}
	return m, nil
}

// parseCommand splits a command frame into its name and body.
func parseCommand(frame []byte) (string, []byte, error) {
	if len(frame) < 1 || len(frame) < 1+int(frame[0]) {
		return "", nil, fmt.Errorf("%w: truncated command", ErrPeer)
	}
	n := int(frame[0])
	return string(frame[1 : 1+n]), frame[1+n:], nil
}

func (z *zconn) writeCommand(name string, body []byte) error {
	frame := append([]byte{byte(len(name))}, name...)
	frame = append(frame, body...)
	var b []byte
	if z.curve != nil {
		z.curve.mu.Lock()
		defer z.curve.mu.Unlock()
		b = z.curve.sealLocked(nil, msgFlagCommand, frame)
	} else {
		b = append(appendHeader(nil, len(frame), flagCommand), frame...)
	}
	if z.timeout > 0 {
		z.c.SetWriteDeadline(time.Now().Add(z.timeout))
	}
	if _, err := z.c.Write(b); err != nil {
		return fmt.Errorf("%w: sending %s: %w", ErrPeer, name, err)
	}
	return nil
}

// writeMessage writes one message of frames, encrypted under CURVE, with
// the deadline already set.
func (z *zconn) writeMessage(frames ...[]byte) error {
	var b []byte
	if z.curve != nil {
		z.curve.mu.Lock()
		defer z.curve.mu.Unlock()
		for i, f := range frames {
			var flags byte
			if i < len(frames)-1 {
				flags = msgFlagMore
			}
			b = z.curve.sealLocked(b, flags, f)
		}
	} else {
		b = appendMessage(nil, frames...)
	}
	_, err := z.c.Write(b)
	return err
}

// appendHeader appends a frame header: flags and a 1-byte or 8-byte size.
func appendHeader(dst []byte, size int, flags byte) []byte {
	if size > 255 {
		dst = append(dst, flags|flagLong)
		return binary.BigEndian.AppendUint64(dst, uint64(size))
	}
	return append(dst, flags, byte(size))
}

// readFrame reads one frame of at most limit bytes.
func (z *zconn) readFrame(limit int) (body []byte, more, command bool, err error) {
	flags, err := z.r.ReadByte()
	if err != nil {
		return nil, false, false, err
	}
	var size uint64
	if flags&flagLong != 0 {
		var b [8]byte
		if _, err := io.ReadFull(z.r, b[:]); err != nil {
			return nil, false, false, err
		}
		size = binary.BigEndian.Uint64(b[:])
	} else {
		b, err := z.r.ReadByte()
		if err != nil {
			return nil, false, false, err
		}
		size = uint64(b)
	}
	command = flags&flagCommand != 0
	raw := limit
	switch {
	case z.curve != nil: // a MESSAGE command around a frame of up to limit
		raw = max(limit, maxCommand) + messageOverhead
	case command:
		raw = min(limit, maxCommand)
	}
	if size > uint64(raw) {
		return nil, false, false, fmt.Errorf("%w: %w: frame of %d bytes, at most %d accepted", ErrPeer, ErrTooLarge, size, raw)
	}
	body = make([]byte, size)
	if _, err := io.ReadFull(z.r, body); err != nil {
		return nil, false, false, err
	}
	if z.curve == nil {
		return body, flags&flagMore != 0 && !command, command, nil
	}
	data, inner, err := z.curve.open(body)
	if err != nil {
		return nil, false, false, err
	}
	command = inner&msgFlagCommand != 0
	if command {
		limit = min(limit, maxCommand)
	}
	if len(data) > limit {
		return nil, false, false, fmt.Errorf("%w: %w: frame of %d bytes, at most %d accepted", ErrPeer, ErrTooLarge, len(data), limit)
	}
	return data, inner&msgFlagMore != 0 && !command, command, nil
}

// readMessage reads one message (its frames) of at most limit bytes and
// maxFrames frames in all, answering PING and skipping other commands. A
// SUBSCRIBE or CANCEL command (ZMTP 3.1) comes back as the equivalent 3.0
// message.
func (z *zconn) readMessage(limit int) ([][]byte, error) {
	var msg [][]byte
	for {
		frame, more, cmd, err := z.readFrame(limit)
		if err != nil {
			return nil, err
		}
		if cmd {
			name, body, err := parseCommand(frame)
			if err != nil {
				return nil, err
			}
			switch name {
			case "SUBSCRIBE":
				return [][]byte{append([]byte{1}, body...)}, nil
			case "CANCEL":
				return [][]byte{append([]byte{0}, body...)}, nil
			case "PING":
				// TTL (2 bytes) then a context the PONG echoes.
				if len(body) >= 2 {
					if err := z.writeCommand("PONG", body[2:]); err != nil {
						return nil, err
					}
				}
			}
			continue
		}
		limit = max(0, limit-len(frame))
		msg = append(msg, frame)
		if !more {
			return msg, nil
		}
		if len(msg) == maxFrames {
			return nil, fmt.Errorf("%w: a message of more than %d frames", ErrPeer, maxFrames)
		}
	}
}

// appendMessage appends msg's frames, with headers, to dst.
func appendMessage(dst []byte, msg ...[]byte) []byte {
	for i, f := range msg {
		var flags byte
		if i < len(msg)-1 {
			flags = flagMore
		}
		dst = appendHeader(dst, len(f), flags)
		dst = append(dst, f...)
	}
	return dst
}
