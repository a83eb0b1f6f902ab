package bridge

import (
	"testing"
	"time"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/ucxx"
)

// A hybrid prompt crosses over UCX through the bridge: a receiver serves
// on an address, a transport sends the export there, and the receiver's
// lease of the request holds exactly what prefill wrote, in every group;
// it is taken once. Without UCX in the build, every call that needs it
// fails with StatusUnavailable and nothing is created.
func TestHandoffOverUCXThroughBridge(t *testing.T) {
	src, dst := must(CreatePool([]byte(hybridJSON("")))), must(CreatePool([]byte(hybridJSON(""))))
	defer DestroyPool(src)
	defer DestroyPool(dst)
	recv := must(CreateReceiver(dst, testKey, nil))
	defer DestroyReceiver(recv)
	if !UCXAvailable() {
		_, err := CreateUCXServer(recv, "127.0.0.1:0", nil)
		if got := Classify(err).Status; got != StatusUnavailable {
			t.Fatalf("a server without UCX: %v (%v)", got, err)
		}
		_, err = CreateUCXTransport("127.0.0.1:1", nil)
		if got := Classify(err).Status; got != StatusUnavailable {
			t.Fatalf("a transport without UCX: %v (%v)", got, err)
		}
		return
	}
	srv := must(CreateUCXServer(recv, "127.0.0.1:0", []byte(`{"message_timeout_ms": 30000}`)))
	defer DestroyUCXServer(srv)
	addr := must(UCXServerAddr(srv))
	tr := must(CreateUCXTransport(addr, nil))
	defer DestroyUCXTransport(tr)

	if h := must(ReceiverTake(recv, "r")); h != 0 {
		t.Fatalf("a lease taken before its import: %#x", h)
	}
	lease := prefillHybrid(t, src, "r")
	defer Free(lease)
	exp := must(Export(lease, testKey, 8, 0))
	defer FreeExport(exp)
	noErr(t, ExportSendUCX(exp, tr, 10*time.Second))
	dl := must(ReceiverTake(recv, "r"))
	if dl == 0 {
		t.Fatal("no lease after the send")
	}
	defer Free(dl)
	verifyHybrid(t, dl, "r")
	if h := must(ReceiverTake(recv, "r")); h != 0 {
		t.Fatalf("a lease taken twice: %#x", h)
	}
	// A replay is refused with the receiver's reason.
	if err := ExportSendUCX(exp, tr, 10*time.Second); Classify(err).Status != StatusReclaimed && Classify(err).Status != StatusReplay {
		t.Fatalf("a second send of an acked export: %v (%v)", Classify(err).Status, err)
	}
}

// Each data_path names its handoff/ucxx DataPath.
func TestUCXDataPaths(t *testing.T) {
	for j, want := range map[string]ucxx.DataPath{
		``: ucxx.PathAuto, `{"data_path": "auto"}`: ucxx.PathAuto, `{"data_path": "messages"}`: ucxx.PathMessages,
	} {
		o, err := ParseUCXOptions([]byte(j))
		if err != nil || o.DataPath != want {
			t.Errorf("options %s: %v, %v; want %v", j, o.DataPath, err, want)
		}
	}
}

// Bad options and handles are refused with their statuses.
func TestUCXRefusals(t *testing.T) {
	for _, j := range []string{`{"data_path": "rdma"}`, `{"max_conns": -1}`, `{"unknown": 1}`, `{} {}`} {
		if _, err := CreateUCXTransport("127.0.0.1:1", []byte(j)); Classify(err).Status != StatusInvalidConfig {
			t.Errorf("options %s: %v (%v)", j, Classify(err).Status, err)
		}
	}
	for _, err := range []error{
		func() error { _, err := CreateUCXServer(12345, "127.0.0.1:0", nil); return err }(),
		func() error { _, err := UCXServerAddr(12345); return err }(),
		DestroyUCXServer(12345), DestroyUCXTransport(12345),
		ExportSendUCX(12345, 12345, 0),
		func() error { _, err := ReceiverTake(12345, "r"); return err }(),
	} {
		if Classify(err).Status != StatusInvalidHandle {
			t.Errorf("%v: want an invalid handle", err)
		}
	}
	if got := Classify(ucxx.ErrUnavailable).Status; got != StatusUnavailable {
		t.Errorf("ErrUnavailable classifies as %v", got)
	}
	if got := Classify(&handoff.RefusedError{Reason: handoff.ErrBadMAC}).Status; got != StatusBadMAC {
		t.Errorf("a refusal for a bad MAC classifies as %v", got)
	}
}
