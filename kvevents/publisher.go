package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvfence/kvfence/kvcache"
)

// Config configures a Publisher. The zero value of every field but
// Endpoint is usable.
type Config struct {
	// Endpoint is where the PUB socket listens: "tcp://HOST:PORT"
	// ("tcp://*:5557" for every interface, port 0 for any free one; see
	// Publisher.Addr) or "ipc:///path/to/socket" (a socket file there
	// that nobody listens on is replaced; any other file, or a live
	// publisher's socket, is left as it is and refused with ErrListen).
	// Subscribers connect to it. Required.
	Endpoint string
	// ReplayEndpoint, if set, is where the ROUTER socket for replay
	// requests listens, in the same forms.
	ReplayEndpoint string
	// Topic is the first frame of every message, which SUB sockets
	// filter on; "" (vLLM's default) matches every subscription. llm-d
	// expects "kv@POD@MODEL".
	Topic string
	// DataParallelRank is the third element of every batch.
	DataParallelRank int
	// Encoding of the events inside a batch; the zero value is
	// ArrayEvents.
	Encoding Encoding
	// FullHashes sends each block hash as the whole 32-byte key (a msgpack
	// bin) rather than the 64-bit integer BlockHash. It breaks every
	// consumer that types hashes as integers (vLLM's example subscriber,
	// list[int]); vLLM's own schema (bytes | int) and llm-d read it. Off
	// by default; see the package doc.
	FullHashes bool
	// Medium is the medium of events of pages on the pool's device; ""
	// means "GPU". HostMedium is that of pages in its host tier
	// (kvcache.HostTierConfig); "" means "CPU", as vLLM's offloading
	// connector names host memory.
	Medium     string
	HostMedium string
	// MaxBatchEvents bounds the pool events in one batch; 0 means 256. A
	// batch holds what the pool emitted since the last one, up to this.
	MaxBatchEvents int
	// BatchWindow is how long the publisher lets events gather after it
	// has published a batch that was not full, before it reads the next:
	// under load, the events of a window go out as one message (one
	// encoding pass, one write per subscriber), and the pool's sends find
	// the publisher asleep on a timer rather than parked on the channel,
	// so that they wake no goroutine. An event after a quiet window is
	// published at once. 0 means 1 ms; negative means no window (a batch
	// for each wake-up, which under load is nearly one per event). The
	// pool's Prefix.EventBuffer must hold the events of one window at the
	// peak rate, or the excess is dropped (and resynchronised).
	BatchWindow time.Duration
	// BufferSteps is how many of the latest batches the replay socket can
	// send again; 0 means 10,000 (vLLM's default). BufferBytes bounds
	// their payloads in all; 0 means 64 MiB. The oldest go first.
	BufferSteps int
	BufferBytes int
	// SubscriberQueue is how many batches wait for one subscriber before
	// the next is dropped for it (and only for it); 0 means 1,024.
	SubscriberQueue int
	// WriteTimeout disconnects a subscriber or replay client that has
	// accepted no bytes for this long; 0 means 10 s. Close gives the
	// subscribers one WriteTimeout in all to take what is queued for them.
	WriteTimeout time.Duration
	// IdleTimeout disconnects a peer that holds a connection for nothing:
	// a subscriber none of whose subscriptions has matched Topic for this
	// long (it never subscribed, or subscribed to other topics only, or
	// cancelled what matched), and a replay client that has sent no
	// request for this long since it connected or was last answered.
	// ZMTP gives a PUB socket no way to tell a subscriber that wants the
	// topic but has gone quiet from one that is merely waiting for events,
	// so that one stays (WriteTimeout cuts it off once it stops reading
	// what it is sent). libzmq peers reconnect by themselves and send their
	// subscriptions again. 0 means 5 minutes; negative means never.
	IdleTimeout time.Duration
	// MaxPeers bounds connected subscribers and replay clients, each,
	// a connection counting from its accept (its handshake included);
	// 0 means 64. Further connections are closed at once.
	MaxPeers int
	// Curve, if set, secures both sockets with ZMTP CURVE (RFC 26):
	// subscribers and replay clients must know the publisher's public key
	// (and, with Curve.Clients, hold a key let in), and everything after
	// the handshake, every batch and every replay, is encrypted and
	// authenticated per connection. libzmq's clients (pyzmq, llm-d's
	// subscriber) speak it given ZMQ_CURVE_SERVERKEY and a key pair of
	// their own. Nil means NULL security: anyone who reaches the endpoint
	// reads the stream. See the package doc's Trust boundary.
	Curve *CurveConfig
	// Logger gets one record per loss of pool events (and the
	// resynchronisation it causes), per subscriber cut off and per
	// refused peer. Nil logs nothing.
	Logger *slog.Logger
}

