package kvsim

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Trace formats ReadTrace reads.
const (
	// FormatAuto detects the format from the first record.
	FormatAuto = "auto"
	// FormatKvbench is kvbench's own JSONL (TraceFormat).
	FormatKvbench = "kvbench"
	// FormatMooncake is the JSONL of the Mooncake traces (FAST '25):
	// {"timestamp": ms, "input_length": N, "output_length": N,
	// "hash_ids": [...]}, hash_ids being the chain of the prompt's blocks
	// of MooncakeBlockTokens tokens.
	FormatMooncake = "mooncake"
	// FormatAzure is the CSV of the Azure LLM inference traces:
	// TIMESTAMP,ContextTokens,GeneratedTokens.
	FormatAzure = "azure"
)

// TraceFormats are the formats ReadTrace accepts, FormatAuto first.
var TraceFormats = []string{FormatAuto, FormatKvbench, FormatMooncake, FormatAzure}

// MooncakeBlockTokens is the size of the blocks that Mooncake's hash_ids
// name.
const MooncakeBlockTokens = 512

// ImportFormat documents the imported formats; kvbench -help prints it.
const ImportFormat = `Imported traces (-trace-format, detected from the first record by default):

  mooncake  JSONL, one request per line (Mooncake, FAST '25):
            {"timestamp": 27482, "input_length": 6955, "output_length": 52,
             "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]}
            timestamp ms (≥ 0), input_length prompt tokens (≥ 1),
            output_length tokens generated (≥ 0), hash_ids the chain of the
            prompt's 512-token blocks (integers ≥ 0, ceil(input_length/512)
            of them; equal IDs = equal blocks). The prompt's tokens follow
            from the block IDs (see "blocks" below), so equal chains share
            pages at any page size.
  azure     CSV with the header TIMESTAMP,ContextTokens,GeneratedTokens (any
            column order; Azure LLM inference traces 2023/2024): timestamp
            "2006-01-02 15:04:05.9999999" (or RFC 3339), prompt tokens (≥ 1),
            tokens generated (≥ 0). No prefix information: every prompt is
            unique.

Arrivals count from the trace's earliest timestamp; requests are replayed
sorted by it (stable); max_new = output; request IDs are L<line>. Neither
format names tenants: all requests go to one tenant (named after the
format) unless -trace-tenants N spreads them: the i-th request of the file
goes to tenant i mod N ("mooncake-00" …), and with -domains shared the
tenants form sharing domains of -org-size tenants ("org-00" …).`

// ImportConfig gives an imported trace, which names no tenant, its
// tenants.
type ImportConfig struct {
	// Tenants spreads the requests over this many tenants, round robin in
	// file order: the i-th request goes to tenant i mod Tenants. 0 or 1:
	// one tenant. At most 255.
	Tenants int
	// OrgSize groups the tenants into sharing domains of this many
	// ("org-00", …), used with DomainsShared; 0 or 1: none.
	OrgSize int
}

func (c ImportConfig) validate() error {
	switch {
	case c.Tenants < 0 || c.Tenants > 255:
		return fmt.Errorf("%w: %d tenants for an imported trace, want 1..255", ErrBadConfig, c.Tenants)
	case c.OrgSize < 0 || c.OrgSize > 255:
		return fmt.Errorf("%w: organisation size %d, want 0..255", ErrBadConfig, c.OrgSize)
	}
	return nil
}

// tenants declares the tenants of an imported trace and returns the name
// of the i-th request's tenant.
func (c ImportConfig) tenants(tr *Trace, format string) func(i int) string {
	n := max(1, c.Tenants)
	if n == 1 {
		tr.Tenants = []Tenant{{Name: format}}
		return func(int) string { return format }
	}
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("%s-%02d", format, i)
		t := Tenant{Name: names[i]}
		if c.OrgSize > 1 {
			t.Domain = fmt.Sprintf("org-%02d", i/c.OrgSize)
		}
		tr.Tenants = append(tr.Tenants, t)
	}
	return func(i int) string { return names[i%n] }
}

