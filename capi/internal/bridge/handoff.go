package bridge

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/kvcache"
)

// Handoff through C: the caller moves the bytes (package handoff's
// transport-free API). Exports, receivers and imports are handles like
// pools and leases, from the same counter.

var (
	exports   sync.Map // Handle → *handoff.Export
	receivers sync.Map // Handle → *receiverEntry
	imports   sync.Map // Handle → *importEntry
)

type receiverEntry struct {
	pool *poolEntry
	r    *handoff.Receiver
}

type importEntry struct {
	pool *poolEntry
	imp  *handoff.Import
}

func invalid(h Handle, kind string) error {
	return fmt.Errorf("%w: %#x is not a live %s", ErrInvalidHandle, h, kind)
}

func lookupExport(h Handle) (*handoff.Export, error) {
	if v, ok := exports.Load(h); ok {
		return v.(*handoff.Export), nil
	}
	return nil, invalid(h, "export")
}

func lookupImport(h Handle) (*importEntry, error) {
	if v, ok := imports.Load(h); ok {
		return v.(*importEntry), nil
	}
	return nil, invalid(h, "import")
}

// TransferInfo describes an export or an import (kvf_transfer_info).
type TransferInfo struct {
	Pages, PageBytes, PromptTokens, MaxNewTokens int64
	Checksum                                     uint32
	Live                                         bool
}

// transferInfo describes a transfer: Pages are the per-token group's
// units (the transfer's first), each PageBytes long.
func transferInfo(m handoff.Manifest, pageBytes int, live bool) TransferInfo {
	return TransferInfo{Pages: int64(m.Extents[0].Units), PageBytes: int64(pageBytes), PromptTokens: int64(m.PromptTokens),
		MaxNewTokens: int64(m.MaxNewTokens), Checksum: m.Checksum, Live: live}
}

// Export pins a prefilled lease's prompt pages and signs their manifest
// with key. maxNewTokens is what the decode pool must reserve; the
// manifest is valid for ttl (0: 30 s) and the pages stay pinned until
// ExportAck, ExportAbort or 2×ttl. The manifest names the lease's sharing
// domain; the decode pool refuses it unless the tenant is in that domain
// there too.
func Export(lease Handle, key []byte, maxNewTokens int64, ttl time.Duration) (Handle, error) {
	if ttl < 0 {
		return 0, fmt.Errorf("%w: negative TTL %v", kvcache.ErrInvalidArgument, ttl)
	}
	k, err := handoff.NewKey(key)
	if err != nil {
		return 0, err
	}
	var exp *handoff.Export
	err = withLeaseEntry(lease, func(e *leaseEntry) error {
		l := e.mu.lease
		s, err := handoff.NewSender(handoff.SenderConfig{Key: k, TTL: ttl})
		if err != nil {
			return err
		}
		// From here the export's reclaim timer may refer to the lease
		// after Free: it must never serve another admission.
		e.mu.noRecycle = true
		if exp, err = s.Export(l, clampInt(maxNewTokens)); err != nil {
			return err
		}
		// The C caller moves the bytes itself: it needs the manifest
		// with the checksum, which takes a pass over the pages. Made now,
		// the manifest and the description never fail later.
		if _, err = exp.ManifestBytes(); err != nil {
			exp.Abort()
		}
		return err
	})
	if err != nil {
		return 0, err
	}
	h := nextHandle.Add(1)
	exports.Store(h, exp)
	return h, nil
}

// ExportManifest copies the signed manifest, with the content checksum
// Export computed, into dst and returns its length; a short dst gets
// nothing and a *BufferError.
func ExportManifest(h Handle, dst []byte) (int, error) {
	exp, err := lookupExport(h)
	if err != nil {
		return 0, err
	}
	b, err := exp.ManifestBytes()
	if err != nil {
		return 0, err
	}
	if len(dst) < len(b) {
		return len(b), &BufferError{What: "manifest (bytes)", Need: len(b), Have: len(dst)}
	}
	copy(dst, b)
	return len(b), nil
}

// DescribeExport reports what an export holds.
func DescribeExport(h Handle) (TransferInfo, error) {
	exp, err := lookupExport(h)
	if err != nil {
		return TransferInfo{}, err
	}
	m := exp.Manifest()
	if sum, err := exp.Checksum(); err == nil { // computed by Export: cached
		m.Checksum, m.ChecksumSealed = sum, false
	}
	return transferInfo(m, exp.PageBytes(), exp.Live()), nil
}

