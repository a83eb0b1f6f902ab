package bridge

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// Tensor parallelism with one process per rank, through C (since ABI 5).
// The scheduler's pool is over the remote ranks ("device": {"kind":
// "remote"}, openRemote); each worker process serves its rank with a rank
// worker: its device holds the rank's shard of every region, and it
// launches the fills the scheduler hands over when the engine steps it,
// ordered after the engine's own stream (cudaops.ServeRank, RankWorker).
//
// A worker's entry is live from CreateRankWorker to CloseRankWorker. Its
// connection may end first (the scheduler destroyed its pool or died):
// from then on RankStep fails, and RankWait reports it, so a worker whose
// scheduler is gone learns so from the next call instead of hanging.

var workers sync.Map // Handle → *rankEntry

// RankConfigJSON is what kvf_rank_worker_create takes: where the
// scheduler listens, this worker's rank, its device (as a pool's
// "device": host or CUDA), whether batches launch as they arrive rather
// than at each step, how many more steps a batch waits (since ABI 8;
// cudaops.RankWorker.SetStepLag), and how long to keep trying to connect
// (0: 60 s; the scheduler may not listen yet).
type RankConfigJSON struct {
	Connect          string     `json:"connect"`
	Rank             *int       `json:"rank"`
	Device           DeviceJSON `json:"device,omitzero"`
	AutoStep         bool       `json:"auto_step,omitempty"`
	StepLag          int        `json:"step_lag,omitempty"`
	ConnectTimeoutMS int64      `json:"connect_timeout_ms,omitempty"`
}

// RankConfig is a parsed RankConfigJSON.
type RankConfig struct {
	Network, Address string // for net.Dial
	Rank             int
	Device           DeviceJSON // kind host or cuda
	AutoStep         bool
	StepLag          int
	ConnectTimeout   time.Duration
}

// maxStepLag bounds RankConfigJSON.StepLag: an engine runs at most a few
// steps ahead of the results it has processed.
const maxStepLag = 8

// defaultConnectTimeout matches how long a scheduler waits for its ranks
// by default (cudaops.RemoteConfig.AcceptTimeout).
const defaultConnectTimeout = 60 * time.Second

// ParseRankConfig decodes a RankConfigJSON. Every error wraps
// kvcache.ErrInvalidConfig.
func ParseRankConfig(data []byte) (RankConfig, error) {
	fail := func(format string, args ...any) (RankConfig, error) {
		return RankConfig{}, fmt.Errorf("%w: rank worker config: "+format, append([]any{kvcache.ErrInvalidConfig}, args...)...)
	}
	if len(data) > MaxJSONBytes {
		return fail("%d bytes, limit %d", len(data), MaxJSONBytes)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var cj RankConfigJSON
	if err := dec.Decode(&cj); err != nil {
		return fail("%v", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return fail("trailing data after the object")
	}
	network, addr, err := parseAddress("rank worker config: connect", cj.Connect)
	if err != nil {
		return RankConfig{}, err
	}
	switch {
	case cj.Rank == nil:
		return fail("rank missing")
	case *cj.Rank < 0 || *cj.Rank >= maxRanks:
		return fail("rank %d, want 0 to %d", *cj.Rank, maxRanks-1)
	case cj.ConnectTimeoutMS < 0:
		return fail("connect_timeout_ms %d", cj.ConnectTimeoutMS)
	case cj.StepLag < 0 || cj.StepLag > maxStepLag:
		return fail("step_lag %d, want 0 to %d", cj.StepLag, maxStepLag)
	}
	dev, err := cj.Device.checkLocal()
	if err != nil {
		return RankConfig{}, err
	}
	cfg := RankConfig{Network: network, Address: addr, Rank: *cj.Rank, Device: dev, AutoStep: cj.AutoStep,
		StepLag: cj.StepLag, ConnectTimeout: ms(cj.ConnectTimeoutMS)}
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = defaultConnectTimeout
	}
	return cfg, nil
}

// parseAddress splits "unix:PATH" and "tcp:HOST:PORT" into a network and
// an address for net.Listen and net.Dial. what names the field in errors,
// which wrap kvcache.ErrInvalidConfig.
func parseAddress(what, s string) (network, addr string, err error) {
	network, addr, ok := strings.Cut(s, ":")
	switch {
	case s == "":
		return "", "", fmt.Errorf("%w: %s missing (\"unix:PATH\" or \"tcp:HOST:PORT\")", kvcache.ErrInvalidConfig, what)
	case !ok || (network != "unix" && network != "tcp"):
		return "", "", fmt.Errorf("%w: %s %q, want \"unix:PATH\" or \"tcp:HOST:PORT\"", kvcache.ErrInvalidConfig, what, s)
	case addr == "":
		return "", "", fmt.Errorf("%w: %s %q names no path or port", kvcache.ErrInvalidConfig, what, s)
	case network == "tcp":
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return "", "", fmt.Errorf("%w: %s %q: %v", kvcache.ErrInvalidConfig, what, s, err)
		}
	}
	return network, addr, nil
}

