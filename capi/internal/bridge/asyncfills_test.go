package bridge

import (
	"testing"
	"time"

	"github.com/kvfence/kvfence/cudaops"
)

// A host pool with "async_fills" hands the pool a host device whose
// scrubs end after Release returns: the pages come back once they have,
// the pool stays consistent, and the device is the pool's to close.
func TestHostAsyncFillsThroughTheBridge(t *testing.T) {
	p, err := CreatePool([]byte(`{` + geom + `, "pages": 64, "max_context_tokens": 1024,
		"tenants": [{"name": "a"}], "device": {"kind": "host", "async_fills": true}}`))
	if err != nil {
		t.Fatal(err)
	}
	pe, err := lookupPool(p)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := pe.device.(*cudaops.Host); !ok {
		t.Fatalf("device %T, want the asynchronous *cudaops.Host", pe.device)
	}
	for i := range 20 {
		l, err := Admit(p, "r", "a", 1024, 0, time.Minute) // the whole pool: waits for the last release's scrub
		if err != nil {
			t.Fatalf("admission %d: %v", i, err)
		}
		if err := Release(l, cudaops.Ordering{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := pe.pool.Check(); err != nil {
		t.Fatal(err)
	}
	if err := DestroyPool(p); err != nil {
		t.Fatal(err)
	}
}
