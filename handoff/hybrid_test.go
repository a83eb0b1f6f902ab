package handoff_test

import (
	"context"
	"encoding/binary"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// hybridPools are a prefill and a decode pool of testkit.HybridSpec.
func hybridPools(t *testing.T) (prefill, decode *kvcache.Pool) {
	return pool(t, testkit.PoolConfig{Spec: testkit.HybridSpec(), Pages: 96}),
		pool(t, testkit.PoolConfig{Spec: testkit.HybridSpec(), Pages: 96})
}

// A hybrid prompt crosses every way a handoff moves: streamed (its state
// slot in parts of 8 KiB messages, and in one 1 MiB message), and carried
// by the caller (ReadUnits, ReadUnitRange). The decode lease holds
// exactly the prefill's KV, latents, indexer keys, window and state, its
// window starting where the prompt's does; both pools end clean.
func TestHybridHandoffMovesEveryGroup(t *testing.T) {
	ctx := context.Background()
	for _, frame := range []int{8 << 10, 1 << 20} {
		prefill, decode := hybridPools(t)
		recv := receiver(t, decode)
		for i, prompt := range []int{1, 40, 16*20 + 3} {
			id := string(rune('a'+i)) + "-stream"
			l, err := testkit.Prefill(prefill, id, "victim", prompt)
			require.NoError(t, err)
			exp, err := sender(t, func(c *handoff.SenderConfig) { c.FrameBytes = frame }).Export(l, 32)
			require.NoError(t, err)
			m := exp.Manifest()
			require.Len(t, m.Extents, 3)
			require.NoError(t, exp.Send(ctx, handoff.NewInProcess(recv)), "frames of %d bytes, prompt %d", frame, prompt)
			dl, ok := recv.Take(id)
			require.True(t, ok)
			require.NoError(t, testkit.VerifyContent(decode, dl, id))
			require.NoError(t, dl.Release())
		}
		sweep(t, prefill, decode)
	}

	prefill, decode := hybridPools(t)
	l, err := testkit.Prefill(prefill, "direct", "victim", 16*9+5)
	require.NoError(t, err)
	exp, err := sender(t).Export(l, 8)
	require.NoError(t, err)
	imp, err := receiver(t, decode).Begin(ctx, mustManifest(t, exp))
	require.NoError(t, err)
	require.Equal(t, exp.Extents(), imp.Extents())
	for u := range imp.Units() {
		ub := exp.UnitBytes(u)
		buf := make([]byte, ub)
		if ub < 3*kvcache.UnitRangeAlign {
			require.NoError(t, exp.ReadUnits(u, buf))
			require.NoError(t, imp.WriteUnits(u, buf))
			continue
		}
		for off := int64(0); off < ub; off += 2 * kvcache.UnitRangeAlign {
			k := min(ub-off, 2*kvcache.UnitRangeAlign)
			require.NoError(t, exp.ReadUnitRange(u, off, buf[off:off+k]))
			require.NoError(t, imp.WriteUnitRange(u, off, buf[off:off+k]))
		}
	}
	dl, err := imp.Complete()
	require.NoError(t, err)
	require.NoError(t, testkit.VerifyContent(decode, dl, "direct"))
	require.NoError(t, exp.Ack())
	require.NoError(t, dl.Release())
	sweep(t, prefill, decode)
}

// message kinds of a transfer, as the hooks below see them.
const (
	kindData = 'D'
	kindPart = 'P'
	kindSeal = 'S'
)

// partUnit is the unit a part frame carries.
func partUnit(msg []byte) int { return int(binary.LittleEndian.Uint32(msg[17:])) }

// Each fault of one group's frames on the wire gets its own error and
// hands nothing out; both pools balance, every group's pages scrubbed.
func TestHybridHandoffFaultsPerGroup(t *testing.T) {
	ctx := context.Background()
	prefill, decode := hybridPools(t)
	recv := receiver(t, decode)
	const prompt = 16*12 + 7
	state := func(m handoff.Manifest) int { return m.Units() - 1 }
	for _, tc := range []struct {
		name string
		// hook sees each message of the transfer (n counts them) and
		// sends what it likes instead; m is the export's manifest.
		hook func(m handoff.Manifest, st handoff.Stream, n int, msg []byte) error
		want error
	}{
		{"the state slot never sent", func(m handoff.Manifest, st handoff.Stream, n int, msg []byte) error {
			if msg[0] == kindPart && partUnit(msg) == state(m) {
				return nil
			}
			return st.Send(msg)
		}, kvcache.ErrIncompleteTransfer},
		{"the window's frame never sent", func(m handoff.Manifest, st handoff.Stream, n int, msg []byte) error {
			if msg[0] == kindData && int(binary.LittleEndian.Uint32(msg[17:])) == m.Extents[0].Units {
				return nil
			}
			return st.Send(msg)
		}, handoff.ErrProtocol},
		{"the window's frame sent twice", func(m handoff.Manifest, st handoff.Stream, n int, msg []byte) error {
			if msg[0] == kindData && int(binary.LittleEndian.Uint32(msg[17:])) == m.Extents[0].Units {
				if err := st.Send(msg); err != nil {
					return err
				}
			}
			return st.Send(msg)
		}, handoff.ErrProtocol},
		{"the window's frame at a ring position past the extents", func(m handoff.Manifest, st handoff.Stream, n int, msg []byte) error {
			if msg[0] == kindData && int(binary.LittleEndian.Uint32(msg[17:])) == m.Extents[0].Units {
				msg = append([]byte(nil), msg...)
				binary.LittleEndian.PutUint32(msg[17:], uint32(m.Units()+2))
			}
			return st.Send(msg)
		}, handoff.ErrProtocol},
		{"a state part sent twice", func(m handoff.Manifest, st handoff.Stream, n int, msg []byte) error {
			if msg[0] == kindPart {
				if err := st.Send(msg); err != nil {
					return err
				}
			}
			return st.Send(msg)
		}, handoff.ErrProtocol},
		{"the state slot's parts reordered", reorderParts(), handoff.ErrProtocol},
		{"a state part truncated", func(m handoff.Manifest, st handoff.Stream, n int, msg []byte) error {
			if msg[0] == kindPart && binary.LittleEndian.Uint64(msg[21:]) == 0 {
				return st.Send(msg[:len(msg)-100])
			}
			return st.Send(msg)
		}, handoff.ErrProtocol},
		{"a byte of the state corrupted", func(m handoff.Manifest, st handoff.Stream, n int, msg []byte) error {
			if msg[0] == kindPart {
				msg = append([]byte(nil), msg...)
				msg[len(msg)-1] ^= 0x40
			}
			return st.Send(msg)
		}, kvcache.ErrChecksumMismatch},
		{"a state part of another generation", func(m handoff.Manifest, st handoff.Stream, n int, msg []byte) error {
			if msg[0] == kindPart {
				msg = append([]byte(nil), msg...)
				binary.LittleEndian.PutUint32(msg[29:], 99)
			}
			return st.Send(msg)
		}, handoff.ErrProtocol},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := tc.name
			l, err := testkit.Prefill(prefill, id, "victim", prompt)
			require.NoError(t, err)
			exp, err := sender(t, func(c *handoff.SenderConfig) { c.FrameBytes = 8 << 10 }).Export(l, 8)
			require.NoError(t, err)
			m := exp.Manifest()
			err = exp.Send(ctx, &hooked{inner: handoff.NewInProcess(recv), send: func(st handoff.Stream, n int, msg []byte) error {
				return tc.hook(m, st, n, msg)
			}})
			require.ErrorIs(t, err, tc.want)
			t.Logf("%v", err)
			assertNoImport(t, recv, decode, id)
			require.NoError(t, exp.Abort())
		})
	}
	// A transfer killed in the middle of the state slot.
	l, err := testkit.Prefill(prefill, "killed", "victim", prompt)
	require.NoError(t, err)
	exp, err := sender(t, func(c *handoff.SenderConfig) { c.FrameBytes = 8 << 10 }).Export(l, 8)
	require.NoError(t, err)
	err = exp.Send(ctx, &hooked{inner: handoff.NewInProcess(recv), send: func(st handoff.Stream, n int, msg []byte) error {
		if msg[0] == kindPart && binary.LittleEndian.Uint64(msg[21:]) > 0 {
			st.Close()
			return errors.New("killed")
		}
		return st.Send(msg)
	}})
	require.ErrorIs(t, err, handoff.ErrTransport)
	require.NoError(t, exp.Abort())
	require.Eventually(t, func() bool { return decode.Stats().LiveLeases == 0 }, 5*time.Second, time.Millisecond)
	assertNoImport(t, recv, decode, "killed")
	sweep(t, prefill, decode)
}

