package bridge

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"strings"
	"testing"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/internal/errcontract"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

// sentinelsOf lists the Err* variables declared in a package's errors.go.
func sentinelsOf(t *testing.T, path string) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), path, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, d := range f.Decls {
		gd, ok := d.(*ast.GenDecl)
		if !ok || gd.Tok != token.VAR {
			continue
		}
		for _, s := range gd.Specs {
			for _, n := range s.(*ast.ValueSpec).Names {
				if strings.HasPrefix(n.Name, "Err") {
					names = append(names, n.Name)
				}
			}
		}
	}
	return names
}

// TestEverySentinelHasAStatus fails when a sentinel is added to kvcache or
// isolation without deciding its C status here.
func TestEverySentinelHasAStatus(t *testing.T) {
	kv := map[string]error{
		"ErrInvalidConfig": kvcache.ErrInvalidConfig, "ErrUndersizedPool": kvcache.ErrUndersizedPool,
		"ErrInvalidRequest": kvcache.ErrInvalidRequest, "ErrUnknownTenant": kvcache.ErrUnknownTenant,
		"ErrDuplicateRequest": kvcache.ErrDuplicateRequest, "ErrExceedsMaxContext": kvcache.ErrExceedsMaxContext,
		"ErrExceedsCapacity": kvcache.ErrExceedsCapacity, "ErrExceedsQuota": kvcache.ErrExceedsQuota,
		"ErrPoolExhausted": kvcache.ErrPoolExhausted, "ErrPoolClosed": kvcache.ErrPoolClosed,
		"ErrPoolFaulted": kvcache.ErrPoolFaulted, "ErrLeaseReleased": kvcache.ErrLeaseReleased,
		"ErrInvalidArgument": kvcache.ErrInvalidArgument, "ErrScrubFailed": kvcache.ErrScrubFailed,
		"ErrCanaryMismatch": kvcache.ErrCanaryMismatch, "ErrDevice": kvcache.ErrDevice,
		"ErrInvalidTenant": kvcache.ErrInvalidTenant, "ErrDuplicateTenant": kvcache.ErrDuplicateTenant,
		"ErrOverReserved": kvcache.ErrOverReserved, "ErrKeptForGrowth": nil,
		"ErrLeasePhase": kvcache.ErrLeasePhase, "ErrReclaimed": kvcache.ErrReclaimed,
		"ErrStaleTransfer": kvcache.ErrStaleTransfer, "ErrDuplicatePage": kvcache.ErrDuplicatePage,
		"ErrIncompleteTransfer": kvcache.ErrIncompleteTransfer, "ErrChecksumMismatch": kvcache.ErrChecksumMismatch,
		"ErrDomainMismatch": kvcache.ErrDomainMismatch,
		"ErrNoStateGroup":   kvcache.ErrNoStateGroup, "ErrCheckpointCapacity": kvcache.ErrCheckpointCapacity,
		"ErrTierUnsupported": kvcache.ErrTierUnsupported, "ErrOnloadFailed": kvcache.ErrOnloadFailed,
		"ErrOffloadFailed": kvcache.ErrOffloadFailed,
		// Never reach C: the bridge admits with a live context and builds
		// imports from manifests, which carry no prefix material; a Check
		// failure is a bug, reported as internal.
		"ErrContextDone": nil, "ErrImportPrefix": nil, "ErrCorrupt": nil,
	}
	iso := map[string]error{
		"ErrInvalidTenant": isolation.ErrInvalidTenant, "ErrDuplicateTenant": isolation.ErrDuplicateTenant,
		"ErrUnknownTenant": isolation.ErrUnknownTenant, "ErrQuotaExceeded": isolation.ErrQuotaExceeded,
		"ErrOverReserved": isolation.ErrOverReserved, "ErrScrubFailed": isolation.ErrScrubFailed,
		"ErrCanaryMismatch": isolation.ErrCanaryMismatch,
		// Only ever reported inside another sentinel: ErrReserved as the
		// cause of ErrPoolExhausted, policy errors inside ErrInvalidConfig.
		"ErrReserved": nil, "ErrInvalidPolicy": nil, "ErrNonFinitePattern": nil,
		// Causes too: ErrKeptForGrowth of ErrPoolExhausted, ErrInvalidSizing
		// inside the error of what carried the sizing (config, tenant).
		"ErrKeptForGrowth": nil, "ErrInvalidSizing": nil,
		"ErrCorrupt": nil, // a Check failure: a bug, reported as internal
	}
	ho := map[string]error{
		"ErrInvalidConfig": handoff.ErrInvalidConfig, "ErrMalformedManifest": handoff.ErrMalformedManifest,
		"ErrBadMAC": handoff.ErrBadMAC, "ErrExpired": handoff.ErrExpired,
		"ErrGeometryMismatch": handoff.ErrGeometryMismatch, "ErrDomainMismatch": handoff.ErrDomainMismatch,
		"ErrReplay": handoff.ErrReplay, "ErrInvalidArgument": handoff.ErrInvalidArgument,
		"ErrInProgress": handoff.ErrInProgress, "ErrShardMismatch": handoff.ErrShardMismatch,
		// Errors of transports (the C ABI sends over UCX since ABI 11).
		"ErrProtocol": handoff.ErrProtocol, "ErrTransport": handoff.ErrTransport,
		// A refusal seen by a sender carries the receiver's reason, whose
		// status it gets; one it cannot name is internal.
		"ErrRefused": nil, "ErrInternal": nil,
		"ErrNoRemoteMemory": nil, // the receiver falls back to data frames: never returned
	}
	dev := map[string]error{
		"ErrNoDevice": cudaops.ErrNoDevice, "ErrOutOfMemory": cudaops.ErrOutOfMemory,
		"ErrDriver": cudaops.ErrDriver, "ErrInvalidArgument": cudaops.ErrInvalidArgument,
		"ErrBadOrdering": cudaops.ErrBadOrdering,
		// The bridge owns the device and closes it only after the pool:
		// a closed device in use is a bug, reported as internal.
		"ErrClosed": nil,
	}
	for _, c := range []struct {
		file string
		errs map[string]error
	}{
		{"../../../kvcache/errors.go", kv},
		{"../../../isolation/errors.go", iso}, {"../../../handoff/errors.go", ho}, {"../../../cudaops/errors.go", dev},
	} {
		for _, name := range sentinelsOf(t, c.file) {
			err, known := c.errs[name]
			switch {
			case !known:
				t.Errorf("%s: %s has no C status: add it to sentinels, kvfence.h and this test", c.file, name)
			case err != nil && Classify(fmt.Errorf("wrapped: %w", err)).Status == StatusInternal:
				t.Errorf("%s: %s classifies as internal", c.file, name)
			}
		}
	}
}