// ReadTrace reads a trace in format (FormatAuto or "": detected from its
// first record) and returns it with the format it was read as. name labels
// errors. ic gives an imported trace its tenants; a kvbench trace declares
// its own, and ic must then be zero. Errors are as ParseTrace's: a
// *TraceError naming the line and field, or an *EmptyTraceError, both
// wrapping ErrBadTrace; or an ErrBadConfig.
func ReadTrace(r io.Reader, name, format string, ic ImportConfig) (*Trace, string, error) {
	if err := ic.validate(); err != nil {
		return nil, "", err
	}
	br := bufio.NewReaderSize(r, 64<<10)
	if format == "" || format == FormatAuto {
		var err error
		if format, err = detectFormat(br, name); err != nil {
			return nil, "", err
		}
	}
	if format == FormatKvbench && ic.Tenants > 1 {
		return nil, "", fmt.Errorf("%w: a kvbench trace declares its own tenants; spreading it over %d is for imported traces",
			ErrBadConfig, ic.Tenants)
	}
	var tr *Trace
	var err error
	switch format {
	case FormatKvbench:
		tr, err = ParseTrace(br, name)
	case FormatMooncake:
		tr, err = ParseMooncake(br, name, ic)
	case FormatAzure:
		tr, err = ParseAzure(br, name, ic)
	default:
		return nil, "", fmt.Errorf("%w: unknown trace format %q (want %s)", ErrBadConfig, format, strings.Join(TraceFormats, ", "))
	}
	return tr, format, err
}

// detectFormat looks at the first record (the first line that is neither
// blank nor a # comment) without consuming it. An empty trace is a
// kvbench one, whose parser says it is empty.
func detectFormat(br *bufio.Reader, name string) (string, error) {
	buf, _ := br.Peek(br.Size()) // less at the end of the input; a read error shows again when parsing
	line, lineNo := []byte(nil), 0
	for rest := buf; len(rest) > 0; {
		l, after, _ := bytes.Cut(rest, []byte("\n"))
		lineNo++
		rest = after
		if l = bytes.TrimSpace(l); len(l) > 0 && l[0] != '#' {
			line = l
			break
		}
	}
	switch {
	case line == nil:
		return FormatKvbench, nil
	case line[0] == '{':
		// The record may be longer than the peeked bytes: look for the
		// keys that tell the formats apart rather than decoding it.
		if bytes.Contains(line, []byte(`"hash_ids"`)) || bytes.Contains(line, []byte(`"input_length"`)) {
			return FormatMooncake, nil
		}
		return FormatKvbench, nil
	case bytes.Contains(bytes.ToLower(line), []byte("contexttokens")):
		return FormatAzure, nil
	}
	return "", &TraceError{File: name, Line: lineNo, Msg: "cannot tell the trace format: want a kvbench record " +
		`({"type":...}), a Mooncake record ({"timestamp":...,"hash_ids":[...]}) or an Azure CSV header ` +
		"(TIMESTAMP,ContextTokens,GeneratedTokens); or pass -trace-format"}
}

// mooncakeRecord is one line of a Mooncake trace. Pointers tell a missing
// field from a zero one.
type mooncakeRecord struct {
	Timestamp    *float64 `json:"timestamp"`
	InputLength  *int64   `json:"input_length"`
	OutputLength *int64   `json:"output_length"`
	HashIDs      *[]int64 `json:"hash_ids"`
}

