package kvcache

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
)

func TestAdmitRefusesBadRequestsAndChangesNothing(t *testing.T) {
	p := newPool(t, tinyConfig(16, TenantConfig{Name: "a", QuotaPages: 8}, TenantConfig{Name: "b"}))
	live := admit(t, p, "live", "a", 8) // 2 pages
	cases := []struct {
		name string
		req  Request
		want error
	}{
		{"empty ID", Request{Tenant: "a", PromptTokens: 1}, ErrInvalidRequest},
		{"long ID", Request{ID: strings.Repeat("x", MaxIDLen+1), Tenant: "a", PromptTokens: 1}, ErrInvalidRequest},
		{"empty tenant", Request{ID: "r", PromptTokens: 1}, ErrInvalidRequest},
		{"zero prompt", Request{ID: "r", Tenant: "a"}, ErrInvalidRequest},
		{"negative prompt", Request{ID: "r", Tenant: "a", PromptTokens: -3}, ErrInvalidRequest},
		{"negative output", Request{ID: "r", Tenant: "a", PromptTokens: 3, MaxNewTokens: -1}, ErrInvalidRequest},
		{"overflowing sum", Request{ID: "r", Tenant: "a", PromptTokens: math.MaxInt - 2, MaxNewTokens: 5}, ErrInvalidRequest},
		{"unknown tenant", Request{ID: "r", Tenant: "zed", PromptTokens: 1}, ErrUnknownTenant},
		{"duplicate ID", Request{ID: "live", Tenant: "b", PromptTokens: 1}, ErrDuplicateRequest},
		{"over max context", Request{ID: "r", Tenant: "b", PromptTokens: 60, MaxNewTokens: 5}, ErrExceedsMaxContext},
		{"over quota forever", Request{ID: "r", Tenant: "a", PromptTokens: 33}, ErrExceedsQuota},
		{"over quota now", Request{ID: "r", Tenant: "a", PromptTokens: 25}, ErrExceedsQuota},
		{"pool exhausted", Request{ID: "r", Tenant: "b", PromptTokens: 57}, ErrPoolExhausted},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := state(p)
			l, err := p.TryAdmit(tc.req)
			assert.Nil(t, l)
			require.ErrorIs(t, err, tc.want)
			var ae *AdmissionError
			require.ErrorAs(t, err, &ae)
			assert.Equal(t, tc.req.ID, ae.RequestID)
			assert.Equal(t, before, state(p), "a refused admission changed the pool")
			require.NoError(t, p.Check())
		})
	}
	assert.Equal(t, uint64(len(cases)), p.Stats().Refused.Total())
	assert.True(t, live.Live())
}

func TestAdmissionErrorsNameTheNumbers(t *testing.T) {
	p := newPool(t, tinyConfig(16, TenantConfig{Name: "a", QuotaPages: 6}, TenantConfig{Name: "b"}))
	admit(t, p, "x", "a", 16) // 4 pages of a's 6
	_, err := p.TryAdmit(Request{ID: "y", Tenant: "a", PromptTokens: 12})
	var ae *AdmissionError
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, AdmissionError{Err: ErrExceedsQuota, RequestID: "y", Tenant: "a", Need: 3, Have: 2, Limit: 6}, *ae)
	assert.True(t, ae.Retryable())
	assert.Equal(t, `isolation: tenant quota exceeded: request "y" of tenant "a" needs 3 pages, 2 left of quota 6`, err.Error())

	admit(t, p, "z", "b", 40) // 10 pages: 2 free
	_, err = p.TryAdmit(Request{ID: "w", Tenant: "b", PromptTokens: 12})
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, ErrPoolExhausted, ae.Err)
	assert.Equal(t, 3, ae.Need)
	assert.Equal(t, 2, ae.Have)
	assert.Equal(t, 16, ae.Limit)
}

func TestReservationsKeepPagesForTheirTenant(t *testing.T) {
	p := newPool(t, tinyConfig(10, TenantConfig{Name: "gold", ReservedPages: 4}, TenantConfig{Name: "free"}))
	admit(t, p, "f1", "free", 24) // 6 pages: all that is not reserved
	_, err := p.TryAdmit(Request{ID: "f2", Tenant: "free", PromptTokens: 1})
	require.ErrorIs(t, err, ErrPoolExhausted)
	assert.ErrorIs(t, err, isolation.ErrReserved)
	g := admit(t, p, "g1", "gold", 16) // the reserved 4
	assert.Equal(t, 4, g.Pages())
	assert.Equal(t, 0, p.Stats().FreePages)
}