const (
	defaultBatchEvents = 256
	defaultBatchWindow = time.Millisecond
	defaultSteps       = 10_000
	defaultBufferBytes = 64 << 20
	defaultQueue       = 1024
	defaultTimeout     = 10 * time.Second
	defaultIdle        = 5 * time.Minute
	defaultPeers       = 64
	// maxSubscription bounds a subscription message (0x01 + topic), and
	// maxSubscriptions the subscriptions one subscriber holds at once
	// (ZMQ counts them, repeats included): every batch is matched against
	// each under the publisher's lock.
	maxSubscription  = 1 << 10
	maxSubscriptions = 256
	// maxReplayRequest bounds a replay request (an empty delimiter and an
	// 8-byte sequence number, with room to spare).
	maxReplayRequest = 64
	// endSeq marks the end of a replay: -1 as a signed 8-byte integer.
	endSeq = ^uint64(0)
)

// Stats are a publisher's running totals.
type Stats struct {
	Batches uint64 // batches published: the next sequence number
	Events  uint64 // pool events in them
	// Lost counts pool events the publisher never saw (the pool's event
	// channel was full: kvcache.PrefixStats.EventsDropped counts the same
	// from the pool's side); each loss made the publisher send an
	// AllBlocksCleared, counted in Resyncs, so that routers drop a mirror
	// that no longer matches.
	Lost    uint64
	Resyncs uint64
	// Subscribers is how many subscribers are connected now.
	Subscribers int
	// SubscriberDrops counts batches not queued for a subscriber because
	// its queue was full: it sees a gap in the sequence numbers, which
	// replay fills while the batches are still buffered.
	SubscriberDrops uint64
	// Disconnects counts subscribers and replay clients cut off (write
	// timeout, protocol error, handshake timeout, IdleTimeout, over
	// MaxPeers). Among them: AuthFailures, peers refused by the security
	// handshake or a message that did not authenticate (ErrAuth: a
	// wrong CURVE server key, a client key not let in, a NULL peer at a
	// CURVE socket); HandshakeTimeouts, peers that did not complete their
	// handshake within WriteTimeout; OversizedFrames, peers that sent a
	// frame over its limit (ErrTooLarge).
	Disconnects       uint64
	AuthFailures      uint64
	HandshakeTimeouts uint64
	OversizedFrames   uint64
	// Replays counts replay requests served, ReplayedBatches the batches
	// they sent, BadRequests the malformed ones ignored, OutOfRange those
	// refused for a start outside the buffer (answered with the end
	// marker alone: see serveReplay).
	Replays         uint64
	ReplayedBatches uint64
	BadRequests     uint64
	OutOfRange      uint64
}

// Publisher sends a pool's prefix-cache events to KV-aware routers in
// vLLM's wire format. See the package doc.
type Publisher struct {
	cfg    Config
	pool   *kvcache.Pool // its event keys go back to it once encoded
	events <-chan kvcache.KVEvent
	enc    *encoder
	curve  *curveServer // nil for NULL security
	log    *slog.Logger

	pub, replay net.Listener
	stop        chan struct{} // closed by Close
	// flushBy is the deadline of every write once Close has begun: one
	// WriteTimeout from its start, for all of them together. Close sets it
	// before it closes stop, and it is read only after stop is seen closed.
	flushBy   time.Time
	drained   chan struct{} // closed when run has published everything
	wg        sync.WaitGroup
	closeOnce sync.Once

	ring ring // batches for replay

	mu struct {
		sync.Mutex
		subs map[*subscriber]struct{}
		// subscribers and clients count connections, from their accept
		// (their handshake included) to their end, each up to MaxPeers.
		subscribers, clients int
		closed               bool
	}

	batches, events64, lost, resyncs atomic.Uint64
	drops, disconnects               atomic.Uint64
	replays, replayed, badRequests   atomic.Uint64
	authFailures, handshakeTimeouts  atomic.Uint64
	oversized, outOfRange            atomic.Uint64
}