func TestClassify(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want Info
	}{
		{"nil", nil, Info{Status: OK}},
		{"unknown", errors.New("boom"), Info{Status: StatusInternal}},
		{"handle", fmt.Errorf("%w: 0x1", ErrInvalidHandle), Info{Status: StatusInvalidHandle}},
		{"buffer", &BufferError{What: "block table", Need: 8, Have: 4}, Info{Status: StatusBufferTooSmall, Need: 8, Have: 4, Limit: 4}},
		{"faulted wins over its cause", fmt.Errorf("%w: %w", kvcache.ErrPoolFaulted, kvcache.ErrScrubFailed), Info{Status: StatusPoolFaulted}},
		{"undersized", fmt.Errorf("%w: pool holds", kvcache.ErrUndersizedPool), Info{Status: StatusUndersizedPool}},
		{"config wins over policy", fmt.Errorf("%w: %w", kvcache.ErrInvalidConfig, isolation.ErrNonFinitePattern), Info{Status: StatusInvalidConfig}},
		{"exhausted with reserved cause", &kvcache.AdmissionError{Err: kvcache.ErrPoolExhausted, Cause: isolation.ErrReserved, Need: 8, Have: 2, Limit: 64},
			Info{Status: StatusPoolExhausted, Retryable: true, Need: 8, Have: 2, Limit: 64, Cause: CauseReserved}},
		{"exhausted kept for growth", &kvcache.AdmissionError{Err: kvcache.ErrPoolExhausted, Cause: fmt.Errorf("q: %w", isolation.ErrKeptForGrowth), Need: 1, Limit: 64},
			Info{Status: StatusPoolExhausted, Retryable: true, Need: 1, Limit: 64, Cause: CauseKeptForGrowth}},
		{"exhausted, the pool short", &kvcache.AdmissionError{Err: kvcache.ErrPoolExhausted, Need: 8, Limit: 64},
			Info{Status: StatusPoolExhausted, Retryable: true, Need: 8, Limit: 64}},
		{"capacity", &kvcache.AdmissionError{Err: kvcache.ErrExceedsCapacity, Need: 125, Have: 64, Limit: 64, NeedTokens: 2000, LimitTokens: 1024},
			Info{Status: StatusExceedsCapacity, Permanent: true, Need: 125, Have: 64, Limit: 64, NeedTokens: 2000, LimitTokens: 1024}},
		{"quota, retryable", &kvcache.AdmissionError{Err: kvcache.ErrExceedsQuota, Need: 8, Have: 2, Limit: 32},
			Info{Status: StatusExceedsQuota, Retryable: true, Need: 8, Have: 2, Limit: 32}},
		{"device memory wins over config", fmt.Errorf("%w: allocating: %w", kvcache.ErrInvalidConfig, cudaops.ErrOutOfMemory), Info{Status: StatusDeviceOutOfMemory}},
		{"no device", fmt.Errorf("%w: cuInit: CUDA_ERROR_NO_DEVICE (100)", cudaops.ErrNoDevice), Info{Status: StatusNoDevice}},
		{"scrub wins over the driver", fmt.Errorf("%w: %w", kvcache.ErrScrubFailed, cudaops.ErrDriver), Info{Status: StatusScrubFailed}},
		{"driver", fmt.Errorf("%w: cuMemcpy", cudaops.ErrDriver), Info{Status: StatusDeviceFailed}},
		{"a refused release ordering wins over invalid argument", fmt.Errorf("%w: release ordering: %w (%w): stream 0x10",
			kvcache.ErrInvalidArgument, cudaops.ErrBadOrdering, cudaops.ErrInvalidArgument), Info{Status: StatusBadOrdering}},
		{"replay", fmt.Errorf("%w: request", handoff.ErrReplay), Info{Status: StatusReplay}},
		{"in progress, which wraps replay", fmt.Errorf("%w: request", handoff.ErrInProgress), Info{Status: StatusInProgress}},
		{"short key", fmt.Errorf("%w: HMAC key", handoff.ErrInvalidConfig), Info{Status: StatusInvalidConfig}},
		{"import aborted by checksum", fmt.Errorf("%w: request", kvcache.ErrChecksumMismatch), Info{Status: StatusChecksumMismatch}},
		{"admission error wrapped", fmt.Errorf("outer: %w", &kvcache.AdmissionError{Err: kvcache.ErrUnknownTenant}), Info{Status: StatusUnknownTenant}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Classify(tt.err); got != tt.want {
				t.Errorf("Classify = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestStatusNamesUnique(t *testing.T) {
	seen := make(map[string]Status)
	for s, n := range Statuses() {
		if prev, dup := seen[n]; dup {
			t.Errorf("%s names %d and %d", n, prev, s)
		}
		seen[n] = s
		if s.String() != n {
			t.Errorf("Status(%d).String() = %q, want %q", s, s.String(), n)
		}
	}
	for _, s := range sentinels {
		if _, ok := Statuses()[s.status]; !ok {
			t.Errorf("sentinel %v maps to unnamed status %d", s.err, s.status)
		}
	}
	if got := Status(999).String(); got != "kvf_status(999)" {
		t.Errorf("unknown status prints %q", got)
	}
}

// TestErrorsWrapSentinels: every error the bridge and the export layer
// make inside a function wraps a sentinel, so that Classify decides its
// status from what it is, never from the fallback for unknown errors: no
// fmt.Errorf without %w, no errors.New outside the sentinel declarations.
func TestErrorsWrapSentinels(t *testing.T) {
	errcontract.Check(t, ".", "../..")
}

// TestStatusRoundTrip: every status has an error that classifies as it,
// and every error the status table lists for a status classifies back as
// that status (none is shadowed by an earlier entry), so the mapping is
// total in both directions.
func TestStatusRoundTrip(t *testing.T) {
	errorsOf := map[Status][]error{
		OK:                   {nil},
		StatusBufferTooSmall: {&BufferError{What: "test", Need: 2, Have: 1}},
		StatusInternal:       {errors.New("an error kvfence does not know")},
	}
	for _, s := range sentinels {
		errorsOf[s.status] = append(errorsOf[s.status], s.err)
	}
	for s, name := range Statuses() {
		errs := errorsOf[s]
		if len(errs) == 0 {
			t.Errorf("%s (%d): no error maps to it", name, s)
		}
		for _, err := range errs {
			wrapped := err
			if err != nil {
				wrapped = fmt.Errorf("context: %w", err)
			}
			if got := Classify(wrapped).Status; got != s {
				t.Errorf("%v classifies as %v, the table says %s", err, got, name)
			}
		}
	}
	for s := range errorsOf {
		if _, named := Statuses()[s]; !named {
			t.Errorf("status %d has errors but no name", s)
		}
	}
}