// pageRange checks a caller's run of pages, n bytes from page first,
// against a transfer of pages pages of pageBytes bytes each, and returns
// first as an int. The run must be a positive whole number of pages that
// starts and ends within the transfer. The arithmetic is done on int64
// values that cannot overflow, whatever first and n are, so that nothing
// reaches kvcache whose sum with a page count could wrap around: first =
// INT64_MAX used to pass kvcache's check as a negative end and panic on a
// slice bound. A refusal names the numbers and has changed nothing.
func pageRange(op string, first int64, n, pages, pageBytes int) (int, error) {
	total, pb, size := int64(pages), int64(pageBytes), int64(n)
	if size <= 0 || pb <= 0 || size%pb != 0 {
		return 0, fmt.Errorf("%w: %s of %d bytes at page %d: not a positive multiple of the page size, %d bytes",
			kvcache.ErrInvalidArgument, op, n, first, pageBytes)
	}
	if count := size / pb; first < 0 || first >= total || count > total-first {
		return 0, fmt.Errorf("%w: %s of %d pages (%d bytes) at page %d: outside pages 0..%d of the transfer",
			kvcache.ErrInvalidArgument, op, count, n, first, total-1)
	}
	return int(first), nil
}

// ExportReadPages copies exported pages first, first+1, … of the
// per-token group (the transfer's first units) into dst, a whole number
// of pages within the export. A bad range is refused before
// the export is touched: nothing is copied and the export is unchanged.
func ExportReadPages(h Handle, first int64, dst []byte) error {
	exp, err := lookupExport(h)
	if err != nil {
		return err
	}
	f, err := pageRange("read", first, len(dst), exp.Manifest().Extents[0].Units, exp.PageBytes())
	if err != nil {
		return err
	}
	return exp.ReadUnits(f, dst)
}

// ExportAck ends the export after the decode side confirmed the import.
func ExportAck(h Handle) error {
	exp, err := lookupExport(h)
	if err != nil {
		return err
	}
	return exp.Ack()
}

// ExportAbort releases the exported pages through the scrubber now.
func ExportAbort(h Handle) error {
	exp, err := lookupExport(h)
	if err != nil {
		return err
	}
	return exp.Abort()
}

// FreeExport aborts the export if its pages are still pinned (nobody can
// ack it any more) and invalidates the handle.
func FreeExport(h Handle) error {
	v, ok := exports.LoadAndDelete(h)
	if !ok {
		return invalid(h, "export")
	}
	err := v.(*handoff.Export).Abort()
	if errors.Is(err, kvcache.ErrPoolClosed) {
		err = nil // the pool's Close released the pages already
	}
	return err
}

// ReceiverJSON is the receiver config kvf_receiver_create takes; every
// field is optional (handoff.ReceiverConfig's defaults).
type ReceiverJSON struct {
	MaxTTLMS          int64 `json:"max_ttl_ms,omitempty"`
	AdmitWaitMS       int64 `json:"admit_wait_ms,omitempty"`
	TransferTimeoutMS int64 `json:"transfer_timeout_ms,omitempty"`
}

// ms converts a config's milliseconds (checked not negative, or -1 for
// the callee to refuse) into a Duration, saturating at 2^62 ns (146
// years) rather than wrapping around for values whose nanoseconds do not
// fit in an int64.
func ms(v int64) time.Duration {
	if v < 0 {
		return -1
	}
	return time.Duration(min(v, int64(1<<62)/int64(time.Millisecond))) * time.Millisecond
}

// ParseReceiverConfig decodes a ReceiverJSON; empty data means defaults.
// Errors wrap handoff.ErrInvalidConfig.
func ParseReceiverConfig(data []byte) (handoff.ReceiverConfig, error) {
	var rj ReceiverJSON
	if len(bytes.TrimSpace(data)) > 0 {
		if len(data) > MaxJSONBytes {
			return handoff.ReceiverConfig{}, fmt.Errorf("%w: receiver JSON of %d bytes", handoff.ErrInvalidConfig, len(data))
		}
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&rj); err != nil {
			return handoff.ReceiverConfig{}, fmt.Errorf("%w: receiver JSON: %v", handoff.ErrInvalidConfig, err)
		}
		if _, err := dec.Token(); !errors.Is(err, io.EOF) {
			return handoff.ReceiverConfig{}, fmt.Errorf("%w: receiver JSON: trailing data after the object", handoff.ErrInvalidConfig)
		}
	}
	return handoff.ReceiverConfig{MaxTTL: ms(rj.MaxTTLMS), AdmitWait: ms(rj.AdmitWaitMS), TransferTimeout: ms(rj.TransferTimeoutMS)}, nil
}