// New starts publishing pool's events (Config.Prefix.EventBuffer must be
// set) on cfg.Endpoint, and serving replays on cfg.ReplayEndpoint. It reads
// pool.Events() until the pool closes it, and never makes the pool wait.
func New(pool *kvcache.Pool, cfg Config) (*Publisher, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: nil pool", ErrInvalidConfig)
	}
	events := pool.Events()
	if events == nil {
		return nil, fmt.Errorf("%w: the pool emits no events (set Config.Prefix.EventBuffer)", ErrInvalidConfig)
	}
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	p := &Publisher{
		cfg:     cfg,
		pool:    pool,
		events:  events,
		enc:     newEncoder(cfg.Encoding, cfg.FullHashes, cfg.Medium, cfg.HostMedium, pool.TokensPerPage(), cfg.DataParallelRank),
		curve:   newCurveServer(cfg.Curve),
		log:     cfg.Logger,
		stop:    make(chan struct{}),
		drained: make(chan struct{}),
		ring:    ring{maxSteps: cfg.BufferSteps, maxBytes: cfg.BufferBytes},
	}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	p.mu.subs = make(map[*subscriber]struct{})
	var err error
	if p.pub, err = listen(cfg.Endpoint); err != nil {
		return nil, err
	}
	if cfg.ReplayEndpoint != "" {
		if p.replay, err = listen(cfg.ReplayEndpoint); err != nil {
			p.pub.Close()
			return nil, err
		}
	}
	p.wg.Add(2)
	go p.run()
	go p.accept(p.pub, p.serveSubscriber)
	if p.replay != nil {
		p.wg.Add(1)
		go p.accept(p.replay, p.serveReplay)
	}
	return p, nil
}

func (c *Config) fill() error {
	switch {
	case c.Endpoint == "":
		return fmt.Errorf("%w: no Endpoint", ErrInvalidConfig)
	case c.Encoding != ArrayEvents && c.Encoding != MapEvents:
		return fmt.Errorf("%w: Encoding %v", ErrInvalidConfig, c.Encoding)
	case c.Curve != nil && c.Curve.validate() != nil:
		return c.Curve.validate()
	case c.MaxBatchEvents < 0 || c.BufferSteps < 0 || c.BufferBytes < 0 || c.SubscriberQueue < 0 ||
		c.WriteTimeout < 0 || c.MaxPeers < 0:
		return fmt.Errorf("%w: negative size or timeout", ErrInvalidConfig)
	}
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.MaxBatchEvents, defaultBatchEvents)
	def(&c.BufferSteps, defaultSteps)
	def(&c.BufferBytes, defaultBufferBytes)
	def(&c.SubscriberQueue, defaultQueue)
	def(&c.MaxPeers, defaultPeers)
	if c.WriteTimeout == 0 {
		c.WriteTimeout = defaultTimeout
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = defaultIdle
	}
	if c.BatchWindow == 0 {
		c.BatchWindow = defaultBatchWindow
	}
	if c.Medium == "" {
		c.Medium = "GPU"
	}
	if c.HostMedium == "" {
		c.HostMedium = "CPU"
	}
	return nil
}

// listen binds a ZMQ-style endpoint.
func listen(endpoint string) (net.Listener, error) {
	var network, addr string
	switch {
	case strings.HasPrefix(endpoint, "tcp://"):
		network, addr = "tcp", strings.TrimPrefix(endpoint, "tcp://")
		if strings.HasPrefix(addr, "*:") {
			addr = addr[1:]
		}
	case strings.HasPrefix(endpoint, "ipc://"):
		network, addr = "unix", strings.TrimPrefix(endpoint, "ipc://")
		removeStaleSocket(addr)
	default:
		return nil, fmt.Errorf("%w: endpoint %q: want tcp://HOST:PORT or ipc://PATH", ErrInvalidConfig, endpoint)
	}
	l, err := net.Listen(network, addr)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrListen, endpoint, err)
	}
	return l, nil
}

// removeStaleSocket removes path if it is a Unix socket that nobody
// listens on: the file a publisher that died left behind. Anything else
// stays, so that Listen refuses it by name: a regular file that a
// mistyped endpoint names (libzmq would delete it), or the socket of a
// publisher still running, which would go on listening on a name that no
// longer reaches it.
func removeStaleSocket(path string) {
	if fi, err := os.Lstat(path); err != nil || fi.Mode()&os.ModeSocket == 0 {
		return
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return
	}
	if errors.Is(err, syscall.ECONNREFUSED) {
		os.Remove(path)
	}
}

