package cudaops_test

import (
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// scriptedRank is a rank that speaks the protocol by hand, so that a test
// decides what it reports and when.
type scriptedRank struct {
	t    *testing.T
	conn net.Conn
}

func (r scriptedRank) send(kind byte, payload []byte) {
	hdr := binary.LittleEndian.AppendUint32(nil, uint32(len(payload)+1))
	_, err := r.conn.Write(append(append(hdr, kind), payload...))
	require.NoError(r.t, err)
}

// next reads the scheduler's next frame and returns its kind and seq.
func (r scriptedRank) next() (byte, uint64) {
	var hdr [5]byte
	_, err := io.ReadFull(r.conn, hdr[:])
	require.NoError(r.t, err)
	b := make([]byte, binary.LittleEndian.Uint32(hdr[:])-1)
	_, err = io.ReadFull(r.conn, b)
	require.NoError(r.t, err)
	return hdr[4], binary.LittleEndian.Uint64(b)
}

// done reports seq, failed with msg unless msg is empty, with data.
func (r scriptedRank) done(seq uint64, msg string, data []byte) {
	b := binary.LittleEndian.AppendUint64(nil, seq)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(msg)))
	r.send(5, append(append(b, msg...), data...))
}

// A report that arrives twice (contradicting itself), or late, for a seq
// already answered must change nothing: the first report of each seq
// decides, and no report completes a fill or a read it is not for.
func TestRemoteRankReportTwiceCompletedTheWrongFill(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	const pages, pb = 8, 64
	conn, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	defer conn.Close()
	rank := scriptedRank{t: t, conn: conn}
	hello := binary.LittleEndian.AppendUint32(nil, 1) // version
	hello = binary.LittleEndian.AppendUint32(hello, 0)
	hello = binary.LittleEndian.AppendUint32(hello, 1)
	hello = binary.LittleEndian.AppendUint64(hello, pages)
	hello = binary.LittleEndian.AppendUint64(hello, pb)
	rank.send(1, hello)
	d, err := cudaops.ListenRanks(l, cudaops.RemoteConfig{Ranks: 1, ReportTimeout: 10 * time.Second, AcceptTimeout: 10 * time.Second})
	require.NoError(t, err)
	defer d.Close()

	// Fill 1 fails; the rank then says it succeeded.
	f1, err := d.Fill([]int32{1}, cudaops.FillSpec{}, cudaops.Ordering{})
	require.NoError(t, err)
	kind, seq1 := rank.next()
	require.Equal(t, byte(2), kind)
	rank.done(seq1, "boom", nil)
	rank.done(seq1, "", nil)
	require.ErrorIs(t, f1.Wait(), cudaops.ErrDriver)
	require.ErrorContains(t, f1.Wait(), "boom")

	// Fill 2: a stale success of fill 1 must not complete it.
	f2, err := d.Fill([]int32{2}, cudaops.FillSpec{}, cudaops.Ordering{})
	require.NoError(t, err)
	_, seq2 := rank.next()
	rank.done(seq1, "", nil)
	// A read after it shows the stale report was read before.
	readDone := make(chan error, 1)
	go func() { readDone <- d.ReadPage(0, 3, make([]byte, pb)) }()
	_, seq3 := rank.next()
	rank.done(seq3, "", make([]byte, pb))
	require.NoError(t, <-readDone)
	done, err := f2.Done()
	assert.False(t, done, "a stale report of fill %d completed fill %d (%v)", seq1, seq2, err)
	rank.done(seq2, "", nil)
	require.NoError(t, f2.Wait())

	// A report of the read again, with a wrong shard, is not read by the
	// next read.
	rank.done(seq3, "", make([]byte, 3))
	go func() { readDone <- d.ReadPage(0, 4, make([]byte, pb)) }()
	_, seq4 := rank.next()
	rank.done(seq4, "", make([]byte, pb))
	require.NoError(t, <-readDone)
}