func TestLeaseLifecycle(t *testing.T) {
	p := newPool(t, tinyConfig(16))
	l, err := p.TryAdmit(Request{ID: "r1", Tenant: "a", PromptTokens: 5, MaxNewTokens: 6})
	require.NoError(t, err)
	assert.Equal(t, "r1", l.ID())
	assert.Equal(t, "a", l.Tenant())
	assert.Equal(t, 3, l.Pages(), "11 tokens at 4 per page")
	assert.Equal(t, 12, l.CapacityTokens())
	bt, err := l.BlockTable()
	require.NoError(t, err)
	assert.Equal(t, []int32{0, 1, 2}, bt)
	bt[0] = 99 // a copy: the lease is unaffected
	bt2, _ := l.AppendBlockTable(make([]int32, 0, 8))
	assert.Equal(t, []int32{0, 1, 2}, bt2)

	slots, err := l.SlotMapping(3, 6, nil)
	require.NoError(t, err)
	assert.Equal(t, []int64{3, 4, 5}, slots)
	_, err = l.SlotMapping(10, 13, nil)
	assert.ErrorIs(t, err, ErrInvalidArgument)
	_, err = l.SlotMapping(4, 3, nil)
	assert.ErrorIs(t, err, ErrInvalidArgument)

	require.NoError(t, l.Commit(5))
	require.NoError(t, l.Commit(5), "idempotent")
	assert.ErrorIs(t, l.Commit(4), ErrInvalidArgument, "backwards")
	assert.ErrorIs(t, l.Commit(12), ErrInvalidArgument, "past prompt + max new")
	require.NoError(t, l.Commit(11))
	assert.Equal(t, 11, l.Written())

	require.NoError(t, l.Release())
	require.NoError(t, p.Check())
	assert.False(t, l.Live())
	for name, err := range map[string]error{
		"release":      l.Release(),
		"commit":       l.Commit(11),
		"block table":  func() error { _, err := l.BlockTable(); return err }(),
		"slot mapping": func() error { _, err := l.SlotMapping(0, 1, nil); return err }(),
	} {
		assert.ErrorIs(t, err, ErrLeaseReleased, name)
	}
	s := p.Stats()
	assert.Equal(t, 16, s.FreePages)
	// The pool's creation scrubbed all 16 pages once, the release 3 more.
	assert.Equal(t, uint64(16+3), s.Scrub.PagesScrubbed)
	assert.Equal(t, uint64((16+3)*tinyGeometry.PageBytes()), s.Scrub.BytesScrubbed)
	assert.Equal(t, uint64(2), s.Scrub.Fills)

	// The ID is free again once released.
	admit(t, p, "r1", "b", 1)
	var zero Lease
	assert.ErrorIs(t, zero.Release(), ErrInvalidArgument)
	assert.ErrorIs(t, zero.Commit(1), ErrInvalidArgument)
}

func TestAdmitIntoReusesLeaseStorage(t *testing.T) {
	p := newPool(t, tinyConfig(16))
	var l Lease
	require.NoError(t, p.TryAdmitInto(Request{ID: "a1", Tenant: "a", PromptTokens: 8}, &l))
	assert.ErrorIs(t, p.TryAdmitInto(Request{ID: "a2", Tenant: "a", PromptTokens: 8}, &l), ErrInvalidArgument,
		"a live lease cannot be overwritten")
	require.NoError(t, l.Release())
	require.NoError(t, p.TryAdmitInto(Request{ID: "a2", Tenant: "b", PromptTokens: 12}, &l))
	assert.Equal(t, "a2", l.ID())
	assert.Equal(t, 3, l.Pages())
	require.NoError(t, p.Check())
	assert.ErrorIs(t, p.TryAdmitInto(Request{ID: "x", Tenant: "a", PromptTokens: 1}, nil), ErrInvalidArgument)
}