// openRemote forms a pool's remote group: it listens on the configured
// address, waits for every rank's hello (cudaops.ListenRanks) and stops
// listening. Every error wraps cudaops.ErrNoDevice: the group's device
// could not be formed, whatever the reason (address in use, a rank that
// never connected, a rank whose hello was refused).
func openRemote(d DeviceJSON) (cudaops.Device, error) {
	network, addr, err := parseAddress("device.listen", d.Listen)
	if err != nil {
		return nil, err
	}
	l, err := net.Listen(network, addr)
	if err != nil {
		return nil, fmt.Errorf("%w: remote group: listening on %s: %v", cudaops.ErrNoDevice, d.Listen, err)
	}
	defer l.Close() // the group is complete once ListenRanks returns; a unix socket's file goes with it
	g, err := cudaops.ListenRanks(l, cudaops.RemoteConfig{Ranks: d.Ranks,
		ReportTimeout: ms(d.ReportTimeoutMS), AcceptTimeout: ms(d.AcceptTimeoutMS)})
	if err != nil {
		if !errors.Is(err, cudaops.ErrNoDevice) {
			err = fmt.Errorf("%w: remote group on %s: %w", cudaops.ErrNoDevice, d.Listen, err)
		}
		return nil, err
	}
	return g, nil
}

// RankRegion is one region of a rank's shard (kvf_region): Base 0 asks
// the worker's device to allocate it (Stride 0 or PageBytes); otherwise
// Base is the engine's memory, adopted: a device address on CUDA, and on
// a host device the memory Host views (the export layer makes the slice).
type RankRegion struct {
	Base      uint64
	Stride    int64
	PageBytes int64
	Pages     int64
	Host      []byte
}

// Extent is the bytes the region spans from Base, after checking the
// description as cudaops does. Errors wrap cudaops.ErrInvalidArgument.
func (r RankRegion) Extent() (int64, error) {
	reg, err := r.region()
	if err != nil {
		return 0, err
	}
	return reg.Bytes(), nil
}

func (r RankRegion) region() (cudaops.Region, error) {
	if int64(int(r.Pages)) != r.Pages {
		return cudaops.Region{}, fmt.Errorf("%w: region of %d pages", cudaops.ErrInvalidArgument, r.Pages)
	}
	reg := cudaops.Region{Base: r.Base, Stride: r.Stride, PageBytes: r.PageBytes, Pages: int(r.Pages)}
	if r.Base == 0 {
		if r.Stride != 0 && r.Stride != r.PageBytes {
			return cudaops.Region{}, fmt.Errorf("%w: a region the worker allocates (base 0) has stride = page_bytes %d, not %d",
				cudaops.ErrInvalidArgument, r.PageBytes, r.Stride)
		}
		reg.Stride = r.PageBytes
	}
	if err := reg.Validate(); err != nil {
		return cudaops.Region{}, err
	}
	return reg, nil
}

type rankEntry struct {
	rank int
	auto bool // launch on arrival for good (RankConfig.AutoStep)
	w    *cudaops.RankWorker
	conn net.Conn
	dev  cudaops.Device

	// mu is held shared by every call for its whole duration and
	// exclusively by CloseRankWorker, which therefore waits for steps in
	// flight; closed is set under it.
	mu      sync.RWMutex
	closed  bool
	stepped atomic.Bool // the first RankStep has switched auto-launch off

	// ended is closed when the connection has ended; endErr (written
	// before) is why, nil for the scheduler's close or ours.
	ended   chan struct{}
	endErr  error
	closing atomic.Bool // CloseRankWorker ends the connection itself
}

