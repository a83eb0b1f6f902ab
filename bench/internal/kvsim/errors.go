package kvsim

import (
	"errors"
	"fmt"
)

// Sentinel errors. Match with errors.Is.
var (
	// ErrBadTrace: a trace line that is not valid JSON, has an unknown or
	// mistyped field, a value out of range, or names an undeclared tenant.
	// The error is a *TraceError naming the line and field, or an
	// *EmptyTraceError for a trace without a request.
	ErrBadTrace = errors.New("kvsim: bad trace")
	// ErrBadConfig: a simulation or generator setting out of range.
	ErrBadConfig = errors.New("kvsim: bad config")
	// ErrAuditFailed: a safe policy handed out a page that still held
	// data, or the pool's Check failed during a run.
	ErrAuditFailed = errors.New("kvsim: isolation audit failed")
)

// TraceError locates a bad trace record.
type TraceError struct {
	File  string // as given to ParseTrace; may be empty
	Line  int    // 1-based
	Field string // JSON field name; empty when the line is not an object
	Msg   string
}

func (e *TraceError) Error() string {
	loc := fmt.Sprintf("line %d", e.Line)
	if e.File != "" {
		loc = fmt.Sprintf("%s:%d", e.File, e.Line)
	}
	if e.Field == "" {
		return fmt.Sprintf("%s: %s", loc, e.Msg)
	}
	return fmt.Sprintf("%s: field %q: %s", loc, e.Field, e.Msg)
}

func (e *TraceError) Unwrap() error { return ErrBadTrace }

// EmptyTraceError is a trace that parsed but holds no request: nothing to
// replay, so nothing to measure.
type EmptyTraceError struct {
	File    string // as given to ParseTrace; may be empty
	Lines   int    // lines read, blank and comment lines included
	Tenants int    // tenant records among them
	// Format is empty for a kvbench trace; for an imported one, what its
	// lines are called ("request", "row").
	Format string
}

func (e *EmptyTraceError) Error() string {
	file := e.File
	if file == "" {
		file = "trace"
	}
	if e.Format != "" {
		return fmt.Sprintf("%s: no requests to replay: want at least one %s (read %d lines, none a request)", file, e.Format, e.Lines)
	}
	return fmt.Sprintf(`%s: no requests to replay: want at least one {"type":"request",...} line `+
		"(read %d lines: %d tenant, no request)", file, e.Lines, e.Tenants)
}

func (e *EmptyTraceError) Unwrap() error { return ErrBadTrace }