func TestAdmitWaitsForPagesUntilDeadline(t *testing.T) {
	p := newPool(t, tinyConfig(8))
	hog := admit(t, p, "hog", "a", 32)

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err := p.Admit(ctx, Request{ID: "late", Tenant: "b", PromptTokens: 4})
	require.ErrorIs(t, err, ErrPoolExhausted)
	assert.ErrorIs(t, err, context.DeadlineExceeded)

	got := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		l, err := p.Admit(ctx, Request{ID: "waiter", Tenant: "b", PromptTokens: 8})
		if err == nil && l.Pages() != 2 {
			err = errors.New("wrong page count")
		}
		got <- err
	}()
	time.Sleep(10 * time.Millisecond)
	require.NoError(t, hog.Release())
	require.NoError(t, <-got)
	require.NoError(t, p.Check())
}

func TestAdmitWaitsForQuota(t *testing.T) {
	p := newPool(t, tinyConfig(16, TenantConfig{Name: "a", QuotaPages: 2}))
	first := admit(t, p, "one", "a", 8)
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := p.Admit(ctx, Request{ID: "two", Tenant: "a", PromptTokens: 8})
		done <- err
	}()
	time.Sleep(10 * time.Millisecond)
	require.NoError(t, first.Release())
	require.NoError(t, <-done)
	require.NoError(t, p.Check())
}

func TestCloseReleasesLeasesAndWakesWaiters(t *testing.T) {
	p, err := New(tinyConfig(8))
	require.NoError(t, err)
	l := admit(t, p, "hog", "a", 32)
	waiting := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := p.Admit(ctx, Request{ID: "w", Tenant: "b", PromptTokens: 4})
		waiting <- err
	}()
	time.Sleep(10 * time.Millisecond)
	require.NoError(t, p.Close())
	assert.ErrorIs(t, <-waiting, ErrPoolClosed)
	assert.ErrorIs(t, l.Release(), ErrPoolClosed)
	assert.False(t, l.Live())
	_, err = p.TryAdmit(Request{ID: "after", Tenant: "a", PromptTokens: 1})
	assert.ErrorIs(t, err, ErrPoolClosed)
	assert.ErrorIs(t, p.AddTenant(TenantConfig{Name: "c"}), ErrPoolClosed)
	assert.ErrorIs(t, p.Close(), ErrPoolClosed)
	s := p.Stats()
	assert.True(t, s.Closed)
	assert.Equal(t, 8, s.FreePages, "Close scrubbed the live lease's pages")
	require.NoError(t, p.Check())
}

func TestTenantsAddedAndUpdated(t *testing.T) {
	p := newPool(t, tinyConfig(16))
	require.NoError(t, p.AddTenant(TenantConfig{Name: "c", QuotaPages: 1}))
	assert.ErrorIs(t, p.AddTenant(TenantConfig{Name: "c"}), isolation.ErrDuplicateTenant)
	_, err := p.TryAdmit(Request{ID: "r", Tenant: "c", PromptTokens: 8})
	require.ErrorIs(t, err, ErrExceedsQuota)
	require.NoError(t, p.UpdateTenant(TenantConfig{Name: "c", QuotaPages: 2}))
	admit(t, p, "r", "c", 8)
	assert.ErrorIs(t, p.UpdateTenant(TenantConfig{Name: "nope"}), ErrUnknownTenant)
}