func lookupWorker(h Handle) (*rankEntry, error) {
	if v, ok := workers.Load(h); ok {
		return v.(*rankEntry), nil
	}
	return nil, invalid(h, "rank worker")
}

// withWorker runs f on the live worker h under its shared lock.
func withWorker(h Handle, f func(e *rankEntry) error) error {
	e, err := lookupWorker(h)
	if err != nil {
		return err
	}
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed { // closed after our Load
		return invalid(h, "rank worker")
	}
	return f(e)
}

// openRankDevice opens the worker's device and adds its shard's regions.
func openRankDevice(sel DeviceJSON, regions []RankRegion) (cudaops.Device, error) {
	if len(regions) == 0 {
		return nil, fmt.Errorf("%w: a rank worker needs its shard's regions (n_regions 0)", kvcache.ErrInvalidArgument)
	}
	for i, r := range regions {
		reg, err := r.region()
		if err != nil {
			return nil, fmt.Errorf("region %d: %w", i, err)
		}
		if sel.Kind == DeviceHost && r.Base != 0 && int64(len(r.Host)) != reg.Bytes() {
			return nil, fmt.Errorf("%w: region %d: host memory of %d bytes for an extent of %d", ErrInternal, i, len(r.Host), reg.Bytes())
		}
	}
	var (
		dev   cudaops.Device
		adopt func(r RankRegion) (int, error)
	)
	if sel.Kind == DeviceCUDA {
		d, err := cudaops.OpenCUDA(sel.Ordinal)
		if err != nil {
			return nil, err
		}
		dev = d
		adopt = func(r RankRegion) (int, error) { return d.AdoptRegion(r.Base, int(r.Pages), r.Stride, r.PageBytes) }
	} else {
		h := cudaops.NewHostWith(cudaops.HostConfig{AsyncFills: sel.AsyncFills})
		dev = h
		adopt = func(r RankRegion) (int, error) { return h.AdoptRegion(r.Host, int(r.Pages), r.Stride, r.PageBytes) }
	}
	for i, r := range regions {
		var err error
		if r.Base == 0 {
			_, err = dev.AllocRegion(int(r.Pages), r.PageBytes)
		} else {
			_, err = adopt(r)
		}
		if err != nil {
			dev.Close()
			return nil, fmt.Errorf("region %d: %w", i, err)
		}
	}
	return dev, nil
}

// connectRetry is how often a worker tries again to reach a scheduler
// that does not listen yet.
const connectRetry = 20 * time.Millisecond

// dialScheduler connects within cfg.ConnectTimeout, trying again while
// the scheduler is not listening yet. Its error wraps cudaops.ErrNoDevice:
// without a scheduler the rank has no group to serve.
func dialScheduler(cfg RankConfig) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), cfg.ConnectTimeout)
	defer cancel()
	var d net.Dialer
	for {
		conn, err := d.DialContext(ctx, cfg.Network, cfg.Address)
		if err == nil {
			return conn, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: rank %d: no scheduler at %s:%s within %v: %v",
				cudaops.ErrNoDevice, cfg.Rank, cfg.Network, cfg.Address, cfg.ConnectTimeout, err)
		case <-time.After(connectRetry):
		}
	}
}

// CreateRankWorker opens the worker's device with its shard's regions,
// connects to the scheduler and says hello as cfg.Rank. Until the first
// RankStep, batches launch as they arrive, after all prior work of the
// device (the zero ordering): the first is the pool's initial scrub, which
// the scheduler's pool creation waits for, before the engine could step.
// With cfg.AutoStep they always do.
func CreateRankWorker(cfg RankConfig, regions []RankRegion) (Handle, error) {
	dev, err := openRankDevice(cfg.Device, regions)
	if err != nil {
		return 0, err
	}
	conn, err := dialScheduler(cfg)
	if err != nil {
		dev.Close()
		return 0, err
	}
	w, err := cudaops.ServeRank(conn, cfg.Rank, dev, true)
	if err != nil {
		conn.Close()
		dev.Close()
		return 0, err
	}
	w.SetStepLag(cfg.StepLag)
	e := &rankEntry{rank: cfg.Rank, auto: cfg.AutoStep, w: w, conn: conn, dev: dev, ended: make(chan struct{})}
	go func() {
		err := w.Wait()
		if e.closing.Load() {
			err = nil
		}
		e.endErr = err
		close(e.ended)
	}()
	h := nextHandle.Add(1)
	workers.Store(h, e)
	return h, nil
}