// Addr is the address the PUB socket listens on.
func (p *Publisher) Addr() net.Addr { return p.pub.Addr() }

// ReplayAddr is the address of the replay socket, nil without one.
func (p *Publisher) ReplayAddr() net.Addr {
	if p.replay == nil {
		return nil
	}
	return p.replay.Addr()
}

// Drained is closed once the pool has closed its event channel and every
// event in it has been published.
func (p *Publisher) Drained() <-chan struct{} { return p.drained }

// Stats returns running totals.
func (p *Publisher) Stats() Stats {
	p.mu.Lock()
	n := len(p.mu.subs)
	p.mu.Unlock()
	return Stats{
		Batches: p.batches.Load(), Events: p.events64.Load(), Lost: p.lost.Load(), Resyncs: p.resyncs.Load(),
		Subscribers: n, SubscriberDrops: p.drops.Load(), Disconnects: p.disconnects.Load(),
		AuthFailures: p.authFailures.Load(), HandshakeTimeouts: p.handshakeTimeouts.Load(), OversizedFrames: p.oversized.Load(),
		Replays: p.replays.Load(), ReplayedBatches: p.replayed.Load(), BadRequests: p.badRequests.Load(),
		OutOfRange: p.outOfRange.Load(),
	}
}

// Close stops reading the pool's events, sends every subscriber what is
// queued for it, all of them at once and within one WriteTimeout from the
// start of Close (a subscriber that has not taken its queue by then is cut
// off), and closes the sockets. Events still in the pool's channel are not
// published. A second Close returns ErrClosed.
func (p *Publisher) Close() error {
	err := ErrClosed
	p.closeOnce.Do(func() {
		err = nil
		p.flushBy = time.Now().Add(p.cfg.WriteTimeout)
		close(p.stop)
		p.pub.Close()
		if p.replay != nil {
			p.replay.Close()
		}
		p.mu.Lock()
		p.mu.closed = true
		subs := make([]*subscriber, 0, len(p.mu.subs))
		for s := range p.mu.subs {
			subs = append(subs, s)
		}
		p.mu.Unlock()
		for _, s := range subs {
			s.finish()
		}
		p.wg.Wait()
	})
	return err
}

// run reads the pool's events and publishes them in batches: what has
// arrived when it wakes, up to MaxBatchEvents; after a batch that was not
// full it sleeps for the BatchWindow (see Config) while the next gathers.
func (p *Publisher) run() {
	defer p.wg.Done()
	var (
		batch  []kvcache.KVEvent
		last   uint64 // the pool's Seq of the last event read
		window *time.Timer
	)
	if p.cfg.BatchWindow > 0 {
		window = time.NewTimer(p.cfg.BatchWindow)
		window.Stop()
	}
	for {
		var ev kvcache.KVEvent
		var ok bool
		select {
		case ev, ok = <-p.events:
		case <-p.stop:
			return
		}
		if !ok {
			close(p.drained)
			return
		}
		batch = batch[:0]
		for {
			// The pool numbers every event from 1, dropped ones included.
			if ev.Seq > last+1 {
				batch = p.resync(batch, ev.Seq-last-1, last, ev.Seq)
			}
			last = ev.Seq
			batch = append(batch, ev)
			if len(batch) >= p.cfg.MaxBatchEvents {
				break
			}
			select {
			case ev, ok = <-p.events:
			default:
				ok = false
			}
			if !ok {
				break
			}
		}
		p.publish(batch)
		full := len(batch) >= p.cfg.MaxBatchEvents
		for _, ev := range batch { // encoded: the pool may reuse their arrays
			p.pool.ReturnEventKeys(ev.Keys)
			p.pool.ReturnEventTokens(ev.TokenIDs)
		}
		clear(batch) // the keys are the pool's again, not ours
		if window != nil && !full {
			window.Reset(p.cfg.BatchWindow)
			select {
			case <-window.C:
			case <-p.stop:
				return
			}
		}
	}
}

