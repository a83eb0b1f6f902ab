package bridge

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/kvfence/kvfence/kvcache"
)

// admissions records which of kvcache's admissions the bridge calls, and
// the deadline each AdmitInto had left.
type admissions struct {
	mu    sync.Mutex
	tries int
	waits []time.Duration
}

func recordAdmissions(t *testing.T) *admissions {
	t.Helper()
	rec := new(admissions)
	try, wait := tryAdmitInto, admitInto
	t.Cleanup(func() { tryAdmitInto, admitInto = try, wait })
	tryAdmitInto = func(p *kvcache.Pool, req kvcache.Request, l *kvcache.Lease) error {
		rec.mu.Lock()
		rec.tries++
		rec.mu.Unlock()
		return try(p, req, l)
	}
	admitInto = func(p *kvcache.Pool, ctx context.Context, req kvcache.Request, l *kvcache.Lease) error {
		dl, ok := ctx.Deadline()
		if !ok {
			// kvcache's AdmitInto waits as long as its context lives:
			// this call would block its C caller for ever on a busy pool.
			t.Errorf("AdmitInto of %q without a deadline", req.ID)
			return try(p, req, l)
		}
		rec.mu.Lock()
		rec.waits = append(rec.waits, time.Until(dl))
		rec.mu.Unlock()
		return wait(p, ctx, req, l)
	}
	return rec
}

func (rec *admissions) take() (int, []time.Duration) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	tries, waits := rec.tries, rec.waits
	rec.tries, rec.waits = 0, nil
	return tries, waits
}

// TestAdmitWaits: wait 0 (kvf_admit's wait_ms = 0) is TryAdmitInto and
// refuses a busy pool at once; a wait is AdmitInto under a deadline that
// long, and admits if pages free up in time.
func TestAdmitWaits(t *testing.T) {
	rec := recordAdmissions(t)
	p := newTestPool(t)
	// a's quota (32 pages) and 32 of b's 64: no page is free.
	must(Admit(p, "hold-a", "a", 512, 0, 0))
	hold := must(Admit(p, "hold-b", "b", 512, 0, 0))
	rec.take()

	for _, admit := range []func() (Handle, error){
		func() (Handle, error) { return Admit(p, "now", "b", 16, 0, 0) },
		func() (Handle, error) { return AdmitTokens(p, "now", "b", tokens(16, 1), 0, "", 0) },
	} {
		start := time.Now()
		_, err := admit()
		wantStatus(t, err, StatusPoolExhausted)
		if d := time.Since(start); d > 2*time.Second {
			t.Errorf("wait 0 on a busy pool took %v", d)
		}
		if tries, waits := rec.take(); tries != 1 || len(waits) != 0 {
			t.Errorf("wait 0: %d TryAdmitInto, AdmitInto with %v left; want 1 and none", tries, waits)
		}
	}

	const wait = 30 * time.Millisecond
	start := time.Now()
	_, err := Admit(p, "later", "b", 16, 0, wait)
	wantStatus(t, err, StatusPoolExhausted)
	if d := time.Since(start); d < wait {
		t.Errorf("a %v wait gave up after %v", wait, d)
	}
	if tries, waits := rec.take(); tries != 0 || len(waits) != 1 || waits[0] > wait || waits[0] <= 0 {
		t.Errorf("wait %v: %d TryAdmitInto, AdmitInto with %v left; want none and one within the wait", wait, tries, waits)
	}

	// A wait admits once pages free up during it.
	go func() {
		time.Sleep(20 * time.Millisecond)
		Free(hold)
	}()
	l, err := Admit(p, "freed", "b", 16, 0, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	noErr(t, Free(l))
	mustCheck(t, p)
}

// TestImportAdmitWait: an import into a busy decode pool waits as long as
// its receiver's admit_wait_ms, and with 0 is refused at once. The bridge
// only passes a context that is never cancelled; package handoff bounds
// the wait, so this test guards handoff's side of the contract.
func TestImportAdmitWait(t *testing.T) {
	src, dst := newTestPool(t), newTestPool(t)
	l := must(Admit(src, "imp", "a", 40, 0, 0))
	prefill(t, l, 40)
	exp := must(Export(l, testKey, 8, 0))
	t.Cleanup(func() { FreeExport(exp); Free(l) })
	n, _ := ExportManifest(exp, nil)
	m := make([]byte, n)
	must(ExportManifest(exp, m))
	hold := must(Admit(dst, "hold", "b", 1024, 0, 0)) // every page of the decode pool
	defer Free(hold)

	for _, c := range []struct {
		config string
		wait   time.Duration
	}{
		{`{"admit_wait_ms": 0}`, 0},
		{`{"admit_wait_ms": 30}`, 30 * time.Millisecond},
	} {
		recv := must(CreateReceiver(dst, testKey, []byte(c.config)))
		done := make(chan error, 1)
		start := time.Now()
		go func() {
			_, err := BeginImport(recv, m)
			done <- err
		}()
		select {
		case err := <-done:
			wantStatus(t, err, StatusPoolExhausted)
			if d := time.Since(start); d < c.wait {
				t.Errorf("%s: refused after %v", c.config, d)
			}
		case <-time.After(c.wait + 5*time.Second):
			t.Fatalf("%s: the import still waits after %v", c.config, time.Since(start))
		}
		noErr(t, DestroyReceiver(recv))
	}
	mustCheck(t, dst)
}