// ParseMooncake reads a Mooncake JSONL trace (FormatMooncake): one request
// per line, its prompt the chain of blocks hash_ids names. Blank lines and
// lines starting with # are ignored. Errors are as ParseTrace's.
func ParseMooncake(r io.Reader, name string, ic ImportConfig) (*Trace, error) {
	if err := ic.validate(); err != nil {
		return nil, err
	}
	p := traceParser{file: name}
	tr := &p.trace
	tr.BlockTokens = MooncakeBlockTokens
	tenantOf := ic.tenants(tr, FormatMooncake)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxTraceLine)
	for sc.Scan() {
		p.line++
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		var rec mooncakeRecord
		dec := json.NewDecoder(bytes.NewReader(line))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&rec); err != nil {
			return nil, p.jsonError(err)
		}
		if dec.More() {
			return nil, p.fail("", "malformed JSON: more than one value on the line")
		}
		req, err := p.mooncakeRequest(&rec)
		if err != nil {
			return nil, err
		}
		req.Tenant = tenantOf(len(tr.Requests))
		tr.Requests = append(tr.Requests, req)
	}
	if err := scanErr(&p, sc.Err()); err != nil {
		return nil, err
	}
	return finishImport(&p, "request line")
}

func (p *traceParser) mooncakeRequest(rec *mooncakeRecord) (Request, error) {
	req := Request{Line: p.line, ID: "L" + strconv.Itoa(p.line), AbortAfter: -1}
	var err error
	if req.At, err = p.millis("timestamp", rec.Timestamp); err != nil {
		return req, err
	}
	if req.Prompt, err = p.intField("input_length", rec.InputLength, -1, 1, maxTraceTokens); err != nil {
		return req, err
	}
	if req.Output, err = p.intField("output_length", rec.OutputLength, -1, 0, maxTraceTokens); err != nil {
		return req, err
	}
	req.MaxNew = req.Output
	if rec.HashIDs == nil {
		return req, p.fail("hash_ids", "missing")
	}
	ids := *rec.HashIDs
	if want := BlockCount(req.Prompt, MooncakeBlockTokens); len(ids) != want {
		return req, p.fail("hash_ids", "%d block IDs for input_length %d, want %d (one per %d tokens, the last possibly partial)",
			len(ids), req.Prompt, want, MooncakeBlockTokens)
	}
	for i, id := range ids {
		if id < 0 {
			return req, p.fail("hash_ids", "block %d: ID %d is negative, want ≥ 0", i, id)
		}
	}
	req.Blocks = ids
	return req, nil
}

// millis reads a timestamp in milliseconds.
func (p *traceParser) millis(field string, v *float64) (time.Duration, error) {
	if v == nil {
		return 0, p.fail(field, "missing")
	}
	maxMs := float64(maxTraceAt.Milliseconds())
	switch ms := *v; {
	case ms < 0:
		return 0, p.fail(field, "%v is negative, want milliseconds ≥ 0", ms)
	case !(ms <= maxMs):
		return 0, p.fail(field, "%v out of range, want 0..%v milliseconds", ms, maxMs)
	default:
		return time.Duration(math.Round(ms * 1e6)), nil
	}
}

// azureColumns are the columns of an Azure trace, in the order of the
// fields of azureRow.
var azureColumns = []string{"TIMESTAMP", "ContextTokens", "GeneratedTokens"}

// azureTimeLayouts are the timestamp layouts accepted, the traces' own
// first.
var azureTimeLayouts = []string{"2006-01-02 15:04:05.999999999", time.RFC3339Nano}