// resync notes that the pool dropped events and puts an AllBlocksCleared
// in the batch before the next event: a router must not keep a mirror
// that is missing stores or removals.
func (p *Publisher) resync(batch []kvcache.KVEvent, lost, last, next uint64) []kvcache.KVEvent {
	p.lost.Add(lost)
	p.resyncs.Add(1)
	p.log.LogAttrs(context.Background(), slog.LevelWarn,
		"kvevents: the pool dropped events before they were published; sending AllBlocksCleared so that routers rebuild their view",
		slog.Uint64("lost_events", lost), slog.Uint64("after_pool_seq", last), slog.Uint64("next_pool_seq", next))
	return append(batch, kvcache.KVEvent{}) // Kind 0: AllBlocksCleared
}

// publish encodes a batch, numbers it, keeps it for replay and queues it
// for every subscriber of the topic.
func (p *Publisher) publish(batch []kvcache.KVEvent) {
	seq := p.batches.Load()
	// One allocation per batch: the message as sent, [topic, seq,
	// payload], whose last frame is the payload the replay buffer keeps.
	// The payload is encoded in place, after room for a long frame header
	// (its size is known only then); a short one is 7 bytes less, so the
	// frames before it move up by 7.
	topic := p.cfg.Topic
	const long = 9 // a long frame header: flags, 8-byte size
	wire := make([]byte, 0, long+len(topic)+2+8+long+p.enc.batchBound(batch))
	wire = appendHeader(wire, len(topic), flagMore)
	wire = append(wire, topic...)
	wire = appendHeader(wire, 8, flagMore)
	wire = binary.BigEndian.AppendUint64(wire, seq)
	front := len(wire)
	wire = p.enc.batch(wire[:front+long], time.Now(), batch)
	payload := wire[front+long:]
	if hdr := appendHeader(nil, len(payload), 0); len(hdr) == long {
		copy(wire[front:], hdr)
	} else {
		copy(wire[front+long-len(hdr):], hdr)
		copy(wire[long-len(hdr):], wire[:front])
		wire = wire[long-len(hdr):]
	}
	p.ring.add(seq, payload)
	n := uint64(0)
	for _, ev := range batch {
		if ev.Kind != 0 {
			n++
		}
	}
	p.events64.Add(n)
	p.batches.Add(1)
	p.mu.Lock()
	for s := range p.mu.subs {
		if !s.wants(topic) {
			continue
		}
		select {
		case s.queue <- wire:
		default:
			s.dropped.Add(1)
			p.drops.Add(1)
		}
	}
	p.mu.Unlock()
}

// accept hands every connection on l to serve, in its own goroutine.
func (p *Publisher) accept(l net.Listener, serve func(net.Conn)) {
	defer p.wg.Done()
	for {
		c, err := l.Accept()
		if err != nil {
			select {
			case <-p.stop:
				return
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // e.g. out of file descriptors
			continue
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			serve(c)
		}()
	}
}

// admit takes one of the MaxPeers connections that *n counts, unless
// they are taken or the publisher is closing.
func (p *Publisher) admit(n *int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.closed || *n >= p.cfg.MaxPeers {
		return false
	}
	*n++
	return true
}

// leave gives back a connection admit took.
func (p *Publisher) leave(n *int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	*n--
}

// handshake runs the ZMTP handshake on c as sockType, cut short (c
// closed, ErrClosed) if the publisher closes meanwhile: Close does not
// wait for a peer that says nothing to reach WriteTimeout.
func (p *Publisher) handshake(c net.Conn, sockType string, peers []string) (*zconn, error) {
	done, watched := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(watched)
		select {
		case <-p.stop:
			c.Close()
		case <-done:
		}
	}()
	z, err := handshake(c, sockType, peers, p.cfg.WriteTimeout, p.curve)
	close(done)
	<-watched
	select {
	case <-p.stop:
		if err != nil {
			return nil, fmt.Errorf("%w: handshake cut short: %w", ErrClosed, err)
		}
	default:
	}
	return z, err
}

// refusePeer closes a connection that will not be served and counts it.
func (p *Publisher) refusePeer(c net.Conn, why string, err error) {
	c.Close()
	p.countRefusal(err, why == "handshake")
	p.log.LogAttrs(context.Background(), slog.LevelWarn, "kvevents: peer refused",
		slog.String("remote", c.RemoteAddr().String()), slog.String("why", why), slog.Any("error", err))
}