// reorderParts holds the first part of the state slot back and sends it
// after the second.
func reorderParts() func(m handoff.Manifest, st handoff.Stream, n int, msg []byte) error {
	var held []byte
	return func(m handoff.Manifest, st handoff.Stream, n int, msg []byte) error {
		if msg[0] == kindPart && held == nil {
			held = append([]byte(nil), msg...)
			return nil
		}
		if err := st.Send(msg); err != nil || held == nil || msg[0] != kindPart {
			return err
		}
		h := held
		held = []byte{0}
		if len(h) > 1 {
			return st.Send(h)
		}
		return nil
	}
}

// A decode pool of another cache spec, by one region or by one group, or
// of another tensor-parallel shard, refuses the manifest with an error
// that names the difference, before taking a page.
func TestHybridHandoffRefusesAnotherSpec(t *testing.T) {
	prefill := pool(t, testkit.PoolConfig{Spec: testkit.HybridSpec(), Pages: 64})
	l, err := testkit.Prefill(prefill, "r", "victim", 40)
	require.NoError(t, err)
	exp, err := sender(t).Export(l, 8)
	require.NoError(t, err)
	mb := mustManifest(t, exp)
	oneRegion := testkit.HybridSpec()
	oneRegion.Groups[2].Regions[1].PageBytes += 4
	noWindow := testkit.HybridSpec()
	noWindow.Groups = append(noWindow.Groups[:1], noWindow.Groups[2])
	otherShard := testkit.HybridSpec()
	otherShard.Shard = kvcache.Shard{Rank: 1, Size: 2}
	for _, tc := range []struct {
		name string
		spec kvcache.CacheSpec
		want error
		says string
	}{
		{"a region of the state slot", oneRegion, handoff.ErrGeometryMismatch, `cache group 2 ("state" here) region 1 ("layer.0.state" here) has 8192 bytes per page in the sender's spec, 8196 here`},
		{"a group fewer", noWindow, handoff.ErrGeometryMismatch, "3 cache groups sent, 2 here"},
		{"another shard", otherShard, handoff.ErrShardMismatch, "the sender's pages hold unsharded, this pool's tensor-parallel rank 1 of 2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			other := pool(t, testkit.PoolConfig{Spec: tc.spec, Pages: 64})
			before := other.Stats()
			_, err := receiver(t, other).Begin(context.Background(), mb)
			require.ErrorIs(t, err, tc.want)
			assert.ErrorContains(t, err, tc.says)
			after := other.Stats()
			assert.Equal(t, before.Groups, after.Groups, "nothing taken")
			require.NoError(t, other.Check())
		})
	}
	require.NoError(t, exp.Abort())
	sweep(t, prefill)
}
