package kvcache

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// tinyGeometry keeps host memory small: 2 layers × K/V, 64 bytes per page
// per region.
var tinyGeometry = Geometry{TokensPerPage: 4, Layers: 2, KVHeads: 1, HeadDim: 8, DType: BF16}

func tinyConfig(pages int, tenants ...TenantConfig) Config {
	if len(tenants) == 0 {
		tenants = []TenantConfig{{Name: "a"}, {Name: "b"}}
	}
	return Config{
		Geometry:         tinyGeometry,
		Pages:            pages,
		MaxContextTokens: pages * tinyGeometry.TokensPerPage,
		Tenants:          tenants,
	}
}

func newPool(t testing.TB, cfg Config) *Pool {
	t.Helper()
	p, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

func admit(t testing.TB, p *Pool, id, tenant string, tokens int) *Lease {
	t.Helper()
	l, err := p.TryAdmit(Request{ID: id, Tenant: tenant, PromptTokens: tokens})
	require.NoError(t, err)
	require.NoError(t, p.Check())
	return l
}

// state is everything a refused call must leave as it was: Stats without
// the refusal counters (the pool's and its tenants').
func state(p *Pool) Stats {
	s := p.Stats()
	s.Refused, s.Growth.Refused = Refusals{}, Refusals{}
	for i := range s.Tenants {
		s.Tenants[i].Refused = Refusals{}
	}
	return s
}

// hostOf returns the pool's host device.
func hostOf(t testing.TB, p *Pool) *cudaops.Host {
	t.Helper()
	h, ok := p.dev.(*cudaops.Host)
	require.True(t, ok, "pool device is %T", p.dev)
	return h
}

// scriptedDevice wraps a Host and lets a test fail fills or hold their
// completion, like an asynchronous GPU stream.
type scriptedDevice struct {
	*cudaops.Host
	mu struct {
		sync.Mutex
		failNext  error // next Fill returns this error
		failFence error // next Fill's fence completes with this error
		hold      bool  // fences stay pending until released
		pending   []*heldFence
		orders    []cudaops.Ordering
		// gate, if set, stops the next Fill at its entry: it sends on
		// entered, then waits for proceed, as a slow driver call would.
		gate *fillGate
	}
}

type fillGate struct{ entered, proceed chan struct{} }

// gateNextFill makes the next Fill stop at its entry until the returned
// gate's proceed is closed.
func (d *scriptedDevice) gateNextFill() *fillGate {
	g := &fillGate{entered: make(chan struct{}, 1), proceed: make(chan struct{})}
	d.mu.Lock()
	d.mu.gate = g
	d.mu.Unlock()
	return g
}

type heldFence struct {
	done chan struct{}
	err  error
}

func (f *heldFence) Done() (bool, error) {
	select {
	case <-f.done:
		return true, f.err
	default:
		return false, nil
	}
}

func (f *heldFence) Wait() error { <-f.done; return f.err }

func newScripted() *scriptedDevice { return &scriptedDevice{Host: cudaops.NewHost()} }

func (d *scriptedDevice) Fill(pages []int32, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	return d.fill(after, func() error {
		_, err := d.Host.Fill(pages, spec, after)
		return err
	})
}

// FillSpans is Fill for pools with several cache groups.
func (d *scriptedDevice) FillSpans(spans []cudaops.Span, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	return d.fill(after, func() error {
		_, err := d.Host.FillSpans(spans, spec, after)
		return err
	})
}

// fill runs a fill, host's, as the script says: stopped at its gate,
// refused, or with a fence that fails or is held.
func (d *scriptedDevice) fill(after cudaops.Ordering, host func() error) (cudaops.Fence, error) {
	d.mu.Lock()
	if g := d.mu.gate; g != nil {
		d.mu.gate = nil
		d.mu.Unlock()
		g.entered <- struct{}{}
		<-g.proceed
		d.mu.Lock()
	}
	defer d.mu.Unlock()
	d.mu.orders = append(d.mu.orders, after)
	if err := d.mu.failNext; err != nil {
		d.mu.failNext = nil
		return nil, err
	}
	if err := host(); err != nil {
		return nil, err
	}
	f := &heldFence{done: make(chan struct{}), err: d.mu.failFence}
	d.mu.failFence = nil
	if d.mu.hold {
		d.mu.pending = append(d.mu.pending, f)
	} else {
		close(f.done)
	}
	return f, nil
}

// complete releases every held fence and stops holding new ones.
func (d *scriptedDevice) complete() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.mu.hold = false
	for _, f := range d.mu.pending {
		close(f.done)
	}
	d.mu.pending = nil
}
