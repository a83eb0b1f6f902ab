package handoff

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// threeLanes is a grant of two groups: 4 units of a per-token group of
// two regions (64 and 32 bytes a page) and one state slot of one region
// of 128 bytes (unit 4), into three extents: region 0's pages and the
// slot in extent 0, region 1's split over the end of extent 0 and
// extent 1, the slot in extent 2.
func threeLanes() *grant {
	return &grant{
		transfer: [16]byte{1, 2, 3},
		extents:  []int64{4*64 + 2*32, 2 * 32, 128},
		lanes: []grantLane{
			{unitBytes: 64, first: 0, units: 4, runs: []grantRun{{first: 0, n: 4, extent: 0}}},
			{unitBytes: 32, first: 0, units: 4, runs: []grantRun{{first: 2, n: 2, extent: 1}, {first: 0, n: 2, extent: 0, off: 4 * 64}}},
			{unitBytes: 128, first: 4, units: 1, runs: []grantRun{{first: 4, n: 1, extent: 2}}},
		},
		desc: []byte("the transport's"),
	}
}

// shapes are the lanes threeLanes must have.
var shapes = []laneShape{{64, 0, 4}, {32, 0, 4}, {128, 4, 1}}

func TestGrantRoundTrip(t *testing.T) {
	k := testKey(t)
	g := threeLanes()
	msg := appendGrant(nil, k, g)
	got, err := parseGrant(msg, k, g.transfer)
	require.NoError(t, err)
	assert.Equal(t, g, got)
	require.NoError(t, checkGrant(got, shapes))
	p := placeGrant(got)
	assert.Equal(t, []int32{1, 1}, p.extent[1][2:])
	assert.Equal(t, []int64{4 * 64, 4*64 + 32, 0, 32}, p.off[1])

	// Each byte changed breaks the MAC (or, the kind, the message).
	for i := range msg {
		bad := append([]byte(nil), msg...)
		bad[i] ^= 1
		_, err := parseGrant(bad, k, g.transfer)
		assert.Error(t, err, "byte %d", i)
	}
	other, err := NewKey([]byte("another key, also thirty-two bytes or more"))
	require.NoError(t, err)
	_, err = parseGrant(msg, other, g.transfer)
	assert.ErrorIs(t, err, ErrBadMAC)
	_, err = parseGrant(msg, k, [16]byte{9})
	assert.ErrorIs(t, err, ErrProtocol, "a grant of another transfer")
	_, err = parseGrant(msg[:len(msg)-1], k, g.transfer)
	assert.Error(t, err)
}

// A grant that does not place every unit of the export exactly once,
// inside its extents and on bytes of its own, is refused before anything
// is written.
func TestCheckGrantRefuses(t *testing.T) {
	cases := map[string]func(g *grant){
		"a lane missing":              func(g *grant) { g.lanes = g.lanes[:1] },
		"units of another size":       func(g *grant) { g.lanes[1].unitBytes = 16 },
		"another page count":          func(g *grant) { g.lanes[0].units = 5 },
		"a unit placed twice":         func(g *grant) { g.lanes[1].runs[0].first = 1 },
		"a unit not placed":           func(g *grant) { g.lanes[1].runs[0].n = 1 },
		"a run past its extent":       func(g *grant) { g.extents[1]-- },
		"an extent named that is not": func(g *grant) { g.lanes[1].runs[0].extent = 2 },
		"a negative offset":           func(g *grant) { g.lanes[1].runs[1].off = -1 },
		"an empty extent":             func(g *grant) { g.extents = append(g.extents, 0) },
		"two runs on the same bytes": func(g *grant) {
			g.lanes[1].runs[1].off = 4*64 - 32
		},
		"a run of no units": func(g *grant) {
			g.lanes[0].runs = append(g.lanes[0].runs, grantRun{first: 4, n: 0})
		},
	}
	for name, change := range cases {
		t.Run(name, func(t *testing.T) {
			g := threeLanes()
			change(g)
			assert.ErrorIs(t, checkGrant(g, shapes), ErrProtocol)
		})
	}
}

// FuzzParseGrant: whatever bytes a receiver signs, the sender either
// refuses them or places every unit inside the extents they name.
func FuzzParseGrant(f *testing.F) {
	k := testKey(f)
	g := threeLanes()
	f.Add(appendGrant(nil, k, g)[1 : len(appendGrant(nil, k, g))-macLen])
	f.Fuzz(func(t *testing.T, signed []byte) {
		msg := append([]byte{msgGrant}, signed...)
		msg = grantMAC(msg, k, msg[1:])
		got, err := parseGrant(msg, k, g.transfer)
		if err != nil || checkGrant(got, shapes) != nil {
			return
		}
		p := placeGrant(got)
		for lane, shape := range shapes {
			size := int64(shape.unitBytes)
			for u := range shape.units {
				e, off := p.extent[lane][u], p.off[lane][u]
				if off < 0 || off+size > got.extents[e] {
					t.Fatalf("unit %d of lane %d placed at %d of extent %d (%d bytes)", u, lane, off, e, got.extents[e])
				}
			}
		}
	})
}