// countRefusal counts a peer cut off for err, by kind.
func (p *Publisher) countRefusal(err error, handshaking bool) {
	p.disconnects.Add(1)
	switch {
	case errors.Is(err, ErrAuth):
		p.authFailures.Add(1)
	case errors.Is(err, ErrTooLarge):
		p.oversized.Add(1)
	case handshaking && errors.Is(err, os.ErrDeadlineExceeded):
		p.handshakeTimeouts.Add(1)
	}
}

// subscriber is one connected SUB socket.
type subscriber struct {
	z       *zconn
	queue   chan []byte // encoded messages, shared by all subscribers
	dropped atomic.Uint64
	done    chan struct{} // closed by finish: send what is queued, then stop
	once    sync.Once

	mu     sync.Mutex
	topics []string // subscribed prefixes

	sealed []byte // under CURVE, the writer's buffer of encrypted messages
}

func (s *subscriber) wants(topic string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, t := range s.topics {
		if strings.HasPrefix(topic, t) {
			return true
		}
	}
	return false
}

// subscribe adds a subscription (on) or cancels one; a subscriber over
// maxSubscriptions is an error.
func (s *subscriber) subscribe(on bool, topic string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if on {
		if len(s.topics) == maxSubscriptions {
			return fmt.Errorf("%w: more than %d subscriptions", ErrPeer, maxSubscriptions)
		}
		s.topics = append(s.topics, topic)
		return nil
	}
	for i, t := range s.topics { // ZMQ counts subscriptions: cancel one
		if t == topic {
			s.topics = append(s.topics[:i], s.topics[i+1:]...)
			return nil
		}
	}
	return nil
}

func (s *subscriber) finish() { s.once.Do(func() { close(s.done) }) }

func (p *Publisher) serveSubscriber(c net.Conn) {
	if !p.admit(&p.mu.subscribers) {
		p.refusePeer(c, "too many subscribers, or closing", nil)
		return
	}
	defer p.leave(&p.mu.subscribers)
	z, err := p.handshake(c, "PUB", []string{"SUB", "XSUB"})
	if errors.Is(err, ErrClosed) {
		c.Close()
		return
	}
	if err != nil {
		p.refusePeer(c, "handshake", err)
		return
	}
	s := &subscriber{z: z, queue: make(chan []byte, p.cfg.SubscriberQueue), done: make(chan struct{})}
	p.mu.Lock()
	if p.mu.closed {
		p.mu.Unlock()
		p.refusePeer(c, "closing", nil)
		return
	}
	p.mu.subs[s] = struct{}{}
	p.mu.Unlock()

	readerDone := make(chan struct{})
	var readErr error // the reader's, once readerDone is closed
	go func() {
		// Subscriptions come from the subscriber; anything else it sends
		// is ignored. A read error (it went away, or broke the protocol)
		// ends the subscriber, and so does the read deadline that runs
		// while it wants nothing the publisher sends: IdleTimeout from
		// when it last did (or connected), whatever else it sends
		// meanwhile, PINGs included.
		defer close(readerDone)
		idle := false
		for {
			if p.cfg.IdleTimeout > 0 {
				switch wants := s.wants(p.cfg.Topic); {
				case wants && idle:
					idle = false
					c.SetReadDeadline(time.Time{})
				case !wants && !idle:
					idle = true
					c.SetReadDeadline(time.Now().Add(p.cfg.IdleTimeout))
				}
			}
			msg, err := z.readMessage(maxSubscription)
			if idle && errors.Is(err, os.ErrDeadlineExceeded) {
				err = fmt.Errorf("%w: idle: no subscription matching topic %q for %v", ErrPeer, p.cfg.Topic, p.cfg.IdleTimeout)
			}
			if err == nil && len(msg) == 1 && len(msg[0]) > 0 && msg[0][0] <= 1 {
				err = s.subscribe(msg[0][0] == 1, string(msg[0][1:]))
			}
			if err != nil {
				readErr = err
				s.finish()
				return
			}
		}
	}()
	err = p.write(s)
	p.mu.Lock()
	delete(p.mu.subs, s)
	p.mu.Unlock()
	c.Close()
	<-readerDone
	if err == nil && errors.Is(readErr, ErrPeer) {
		err = readErr // a protocol error, not a subscriber that went away
	}
	if err != nil {
		p.countRefusal(err, false)
		p.log.LogAttrs(context.Background(), slog.LevelWarn, "kvevents: subscriber cut off",
			slog.String("remote", c.RemoteAddr().String()), slog.Uint64("batches_dropped_for_it", s.dropped.Load()), slog.Any("error", err))
	}
}