// gone is the error of a call on a worker whose connection has ended.
func (e *rankEntry) gone() error {
	if e.endErr != nil {
		// Whatever broke the connection (a reset, a frame no scheduler
		// sends), for this worker's caller it is the device's failure,
		// not an argument of theirs: wrap ErrDriver alone.
		why := strings.TrimPrefix(e.endErr.Error(), cudaops.ErrDriver.Error()+": ")
		return fmt.Errorf("%w: rank %d serves no more: the connection to the scheduler failed: %s", cudaops.ErrDriver, e.rank, why)
	}
	return fmt.Errorf("%w: rank %d: the scheduler closed the connection (its pool was destroyed, or its process ended): the rank serves no more",
		kvcache.ErrPoolClosed, e.rank)
}

func (e *rankEntry) hasEnded() bool {
	select {
	case <-e.ended:
		return true
	default:
		return false
	}
}

// RankStep launches the batches the scheduler handed to the rank since the
// last step, ordered after after (the engine's stream or event on the
// rank's device), and returns how many. A bad ordering is refused
// (cudaops.ErrBadOrdering) and launches nothing: the batches wait for a
// step with a usable one. Once the connection has ended it fails: with
// kvcache.ErrPoolClosed if the scheduler closed it, with the connection's
// error otherwise.
func RankStep(h Handle, after cudaops.Ordering) (int, error) {
	var n int
	err := withWorker(h, func(e *rankEntry) error {
		if e.hasEnded() {
			return e.gone()
		}
		if !e.auto && !e.stepped.Swap(true) {
			e.w.SetAutoStep(false)
		}
		var err error
		n, err = e.w.Step(after)
		return err
	})
	return n, err
}

// RankWait waits up to wait for the connection to end and reports whether
// it has: false, nil when wait passed first (wait 0 only looks); true, nil
// when the scheduler closed it; true and the connection's error when it
// failed.
func RankWait(h Handle, wait time.Duration) (bool, error) {
	if wait < 0 {
		return false, fmt.Errorf("%w: negative wait %v", kvcache.ErrInvalidArgument, wait)
	}
	var ended <-chan struct{}
	var e *rankEntry
	// Look the worker up under its lock, but wait without it: a close
	// from another thread ends the connection, which ends this wait.
	if err := withWorker(h, func(we *rankEntry) error { e, ended = we, we.ended; return nil }); err != nil {
		return false, err
	}
	if wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-ended:
		case <-t.C:
		}
	}
	if !e.hasEnded() {
		return false, nil
	}
	if e.endErr != nil {
		return true, e.gone()
	}
	return true, nil
}

// RankRegions returns the worker's regions; more than room of them is a
// *BufferError, with the count needed, and no regions.
func RankRegions(h Handle, room int) ([]cudaops.Region, error) {
	var rs []cudaops.Region
	err := withWorker(h, func(e *rankEntry) error {
		rs = e.dev.Regions()
		if len(rs) > room {
			return &BufferError{What: "regions", Need: len(rs), Have: room}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return rs, nil
}

// CloseRankWorker ends the worker: it waits for steps in flight, closes
// the connection (the scheduler loses the rank: fills in flight and every
// later one fail, and its pool faults), waits until nothing reads or
// writes the shard any more and closes the device (adopted memory stays
// the engine's). The handle is invalid afterwards, whatever the result.
func CloseRankWorker(h Handle) error {
	v, ok := workers.LoadAndDelete(h)
	if !ok {
		return invalid(h, "rank worker")
	}
	e := v.(*rankEntry)
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closed = true
	e.closing.Store(true)
	e.conn.Close()
	<-e.ended // the worker's reader, which also launches and copies pages, has returned
	return e.dev.Close()
}