func TestConcurrentAdmitRelease(t *testing.T) {
	p := newPool(t, tinyConfig(64, TenantConfig{Name: "a", QuotaPages: 40}, TenantConfig{Name: "b", ReservedPages: 8}, TenantConfig{Name: "c"}))
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			tenant := []string{"a", "b", "c"}[w%3]
			for i := range 200 {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				l, err := p.Admit(ctx, Request{ID: tenant + string(rune('A'+w)) + string(rune('0'+i%10)), Tenant: tenant, PromptTokens: 1 + (i*7)%30})
				cancel()
				if err != nil {
					var ae *AdmissionError
					if !errors.As(err, &ae) || !ae.Retryable() {
						t.Errorf("unexpected refusal: %v", err)
					}
					continue
				}
				if err := l.Release(); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	require.NoError(t, p.Check())
	s := p.Stats()
	assert.Equal(t, 64, s.FreePages)
	assert.Equal(t, 0, s.LiveLeases)
}

func TestFailedFillRetiresPagesAndFaultsPool(t *testing.T) {
	for _, mode := range []string{"issue", "fence"} {
		t.Run(mode, func(t *testing.T) {
			dev := newScripted()
			cfg := tinyConfig(8)
			cfg.Device = dev
			p := newPool(t, cfg)
			l := admit(t, p, "r", "a", 8)
			boom := errors.New("device lost")
			if mode == "issue" {
				dev.mu.failNext = boom
			} else {
				dev.mu.failFence = boom
			}
			err := l.Release()
			require.ErrorIs(t, err, ErrPoolFaulted)
			require.ErrorIs(t, err, ErrScrubFailed)
			assert.ErrorIs(t, err, boom)
			s := p.Stats()
			assert.Equal(t, 2, s.RetiredPages)
			assert.Equal(t, 6, s.FreePages)
			assert.NotEmpty(t, s.Fault)
			require.NoError(t, p.Check())

			_, err = p.TryAdmit(Request{ID: "next", Tenant: "b", PromptTokens: 1})
			require.ErrorIs(t, err, ErrPoolFaulted, "a faulted pool admits nothing")
			p.ClearFault()
			require.NoError(t, p.Fault())
			_, err = p.TryAdmit(Request{ID: "big", Tenant: "b", PromptTokens: 32})
			require.ErrorIs(t, err, ErrExceedsCapacity, "retired pages left service")
			admit(t, p, "next", "b", 24)
		})
	}
}

func TestPagesWaitForAsynchronousFill(t *testing.T) {
	dev := newScripted()
	cfg := tinyConfig(4)
	cfg.Device = dev
	p := newPool(t, cfg)
	dev.mu.hold = true // after New, whose initial scrub must complete
	l := admit(t, p, "r", "a", 16)
	order := cudaops.Ordering{Stream: 0x1234, Event: 0x5678}
	require.NoError(t, l.ReleaseAfter(order))
	assert.Equal(t, order, dev.mu.orders[len(dev.mu.orders)-1], "the engine's stream reached the device")
	s := p.Stats()
	assert.Equal(t, 4, s.QuarantinedPages)
	assert.Equal(t, 0, s.FreePages)
	require.NoError(t, p.Check())
	_, err := p.TryAdmit(Request{ID: "early", Tenant: "b", PromptTokens: 1})
	require.ErrorIs(t, err, ErrPoolExhausted, "pages handed out before their fill completed")

	got := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := p.Admit(ctx, Request{ID: "patient", Tenant: "b", PromptTokens: 16})
		got <- err
	}()
	time.Sleep(10 * time.Millisecond)
	dev.complete()
	require.NoError(t, <-got)
	require.NoError(t, p.Check())
}

func TestCanaryCatchesWriteAfterFree(t *testing.T) {
	cfg := tinyConfig(4)
	cfg.Scrub = ScrubPolicy{Kind: ScrubCanary}
	p := newPool(t, cfg)
	h := hostOf(t, p)
	l := admit(t, p, "victim", "a", 16)
	bt, _ := l.BlockTable()
	require.NoError(t, l.Release())
	h.PageBytes(3, bt[2])[10] ^= 0xff // a stale writer touches a freed page

	_, err := p.TryAdmit(Request{ID: "next", Tenant: "b", PromptTokens: 16})
	require.ErrorIs(t, err, ErrCanaryMismatch)
	require.ErrorIs(t, err, ErrPoolFaulted)
	var ce *isolation.CanaryError
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, bt[2], ce.Page)
	assert.Equal(t, 3, ce.Region)
	assert.Equal(t, int64(8), ce.Offset)
	assert.Equal(t, "tenant:a", ce.PrevOwner, "pages belong to sharing domains; a tenant's own is tenant:NAME")
	assert.Equal(t, uint32(1), ce.Gen)
	s := p.Stats()
	assert.Equal(t, 1, s.RetiredPages)
	assert.Equal(t, 3, s.FreePages)
	assert.Equal(t, uint64(1), s.Scrub.CanaryFailures)
	require.NoError(t, p.Check())
	p.ClearFault()
	admit(t, p, "after", "b", 12)
}
