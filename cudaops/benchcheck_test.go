package cudaops_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// fillCheck is what a fill benchmark checks after its timed loop, so that
// a figure is never reported for fills that did not happen: a device that
// returned a completed fence without writing (or wrote some regions only)
// would otherwise look like the fastest backend of all. Before the loop it
// overwrites a sample of the batch's pages (the first, a middle and the
// last, in every region) with words the fill never writes; after it, the
// sampled pages must hold exactly the fill's words and the device's
// counters must have grown by exactly the fills the loop issued. The
// whole batch is not read back because on a GPU that would take longer
// than the benchmark itself.
type fillCheck struct {
	d      cudaops.Device
	batch  []int32
	spec   cudaops.FillSpec
	sample []int32
	before cudaops.Counters
}

// newFillCheck dirties the sample and records the counters. Call it after
// any untimed fills of the same device and before the timed loop.
func newFillCheck(d cudaops.Device, batch []int32, spec cudaops.FillSpec) (*fillCheck, error) {
	c := &fillCheck{d: d, batch: batch, spec: spec}
	if len(batch) > 0 {
		c.sample = []int32{batch[0], batch[len(batch)/2], batch[len(batch)-1]}
	}
	for r, reg := range d.Regions() {
		buf := make([]byte, reg.PageBytes)
		for _, p := range c.sample {
			putWords(buf, ^spec.WordFor(p)) // differs from the fill's word in every bit
			if err := d.WritePage(r, p, buf); err != nil {
				return nil, err
			}
		}
	}
	c.before = d.Counters()
	return c, nil
}

// verify reports how the device fell short of fills fills of the batch, or
// nil.
func (c *fillCheck) verify(fills int) error {
	after := c.d.Counters()
	var perFill uint64
	regions := c.d.Regions()
	for _, r := range regions {
		perFill += uint64(r.PageBytes)
	}
	perFill *= uint64(len(c.batch))
	n := uint64(fills)
	for _, x := range []struct {
		what        string
		got, wanted uint64
	}{
		{"fill calls", after.FillCalls - c.before.FillCalls, n},
		{"pages filled", after.PagesFilled - c.before.PagesFilled, n * uint64(len(c.batch))},
		{"bytes filled", after.BytesFilled - c.before.BytesFilled, n * perFill},
	} {
		if x.got != x.wanted {
			return fmt.Errorf("%d fills of %d pages on %s counted %d %s, want %d", fills, len(c.batch), c.d.Name(), x.got, x.what, x.wanted)
		}
	}
	if fills == 0 {
		return nil
	}
	for r, reg := range regions {
		got := make([]byte, reg.PageBytes)
		want := make([]byte, reg.PageBytes)
		for _, p := range c.sample {
			if err := c.d.ReadPage(r, p, got); err != nil {
				return err
			}
			putWords(want, c.spec.WordFor(p))
			if !bytes.Equal(got, want) {
				i := 0
				for got[i] == want[i] {
					i++
				}
				return fmt.Errorf("page %d of region %d on %s differs from the fill's word %#08x first at byte %d after %d fills",
					p, r, c.d.Name(), c.spec.WordFor(p), i, fills)
			}
		}
	}
	return nil
}

func putWords(b []byte, w uint32) {
	for i := 0; i+4 <= len(b); i += 4 {
		binary.LittleEndian.PutUint32(b[i:], w)
	}
}

// skippingDevice is a Host that leaves the last page of every batch
// untouched in the last region but counts the fill as whole: the kind of
// device fillCheck must not let a benchmark time.
type skippingDevice struct{ *cudaops.Host }

func (d skippingDevice) Fill(pages []int32, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	last := len(d.Regions()) - 1
	if len(pages) == 0 || last < 0 {
		return d.Host.Fill(pages, spec, after)
	}
	p := pages[len(pages)-1]
	keep := append([]byte(nil), d.PageBytes(last, p)...)
	f, err := d.Host.Fill(pages, spec, after)
	copy(d.PageBytes(last, p), keep)
	return f, err
}

// TestFillCheck: the benchmarks' check passes devices that fill (Host, and
// CUDA over the simulated driver) and fails one that skips a page, one that was asked for fewer fills than
// counted, and one that never filled.
func TestFillCheck(t *testing.T) {
	open := func() *cudaops.Host {
		h := cudaops.NewHost()
		t.Cleanup(func() { h.Close() })
		for range 3 {
			_, err := h.AllocRegion(16, 64)
			require.NoError(t, err)
		}
		return h
	}
	batch := []int32{1, 4, 5, 9, 15}
	spec := cudaops.FillSpec{Word: 0x5ca1ab1e, PageSalt: 0x9e3779b1, ClearMask: 0x40004000}
	run := func(d cudaops.Device, fills, claimed int) error {
		c, err := newFillCheck(d, batch, spec)
		require.NoError(t, err)
		for range fills {
			f, err := d.Fill(batch, spec, cudaops.Ordering{})
			require.NoError(t, err)
			require.NoError(t, f.Wait())
		}
		return c.verify(claimed)
	}
	assert.NoError(t, run(open(), 3, 3))
	for _, mode := range []cudaops.FillMode{cudaops.FillKernel, cudaops.FillMemset} {
		d, _ := openFake(t) // the CUDA device's own counters, over the simulated driver
		require.NoError(t, d.SetFillMode(mode))
		for range 3 {
			_, err := d.AllocRegion(16, 64)
			require.NoError(t, err)
		}
		assert.NoError(t, run(d, 3, 3), "CUDA, %v fills", mode)
	}
	assert.ErrorContains(t, run(skippingDevice{open()}, 3, 3), "region 2", "a skipped page")
	assert.ErrorContains(t, run(open(), 3, 4), "fill calls", "fewer fills than the loop issued")
	assert.ErrorContains(t, run(open(), 0, 1), "fill calls", "no fill at all")
}