// maxWriteMessages bounds the queued messages one write sends.
const maxWriteMessages = 64

// write sends s its queue until finish, then what is left in it. The
// messages queued when the writer wakes go out in one system call (a
// vectored write, at most maxWriteMessages): a subscriber that lags
// behind costs a write per burst, not per message.
func (p *Publisher) write(s *subscriber) error {
	msgs := make([][]byte, 0, maxWriteMessages)
	send := func(wire []byte) error {
		msgs = append(msgs[:0], wire)
	gather:
		for len(msgs) < maxWriteMessages {
			select {
			case wire := <-s.queue:
				msgs = append(msgs, wire)
			default:
				break gather
			}
		}
		deadline := time.Now().Add(p.cfg.WriteTimeout)
		select {
		case <-p.stop:
			// A fresh WriteTimeout per write would let a subscriber that
			// reads just fast enough hold Close for one per write of its
			// queue (SubscriberQueue/maxWriteMessages of them).
			deadline = p.flushBy
		default:
		}
		var err error
		if s.z.curve != nil {
			err = s.writeSealed(msgs, deadline)
		} else {
			s.z.c.SetWriteDeadline(deadline)
			bufs := net.Buffers(msgs) // WriteTo consumes bufs, not the messages
			_, err = bufs.WriteTo(s.z.c)
		}
		clear(msgs) // the messages are the replay buffer's, not the writer's
		if err != nil {
			return fmt.Errorf("%w: %w", ErrPeer, err)
		}
		return nil
	}
	for {
		select {
		case wire := <-s.queue:
			if err := send(wire); err != nil {
				return err
			}
		case <-s.done:
			select {
			case <-p.stop: // closing: flush what is queued
			default:
				return nil // the subscriber went away
			}
			for {
				select {
				case wire := <-s.queue:
					if err := send(wire); err != nil {
						return err
					}
				default:
					return nil
				}
			}
		}
	}
}

// maxSealedBuffer bounds the encryption buffer a subscriber's writer
// keeps between writes.
const maxSealedBuffer = 4 << 20

// writeSealed writes msgs (each a message as queued: ZMTP frames) under
// CURVE: every frame in a MESSAGE command of its own, encrypted, all of
// them in one write.
func (s *subscriber) writeSealed(msgs [][]byte, deadline time.Time) error {
	sess := s.z.curve
	sess.mu.Lock()
	defer sess.mu.Unlock()
	b := s.sealed[:0]
	for _, wire := range msgs {
		for len(wire) > 0 {
			flags, size, hdr := wire[0], 0, 2
			if flags&flagLong != 0 {
				size, hdr = int(binary.BigEndian.Uint64(wire[1:9])), 9
			} else {
				size = int(wire[1])
			}
			var inner byte
			if flags&flagMore != 0 {
				inner = msgFlagMore
			}
			b = sess.sealLocked(b, inner, wire[hdr:hdr+size])
			wire = wire[hdr+size:]
		}
	}
	if cap(b) <= maxSealedBuffer {
		s.sealed = b
	} else {
		s.sealed = nil
	}
	s.z.c.SetWriteDeadline(deadline)
	_, err := s.z.c.Write(b)
	return err
}