// ParseAzure reads an Azure LLM inference trace (FormatAzure): a CSV with
// a header naming the columns TIMESTAMP, ContextTokens and GeneratedTokens
// (in any order, no others), then one request per row. The traces carry
// no prefix information, so every prompt is unique. Errors are as
// ParseTrace's; a row's field is named by its column.
func ParseAzure(r io.Reader, name string, ic ImportConfig) (*Trace, error) {
	if err := ic.validate(); err != nil {
		return nil, err
	}
	p := traceParser{file: name}
	tr := &p.trace
	tenantOf := ic.tenants(tr, FormatAzure)
	cr := csv.NewReader(r)
	cr.FieldsPerRecord = -1 // counted here, to name what is missing
	cr.ReuseRecord = true
	col := map[string]int{} // column name → index
	var start time.Time     // the earliest timestamp
	var stamps []time.Time
	for {
		row, err := cr.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			var pe *csv.ParseError
			if errors.As(err, &pe) {
				p.line = pe.Line
				return nil, p.fail("", "malformed CSV: %v", pe.Err)
			}
			return nil, fmt.Errorf("reading trace %s: %w", name, err)
		}
		p.line, _ = cr.FieldPos(0)
		if len(col) == 0 {
			if err := p.azureHeader(row, col); err != nil {
				return nil, err
			}
			continue
		}
		if len(row) != len(col) {
			return nil, p.fail("", "%d fields, want %d (%s)", len(row), len(col), strings.Join(azureColumns, ","))
		}
		field := func(name string) string { return strings.TrimSpace(row[col[name]]) }
		at, err := p.azureTime(field("TIMESTAMP"))
		if err != nil {
			return nil, err
		}
		req := Request{Line: p.line, ID: "L" + strconv.Itoa(p.line), AbortAfter: -1, Tenant: tenantOf(len(tr.Requests))}
		if req.Prompt, err = p.csvInt("ContextTokens", field("ContextTokens"), 1); err != nil {
			return nil, err
		}
		if req.Output, err = p.csvInt("GeneratedTokens", field("GeneratedTokens"), 0); err != nil {
			return nil, err
		}
		req.MaxNew = req.Output
		if len(stamps) == 0 || at.Before(start) {
			start = at
		}
		stamps = append(stamps, at)
		tr.Requests = append(tr.Requests, req)
	}
	for i, at := range stamps {
		d := at.Sub(start)
		if d > maxTraceAt {
			p.line = tr.Requests[i].Line
			return nil, p.fail("TIMESTAMP", "%v after the trace's first request, want at most %v", d, maxTraceAt)
		}
		tr.Requests[i].At = d
	}
	return finishImport(&p, "request row after the header")
}

func (p *traceParser) azureHeader(row []string, col map[string]int) error {
	for i, name := range row {
		name = strings.TrimSpace(strings.TrimPrefix(name, "\ufeff"))
		known := ""
		for _, c := range azureColumns {
			if strings.EqualFold(name, c) {
				known = c
			}
		}
		if known == "" {
			return p.fail(name, "unknown column (want a header of %s)", strings.Join(azureColumns, ","))
		}
		if _, dup := col[known]; dup {
			return p.fail(known, "column given twice in the header")
		}
		col[known] = i
	}
	for _, c := range azureColumns {
		if _, ok := col[c]; !ok {
			clear(col)
			return p.fail(c, "column missing from the header (want %s)", strings.Join(azureColumns, ","))
		}
	}
	return nil
}

func (p *traceParser) azureTime(s string) (time.Time, error) {
	for _, layout := range azureTimeLayouts {
		if t, err := time.Parse(layout, s); err == nil {
			return t, nil
		}
	}
	return time.Time{}, p.fail("TIMESTAMP", "%q is not a time like 2023-11-16 18:15:46.6805900", s)
}

func (p *traceParser) csvInt(field, s string, lo int64) (int, error) {
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		if errors.Is(err, strconv.ErrRange) {
			return 0, p.fail(field, "%s out of range, want %d..%d", s, lo, maxTraceTokens)
		}
		return 0, p.fail(field, "%q is not an integer", s)
	}
	return p.intField(field, &v, -1, lo, maxTraceTokens)
}

func scanErr(p *traceParser, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, bufio.ErrTooLong):
		p.line++
		return p.fail("", "line longer than %d bytes", maxTraceLine)
	}
	return fmt.Errorf("reading trace %s: %w", p.file, err)
}

// finishImport checks that an imported trace has requests, counts its
// arrivals from the earliest and sorts them.
func finishImport(p *traceParser, what string) (*Trace, error) {
	tr := &p.trace
	if len(tr.Requests) == 0 {
		return nil, &EmptyTraceError{File: p.file, Lines: p.line, Format: what}
	}
	first := slices.MinFunc(tr.Requests, func(a, b Request) int { return cmp.Compare(a.At, b.At) }).At
	for i := range tr.Requests {
		tr.Requests[i].At -= first
	}
	slices.SortStableFunc(tr.Requests, func(a, b Request) int { return cmp.Compare(a.At, b.At) })
	return tr, nil
}
