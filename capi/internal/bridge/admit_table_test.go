package bridge

import (
	"bytes"
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/kvfence/kvfence/kvcache"
)

// AdmitTokensTable (kvf_admit_tokens_table, ABI 6): an admission by token
// IDs that writes the block table in the same call.

// untouched is a table buffer of n entries no block table can hold.
func untouched(n int) []int32 {
	b := make([]int32, n)
	for i := range b {
		b[i] = -7
	}
	return b
}

func allUntouched(b []int32) bool {
	return !slices.ContainsFunc(b, func(v int32) bool { return v != -7 })
}

// statsOf is the pool's whole stats document, to compare before and after.
func statsOf(t *testing.T, p Handle) []byte {
	t.Helper()
	js, err := StatsJSON(p)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// TestAdmitTokensTableWritesTheLeasesOwnTable: the table written at
// admission is the one kvf_lease_block_table reads afterwards, its length
// is the lease's pages, and nothing after it is written; a prefix hit
// shows in it as the shared pages.
func TestAdmitTokensTableWritesTheLeasesOwnTable(t *testing.T) {
	p := newTestPool(t)
	prompt := tokens(100, 3) // 7 pages with 28 new tokens (128 tokens: 8 pages)
	buf := untouched(12)
	l, n, err := AdmitTokensTable(p, "r1", "a", prompt, 28, "", 0, buf)
	if err != nil || n != 8 {
		t.Fatalf("AdmitTokensTable = %d pages, %v; want 8", n, err)
	}
	want := make([]int32, 8)
	if m, err := BlockTable(l, want); err != nil || m != 8 {
		t.Fatalf("BlockTable = %d, %v", m, err)
	}
	if !slices.Equal(buf[:8], want) || !allUntouched(buf[8:]) {
		t.Fatalf("table %v, the lease's %v", buf, want)
	}
	mustCheck(t, p)

	noErr(t, Commit(l, 100))
	if shared := must(CachePrefix(l, 100)); shared != 96 {
		t.Fatalf("published %d tokens", shared)
	}
	buf2 := untouched(8)
	l2, n2, err := AdmitTokensTable(p, "r2", "a", prompt, 28, "", 0, buf2)
	if err != nil || n2 != 8 {
		t.Fatalf("second admission: %d, %v", n2, err)
	}
	if hit := must(HitTokens(l2)); hit != 96 || !slices.Equal(buf2[:6], want[:6]) || slices.Equal(buf2[6:], want[6:]) {
		t.Fatalf("hit %d tokens, table %v against the first's %v", hit, buf2, want)
	}
	noErr(t, Free(l))
	noErr(t, Free(l2))
	mustCheck(t, p)
}

// TestAdmitTokensTableOnDemandLeaseFillsPartOfItsBound: an on-demand
// lease must be given room for the most it can grow to, and its table,
// shorter at admission, leaves the rest of that room untouched.
func TestAdmitTokensTableOnDemandLeaseFillsPartOfItsBound(t *testing.T) {
	p := must(CreatePool([]byte(growthPool))) // 4 tokens per page, headroom 2, max context 64
	defer DestroyPool(p)
	// 6 + 40 tokens: 12 pages at most; 6 + 2 reserved: 2 pages now.
	_, need, err := AdmitTokensTable(p, "r", "a", tokens(6, 1), 40, "", 0, untouched(11))
	wantStatus(t, err, StatusBufferTooSmall)
	if need != 12 {
		t.Fatalf("need %d pages, want 12 (prompt + max new)", need)
	}
	buf := untouched(12)
	l, n, err := AdmitTokensTable(p, "r", "a", tokens(6, 1), 40, "", 0, buf)
	if err != nil || n != 2 || allUntouched(buf[:2]) || !allUntouched(buf[2:]) {
		t.Fatalf("on-demand admission: %d pages, %v, table %v", n, err, buf)
	}
	noErr(t, Free(l))
	mustCheck(t, p)
}

// TestAdmitTokensTableShortBufferAdmitsNothing: a table one page short,
// or none (the size query), is refused before admission with the size
// needed, the buffer unwritten and the pool's stats byte for byte as
// they were: no lease, no refusal counted, the request ID still free.
func TestAdmitTokensTableShortBufferAdmitsNothing(t *testing.T) {
	p := newTestPool(t)
	prompt := tokens(100, 3)
	before := statsOf(t, p)
	for _, buf := range [][]int32{untouched(7), nil} {
		l, need, err := AdmitTokensTable(p, "r1", "a", prompt, 28, "", 0, buf)
		wantStatus(t, err, StatusBufferTooSmall)
		if info := Classify(err); l != 0 || need != 8 || info.Need != 8 || info.Have != int64(len(buf)) {
			t.Fatalf("short table of %d: lease %d, need %d, info %+v", len(buf), l, need, info)
		}
		if !allUntouched(buf) {
			t.Fatalf("short table written: %v", buf)
		}
		if after := statsOf(t, p); !bytes.Equal(after, before) {
			t.Fatalf("the pool changed:\n%s\n%s", before, after)
		}
		mustCheck(t, p)
	}
	l, n, err := AdmitTokensTable(p, "r1", "a", prompt, 28, "", 0, untouched(8))
	if err != nil || n != 8 {
		t.Fatalf("exact table: %d, %v", n, err)
	}
	noErr(t, Free(l))
}

// TestAdmitTokensTableRefusesAsAdmitTokens: every refusal is the one
// AdmitTokens gives, with its numbers, nothing admitted and the table
// unwritten; a request the admission refuses whatever the table (no
// tokens, negative max new, past the max context) gets that refusal even
// with a short table, not BufferTooSmall.
func TestAdmitTokensTableRefusesAsAdmitTokens(t *testing.T) {
	p := newTestPool(t)
	held := must(Admit(p, "held", "a", 16, 0, 0))                      // 1 of a's 32 quota pages, 1 of the pool's 64
	dup := must(AdmitTokens(p, "r-dup", "b", tokens(16, 1), 0, "", 0)) // 62 pages left free
	for _, c := range []struct {
		name   string
		pool   Handle
		id     string
		tenant string
		toks   []int32
		maxNew int64
		wait   time.Duration
		table  int
		want   Status
		need   int64
	}{
		{"forged pool", ^Handle(0), "r", "a", tokens(16, 1), 0, 0, 64, StatusInvalidHandle, 0},
		{"negative wait", p, "r", "a", tokens(16, 1), 0, -time.Millisecond, 0, StatusInvalidArgument, 0},
		{"no tokens, short table", p, "r", "a", nil, 10, 0, 0, StatusInvalidRequest, 0},
		{"negative max new, short table", p, "r", "a", tokens(16, 1), -1, 0, 0, StatusInvalidRequest, 0},
		{"past max context, short table", p, "r", "a", tokens(1000, 1), 25, 0, 0, StatusExceedsMaxContext, 1025},
		{"max new overflowing, short table", p, "r", "a", tokens(16, 1), 1 << 62, 0, 0, StatusInvalidRequest, 0},
		{"empty ID", p, "", "a", tokens(16, 1), 0, 0, 64, StatusInvalidRequest, 0},
		{"unknown tenant", p, "r", "zed", tokens(16, 1), 0, 0, 64, StatusUnknownTenant, 0},
		{"duplicate request", p, "r-dup", "b", tokens(16, 1), 0, 0, 64, StatusDuplicateRequest, 0},
		{"over quota", p, "r", "a", tokens(500, 1), 20, 0, 64, StatusExceedsQuota, 33},
		{"pool exhausted", p, "r", "b", tokens(1000, 1), 24, 0, 64, StatusPoolExhausted, 64},
	} {
		t.Run(c.name, func(t *testing.T) {
			buf := untouched(c.table)
			l, n, err := AdmitTokensTable(c.pool, c.id, c.tenant, c.toks, c.maxNew, "", c.wait, buf)
			wantStatus(t, err, c.want)
			if l != 0 || n != 0 || !allUntouched(buf) {
				t.Fatalf("refused admission: lease %d, length %d, table %v", l, n, buf)
			}
			_, plain := AdmitTokens(c.pool, c.id, c.tenant, c.toks, c.maxNew, "", c.wait)
			if got, want := Classify(err), Classify(plain); got.Status != want.Status || got.Need != want.Need ||
				got.Have != want.Have || got.Limit != want.Limit {
				t.Fatalf("refusal %+v, AdmitTokens's %+v", got, want)
			}
			if c.need != 0 && Classify(err).Need != c.need {
				t.Fatalf("need %d, want %d", Classify(err).Need, c.need)
			}
		})
	}
	var doc StatsDoc
	if err := json.Unmarshal(statsOf(t, p), &doc); err != nil {
		t.Fatal(err)
	}
	if doc.LiveLeases != 2 || doc.Admitted != 2 {
		t.Fatalf("after the refusals: %d live leases, %d admitted; want the 2 held", doc.LiveLeases, doc.Admitted)
	}
	noErr(t, Free(held))
	noErr(t, Free(dup))
	mustCheck(t, p)
}

// TestAdmitTokensTableRacingDestroyAdmitsNothing: a pool destroyed
// between the admission and the table's copy (the only thing that can end
// a lease before its handle exists) gives PoolClosed, no handle and an
// unwritten table, not a lease whose table call then fails.
func TestAdmitTokensTableRacingDestroyAdmitsNothing(t *testing.T) {
	p := newTestPool(t)
	try := tryAdmitInto
	t.Cleanup(func() { tryAdmitInto = try })
	tryAdmitInto = func(pool *kvcache.Pool, req kvcache.Request, l *kvcache.Lease) error {
		err := try(pool, req, l)
		if err == nil {
			pool.Close() // as kvf_pool_destroy on another thread would
		}
		return err
	}
	buf := untouched(8)
	l, n, err := AdmitTokensTable(p, "r", "a", tokens(100, 1), 28, "", 0, buf)
	wantStatus(t, err, StatusPoolClosed)
	if l != 0 || n != 0 || !allUntouched(buf) {
		t.Fatalf("admission into a destroyed pool: lease %d, length %d, table %v", l, n, buf)
	}
}