// serveReplay answers replay requests on one connection, as vLLM's
// ROUTER does: a request is an empty delimiter and an 8-byte big-endian
// start sequence (what a REQ socket sends; a DEALER sends the same two
// frames, or the sequence alone); the reply is every buffered batch from
// that sequence on as [delimiter, seq, payload], then [delimiter, -1, ""].
func (p *Publisher) serveReplay(c net.Conn) {
	defer c.Close()
	if !p.admit(&p.mu.clients) {
		p.refusePeer(c, "too many replay clients, or closing", nil)
		return
	}
	defer p.leave(&p.mu.clients)
	z, err := p.handshake(c, "ROUTER", []string{"REQ", "DEALER"})
	if errors.Is(err, ErrClosed) {
		return
	}
	if err != nil {
		p.refusePeer(c, "handshake", err)
		return
	}
	served := make(chan struct{})
	defer close(served)
	go func() {
		select {
		case <-p.stop: // unblock the read below
			c.Close()
		case <-served:
		}
	}()
	// A client has IdleTimeout after connecting, and after each answer,
	// for its next request; malformed ones do not count.
	awaitRequest := func() {
		if p.cfg.IdleTimeout > 0 {
			c.SetReadDeadline(time.Now().Add(p.cfg.IdleTimeout))
		}
	}
	awaitRequest()
	var entries []ringEntry
	for {
		msg, err := z.readMessage(maxReplayRequest)
		if err != nil {
			if p.cfg.IdleTimeout > 0 && errors.Is(err, os.ErrDeadlineExceeded) {
				p.refusePeer(c, "idle", fmt.Errorf("%w: idle: no replay request for %v", ErrPeer, p.cfg.IdleTimeout))
			} else if errors.Is(err, ErrPeer) { // a protocol error, not a client that went away
				p.refusePeer(c, "replay request", err)
			}
			return
		}
		var envelope [][]byte
		switch {
		case len(msg) == 2 && len(msg[0]) == 0 && len(msg[1]) == 8:
			envelope = msg[:1]
		case len(msg) == 1 && len(msg[0]) == 8:
		default:
			p.badRequests.Add(1)
			p.log.LogAttrs(context.Background(), slog.LevelWarn, "kvevents: malformed replay request ignored",
				slog.String("remote", c.RemoteAddr().String()), slog.Int("frames", len(msg)))
			continue
		}
		start := binary.BigEndian.Uint64(msg[len(msg)-1])
		entries, inRange := p.ring.since(entries[:0], start, p.batches.Load())
		p.replays.Add(1)
		if !inRange {
			p.outOfRange.Add(1)
			p.log.LogAttrs(context.Background(), slog.LevelWarn, "kvevents: replay request out of range answered with the end marker alone",
				slog.String("remote", c.RemoteAddr().String()), slog.Uint64("start", start), slog.Uint64("next_seq", p.batches.Load()))
		}
		var seqb [8]byte
		for _, e := range entries {
			binary.BigEndian.PutUint64(seqb[:], e.seq)
			if err := p.writeReplay(z, append(envelope, seqb[:], e.payload)...); err != nil {
				return
			}
			p.replayed.Add(1)
		}
		clear(entries) // kept for the next request, not the batches in it
		binary.BigEndian.PutUint64(seqb[:], endSeq)
		if err := p.writeReplay(z, append(envelope, seqb[:], nil)...); err != nil {
			return
		}
		awaitRequest()
	}
}

func (p *Publisher) writeReplay(z *zconn, frames ...[]byte) error {
	z.c.SetWriteDeadline(time.Now().Add(p.cfg.WriteTimeout))
	if err := z.writeMessage(frames...); err != nil {
		p.disconnects.Add(1)
		return fmt.Errorf("%w: replay: %w", ErrPeer, err)
	}
	return nil
}

// ring keeps the latest batches for replay, bounded in count and bytes.
type ring struct {
	mu       sync.Mutex
	entries  []ringEntry // oldest first
	head     int         // index of the oldest in entries
	n        int
	bytes    int
	maxSteps int
	maxBytes int
}

type ringEntry struct {
	seq     uint64
	payload []byte // immutable once added
}

func (r *ring) add(seq uint64, payload []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.entries == nil {
		r.entries = make([]ringEntry, r.maxSteps)
	}
	for r.n > 0 && (r.n == r.maxSteps || r.bytes+len(payload) > r.maxBytes) {
		old := &r.entries[r.head]
		r.bytes -= len(old.payload)
		*old = ringEntry{}
		r.head = (r.head + 1) % r.maxSteps
		r.n--
	}
	r.entries[(r.head+r.n)%r.maxSteps] = ringEntry{seq: seq, payload: payload}
	r.n++
	r.bytes += len(payload)
}

// since appends the buffered batches numbered start or later to dst, and
// says whether start is in range: not past next, the number of the next
// batch, and not before the oldest buffered batch once older ones have
// gone. Out of range, it appends nothing.
func (r *ring) since(dst []ringEntry, start, next uint64) ([]ringEntry, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if start > next || (r.n > 0 && start < r.entries[r.head].seq) {
		return dst, false
	}
	for i := range r.n {
		if e := r.entries[(r.head+i)%r.maxSteps]; e.seq >= start {
			dst = append(dst, e)
		}
	}
	return dst, true
}
