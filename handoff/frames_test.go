package handoff

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// dataMessage builds a 'D' message of n pages of pb bytes from page first.
func dataMessage(first, n, pb int) []byte {
	msg := make([]byte, dataFixed+n*(4+pb))
	msg[0] = msgData
	copy(msg[1:17], "transfer-id-0123")
	binary.LittleEndian.PutUint32(msg[17:], uint32(first))
	binary.LittleEndian.PutUint32(msg[21:], uint32(n))
	for i := range n {
		binary.LittleEndian.PutUint32(msg[dataFixed+4*i:], uint32(100+i))
	}
	for i := dataFixed + 4*n; i < len(msg); i++ {
		msg[i] = byte(i * 13)
	}
	return msg
}

// joined concatenates parts.
func joined(parts [][]byte) []byte { return bytes.Join(parts, nil) }

// TestParseDataInParts parses one data message cut in two at every
// position and in three around the head: the result is the same as for
// the whole message, whether or not the head straddles parts.
func TestParseDataInParts(t *testing.T) {
	const n, pb = 3, 10
	msg := dataMessage(5, n, pb)
	var whole messageParts
	whole.reset([][]byte{msg})
	want, err := parseData(&whole, nil)
	require.NoError(t, err)
	require.Equal(t, 5, want.first)
	require.Equal(t, n, want.n)
	wantPages := joined(want.units)
	require.Equal(t, msg[dataFixed+4*n:], wantPages)

	check := func(parts [][]byte) {
		t.Helper()
		var m messageParts
		m.reset(parts)
		require.Equal(t, byte(msgData), m.kind())
		f, err := parseData(&m, nil)
		require.NoError(t, err)
		assert.Equal(t, want.id, f.id)
		assert.Equal(t, want.first, f.first)
		assert.Equal(t, want.gens, f.gens)
		assert.Equal(t, wantPages, joined(f.units))
	}
	for cut := 0; cut <= len(msg); cut++ {
		check([][]byte{msg[:cut], msg[cut:]})
	}
	for a := 0; a <= dataFixed+4*n+2; a++ {
		for b := a; b <= dataFixed+4*n+2; b++ {
			check([][]byte{msg[:a], msg[a:b], {}, msg[b:]})
		}
	}
}

func TestParseDataRefusesMalformed(t *testing.T) {
	msg := dataMessage(0, 2, 8)
	zeroPages := bytes.Clone(msg[:dataFixed])
	binary.LittleEndian.PutUint32(zeroPages[21:], 0)
	tooMany := bytes.Clone(msg)
	binary.LittleEndian.PutUint32(tooMany[21:], 1<<30)
	for name, b := range map[string][]byte{
		"short head":         msg[:dataFixed-1],
		"no pages":           zeroPages,
		"more pages than it": tooMany,
		"generations cut":    msg[:dataFixed+4],
	} {
		for _, parts := range [][][]byte{{b}, {b[:len(b)/2], b[len(b)/2:]}} {
			var m messageParts
			m.reset(parts)
			_, err := parseData(&m, nil)
			assert.ErrorIs(t, err, ErrProtocol, name)
		}
	}
}

// FuzzParseData: any message, cut anywhere, either parses to what the
// whole message parses to or is refused as the whole one is.
func FuzzParseData(f *testing.F) {
	f.Add(dataMessage(0, 2, 8), uint16(3), uint16(30))
	f.Add(dataMessage(7, 1, 1), uint16(0), uint16(25))
	f.Add([]byte{msgData}, uint16(1), uint16(1))
	f.Fuzz(func(t *testing.T, msg []byte, a, b uint16) {
		i, j := min(int(a), len(msg)), min(int(b), len(msg))
		if i > j {
			i, j = j, i
		}
		var whole, cut messageParts
		whole.reset([][]byte{msg})
		cut.reset([][]byte{msg[:i], msg[i:j], msg[j:]})
		want, werr := parseData(&whole, nil)
		got, gerr := parseData(&cut, nil)
		if (werr == nil) != (gerr == nil) {
			t.Fatalf("whole: %v, in parts: %v", werr, gerr)
		}
		if werr != nil {
			if !errors.Is(werr, ErrProtocol) || !errors.Is(gerr, ErrProtocol) {
				t.Fatalf("refused for another reason: %v / %v", werr, gerr)
			}
			return
		}
		if got.id != want.id || got.first != want.first || got.n != want.n ||
			!bytes.Equal(got.gens, want.gens) || !bytes.Equal(joined(got.units), joined(want.units)) {
			t.Fatal("parts parse differently from the whole message")
		}
		if len(want.gens) != 4*want.n || dataFixed+4*want.n+len(joined(want.units)) != len(msg) {
			t.Fatal("parsed fields do not add up to the message")
		}
	})
}

// TestVerdictTextOfAPeerIsBounded: a verdict carries at most maxVerdict
// bytes of text, and the sender holds no more of what a receiver sends
// (it kept the whole message, up to the transport's limit of hundreds of
// MiB, in the error it returns and logs).
func TestVerdictTextOfAPeerIsBounded(t *testing.T) {
	msg := append([]byte{msgVerdict, stageImport, reasonCode(ErrProtocol)}, bytes.Repeat([]byte("x"), 8<<20)...)
	var re *RefusedError
	require.ErrorAs(t, parseVerdict(msg, stageImport), &re)
	assert.ErrorIs(t, re, ErrProtocol)
	assert.Equal(t, maxVerdict, len(re.Message), "bytes of the peer's text kept")

	short := appendVerdict(nil, stageManifest, fmt.Errorf("%w: no", ErrReplay))
	require.ErrorAs(t, parseVerdict(short, stageManifest), &re)
	assert.Equal(t, "handoff: manifest replayed: no", re.Message)
}