// CreateReceiver makes a receiver that imports into pool, verifying
// manifests with key. It remembers imported request IDs (replay
// protection) for its lifetime. A manifest must name the sharing domain
// its tenant has in this pool (kvcache checks it at admission).
func CreateReceiver(pool Handle, key []byte, configJSON []byte) (Handle, error) {
	pe, err := lookupPool(pool)
	if err != nil {
		return 0, err
	}
	cfg, err := ParseReceiverConfig(configJSON)
	if err != nil {
		return 0, err
	}
	if cfg.Key, err = handoff.NewKey(key); err != nil {
		return 0, err
	}
	cfg.Pool = pe.pool
	r, err := handoff.NewReceiver(cfg)
	if err != nil {
		return 0, err
	}
	h := nextHandle.Add(1)
	receivers.Store(h, &receiverEntry{pool: pe, r: r})
	return h, nil
}

// DestroyReceiver invalidates a receiver handle. Imports it began stay
// valid until freed.
func DestroyReceiver(h Handle) error {
	if _, ok := receivers.LoadAndDelete(h); !ok {
		return invalid(h, "receiver")
	}
	return nil
}

// BeginImport verifies manifest and admits its import fail-closed.
// manifest may alias C memory: it is parsed (and copied) during the call.
//
// The admission waits as the receiver's admit_wait_ms says, and no
// longer: handoff bounds it with a timeout of its own, and with 0 must
// refuse a busy pool at once. The context passed here only says that a C
// caller never cancels the call; it carries no deadline, so it must never
// reach an admission that waits for as long as its context lives.
func BeginImport(receiver Handle, manifest []byte) (Handle, error) {
	v, ok := receivers.Load(receiver)
	if !ok {
		return 0, invalid(receiver, "receiver")
	}
	re := v.(*receiverEntry)
	imp, err := re.r.Begin(context.Background(), manifest)
	if err != nil {
		return 0, err
	}
	h := nextHandle.Add(1)
	imports.Store(h, &importEntry{pool: re.pool, imp: imp})
	return h, nil
}

// DescribeImport reports what an import expects; Live until it completed
// or was aborted.
func DescribeImport(h Handle) (TransferInfo, error) {
	ie, err := lookupImport(h)
	if err != nil {
		return TransferInfo{}, err
	}
	return transferInfo(ie.imp.Manifest(), ie.imp.PageBytes(), !ie.imp.Ended()), nil
}

// ImportWritePages writes received pages first, first+1, … from src (a
// whole number of pages; it may alias C memory). A bad range is the
// caller's arithmetic, not the transfer's: it is refused before the
// import is touched, nothing is written and the import stays usable. Any
// other error (a page twice, an import that has ended, a pool fault)
// aborts the import, as kvcache does.
func ImportWritePages(h Handle, first int64, src []byte) error {
	ie, err := lookupImport(h)
	if err != nil {
		return err
	}
	f, err := pageRange("write", first, len(src), ie.imp.Manifest().Extents[0].Units, ie.imp.PageBytes())
	if err != nil {
		return err
	}
	return ie.imp.WriteUnits(f, src)
}

// CompleteImport verifies the import and returns its lease handle in the
// receiver's pool.
func CompleteImport(h Handle) (Handle, error) {
	ie, err := lookupImport(h)
	if err != nil {
		return 0, err
	}
	l, err := ie.imp.Complete()
	if err != nil {
		return 0, err
	}
	return newLease(ie.pool, l, true), nil
}

// AbortImport ends an import that has not completed.
func AbortImport(h Handle) error {
	ie, err := lookupImport(h)
	if err != nil {
		return err
	}
	return ie.imp.Abort()
}

// FreeImport aborts the import unless it completed and invalidates the
// handle; a completed import's lease is unaffected.
func FreeImport(h Handle) error {
	v, ok := imports.LoadAndDelete(h)
	if !ok {
		return invalid(h, "import")
	}
	err := v.(*importEntry).imp.Abort()
	if errors.Is(err, kvcache.ErrPoolClosed) {
		err = nil
	}
	return err
}
