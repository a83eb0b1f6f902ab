package kvsim

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvfence/kvfence/isolation"
)

// TraceFormat documents the JSONL trace format; kvbench -help prints it
// and bench/README.md repeats it.
const TraceFormat = `Trace format (JSONL): one JSON object per line; blank lines and lines
starting with # are ignored. Every object has a "type".

  {"type":"trace","block_tokens":512}
    block_tokens    tokens per block of the requests' "blocks" lists
                    (1..1048576); at most one trace line, before the first
                    request with blocks

  {"type":"tenant","name":"acme","quota_pages":0,"reserved_pages":0,
   "system_prompt":512,"domain":"acme-org"}
    name            required, 1..256 bytes, unique
    quota_pages     most pages the tenant may hold at once (0 = whole pool)
    reserved_pages  pages kept for the tenant (≤ quota_pages when that is set)
    system_prompt   tokens of the tenant's shared system prompt (informational)
    domain          optional: the sharing domain the tenant joins when run
                    with -domains shared (1..256 bytes, not starting with
                    "tenant:"); without it, or with -domains per-tenant,
                    the tenant has its own

  {"type":"request","at":0.125,"id":"r1","tenant":"acme","prompt":1834,
   "prefix":512,"prefix_id":"acme-org","output":211,"max_new":512,"abort_after":40}
  {"type":"request","at":0.2,"tenant":"acme","prompt":1100,"blocks":[7,8,31],"output":64}
    at              arrival, seconds from the start of the trace (≥ 0)
    id              optional, unique in the trace (default "L<line>")
    tenant          required; must be declared by an earlier tenant line
    prompt          prompt tokens, ≥ 1
    prefix          leading prompt tokens shared with the tenant's other
                    requests (its system prompt), 0..prompt; default 0
    prefix_id       optional, needs prefix ≥ 1: names the shared prefix's
                    content; requests with the same prefix_id start with
                    the same token IDs (default: the tenant's domain if it
                    names one, else the tenant's name). The other prompt
                    tokens are unique to the request. Token IDs are derived
                    from -seed, prefix_id and id
    blocks          optional, instead of prefix: the prompt as a chain of
                    block IDs (integers ≥ 0), one per block_tokens tokens,
                    the last block possibly partial, so exactly
                    ceil(prompt / block_tokens) of them. Block i's tokens
                    are derived from -seed and its ID alone: requests whose
                    chains start alike share those tokens, and so those
                    pages, whatever the page size; two chains that differ
                    in a block differ, at pages of 4 tokens or more, in
                    that block's first page and in every page after it
                    (Mooncake's hash_ids are such chains)
    output          tokens the request generates if not aborted, ≥ 0
    max_new         output budget reserved at admission, ≥ output;
                    default output
    abort_after     optional: the client aborts after this many generated
                    tokens, 0 ≤ abort_after < output

Integers must be JSON integers. Unknown fields are errors. A trace has at
least one request. Requests may appear in any order of "at"; they are
replayed sorted by it (stable).`

// Tenant is a tenant declared by a trace.
type Tenant struct {
	Name          string `json:"name"`
	QuotaPages    int    `json:"quota_pages,omitempty"`
	ReservedPages int    `json:"reserved_pages,omitempty"`
	SystemPrompt  int    `json:"system_prompt,omitempty"`
	// Domain is the sharing domain the tenant joins when domains are
	// shared; empty: its own.
	Domain string `json:"domain,omitempty"`
}

// Request is one request of a trace.
type Request struct {
	Line   int           // source line, 0 for generated requests not yet written
	At     time.Duration // arrival, from the start of the trace
	ID     string
	Tenant string
	Prompt int // prompt tokens
	Prefix int // leading prompt tokens shared with the tenant's other requests
	// PrefixID names the content of the shared prefix: requests with the
	// same PrefixID start with the same Prefix token IDs. Set when Prefix
	// > 0 (ParseTrace and Generate fill in the default).
	PrefixID string
	// Blocks, when set (and then Prefix is 0), is the prompt as a chain of
	// block IDs, one per Trace.BlockTokens tokens, the last possibly
	// partial: block i's token IDs follow from its ID alone (see
	// AppendPromptTokens), so requests whose chains start alike share
	// those tokens.
	Blocks []int64
	Output int // tokens generated unless aborted
	MaxNew int // output budget reserved at admission, ≥ Output
	// AbortAfter is the number of generated tokens after which the client
	// aborts; -1 when it does not.
	AbortAfter int
}

// Generated is the number of tokens the request produces before it ends.
func (r Request) Generated() int {
	if r.AbortAfter >= 0 {
		return r.AbortAfter
	}
	return r.Output
}

// Trace is a replayable workload: tenants, then requests sorted by arrival.
type Trace struct {
	Tenants []Tenant
	// BlockTokens is the size in tokens of the blocks of Request.Blocks;
	// 0 when no request has blocks.
	BlockTokens int
	Requests    []Request
}

// BlockCount is the number of blocks of blockTokens tokens that a prompt
// of prompt tokens spans, the last possibly partial.
func BlockCount(prompt, blockTokens int) int {
	return (prompt + blockTokens - 1) / blockTokens
}

// Duration is the arrival time of the last request.
func (t *Trace) Duration() time.Duration {
	if len(t.Requests) == 0 {
		return 0
	}
	return t.Requests[len(t.Requests)-1].At
}

// Output budgets a replay can give its requests.
const (
	// BudgetTrace keeps each request's own max_new (an imported trace's:
	// its output length, a budget no client could know in advance).
	BudgetTrace = "trace"
	// BudgetWindow gives every request the rest of the context window as
	// its budget, as an engine does for a client that sends no max_tokens.
	BudgetWindow = "window"
)

// Budgets are the output budgets kvbench can replay with.
var Budgets = []string{BudgetTrace, BudgetWindow}

// WithWindowBudgets returns a copy of t in which every request's output
// budget (MaxNew) is the rest of a maxContext-token context window:
// maxContext - Prompt, or its own budget where that is larger (a request
// already longer than the window, which admission refuses either way).
// Outputs, and so the tokens generated, do not change.
func (t *Trace) WithWindowBudgets(maxContext int) *Trace {
	c := *t
	c.Requests = slices.Clone(t.Requests)
	for i := range c.Requests {
		r := &c.Requests[i]
		r.MaxNew = max(r.MaxNew, maxContext-r.Prompt)
	}
	return &c
}

// Limits beyond which a trace value is taken for a mistake.
const (
	maxTraceTokens = 1 << 30
	maxTraceAt     = 365 * 24 * time.Hour
	maxTraceLine   = 1 << 20
	maxNameLen     = 256
	maxBlockTokens = 1 << 20
)

// record is the union of all record types. Pointers tell a missing field
// from a zero one.
type record struct {
	Type string `json:"type"`
	// trace
	BlockTokens *int64 `json:"block_tokens"`
	// tenant
	Name          *string `json:"name"`
	QuotaPages    *int64  `json:"quota_pages"`
	ReservedPages *int64  `json:"reserved_pages"`
	SystemPrompt  *int64  `json:"system_prompt"`
	Domain        *string `json:"domain"`
	// request
	At         *float64 `json:"at"`
	ID         *string  `json:"id"`
	Tenant     *string  `json:"tenant"`
	Prompt     *int64   `json:"prompt"`
	Prefix     *int64   `json:"prefix"`
	PrefixID   *string  `json:"prefix_id"`
	Output     *int64   `json:"output"`
	MaxNew     *int64   `json:"max_new"`
	AbortAfter *int64   `json:"abort_after"`
	Blocks     *[]int64 `json:"blocks"`
}

var fieldsOf = map[string][]string{
	"trace":   {"type", "block_tokens"},
	"tenant":  {"type", "name", "quota_pages", "reserved_pages", "system_prompt", "domain"},
	"request": {"type", "at", "id", "tenant", "prompt", "prefix", "prefix_id", "blocks", "output", "max_new", "abort_after"},
}

// recordTypes lists the record types for messages.
const recordTypes = `"trace", "tenant" or "request"`

// ParseTrace reads a JSONL trace (see TraceFormat). name labels errors
// (usually the file name). Any bad line is reported as a *TraceError
// wrapping ErrBadTrace; a trace without a request as an *EmptyTraceError,
// which wraps it too.
func ParseTrace(r io.Reader, name string) (*Trace, error) {
	p := traceParser{file: name, tenants: map[string]int{}, domains: map[string]string{}, ids: map[string]int{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxTraceLine)
	for sc.Scan() {
		p.line++
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		if err := p.parseLine(line); err != nil {
			return nil, err
		}
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, p.fail("", "line longer than %d bytes", maxTraceLine)
		}
		return nil, fmt.Errorf("reading trace %s: %w", name, err)
	}
	if len(p.trace.Requests) == 0 {
		// Replaying nothing measures nothing: a run would report zeros as
		// if they were figures. An empty or truncated file, or the wrong
		// file, is the likely cause.
		return nil, &EmptyTraceError{File: name, Lines: p.line, Tenants: len(p.trace.Tenants)}
	}
	slices.SortStableFunc(p.trace.Requests, func(a, b Request) int { return cmp.Compare(a.At, b.At) })
	return &p.trace, nil
}

type traceParser struct {
	file    string
	line    int
	trace   Trace
	tenants map[string]int    // name → declaring line
	domains map[string]string // tenant name → its domain field
	ids     map[string]int    // request ID → line
	// traceLine is the line of the trace record, 0 before it.
	traceLine int
}

func (p *traceParser) fail(field, format string, args ...any) error {
	return &TraceError{File: p.file, Line: p.line, Field: field, Msg: fmt.Sprintf(format, args...)}
}

func (p *traceParser) parseLine(line []byte) error {
	var head struct {
		Type *string `json:"type"`
	}
	if err := json.Unmarshal(line, &head); err != nil {
		return p.jsonError(err)
	}
	if head.Type == nil {
		return p.fail("type", "missing (want %s)", recordTypes)
	}
	if _, ok := fieldsOf[*head.Type]; !ok {
		return p.fail("type", "unknown record type %q (want %s)", *head.Type, recordTypes)
	}
	var rec record
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&rec); err != nil {
		return p.jsonError(err)
	}
	if f := p.foreignField(&rec); f != "" {
		return p.fail(f, "not a field of a %q record (fields: %s)", rec.Type, strings.Join(fieldsOf[rec.Type], ", "))
	}
	switch rec.Type {
	case "trace":
		return p.traceRecord(&rec)
	case "tenant":
		return p.tenant(&rec)
	}
	return p.request(&rec)
}

// foreignField returns a field that the union struct accepted but that
// does not belong to the record's type.
func (p *traceParser) foreignField(r *record) string {
	type field struct {
		name string
		set  bool
	}
	all := []field{{"block_tokens", r.BlockTokens != nil},
		{"name", r.Name != nil}, {"quota_pages", r.QuotaPages != nil}, {"reserved_pages", r.ReservedPages != nil},
		{"system_prompt", r.SystemPrompt != nil}, {"domain", r.Domain != nil},
		{"at", r.At != nil}, {"id", r.ID != nil}, {"tenant", r.Tenant != nil}, {"prompt", r.Prompt != nil},
		{"prefix", r.Prefix != nil}, {"prefix_id", r.PrefixID != nil}, {"blocks", r.Blocks != nil},
		{"output", r.Output != nil}, {"max_new", r.MaxNew != nil}, {"abort_after", r.AbortAfter != nil}}
	own := fieldsOf[r.Type]
	for _, f := range all {
		if f.set && !slices.Contains(own, f.name) {
			return f.name
		}
	}
	return ""
}

// jsonError turns a decoding error into a TraceError naming the field
// where encoding/json knows it.
func (p *traceParser) jsonError(err error) error {
	var te *json.UnmarshalTypeError
	var se *json.SyntaxError
	switch {
	case errors.As(err, &te):
		want := te.Type.String()
		switch want {
		case "int64":
			want = "an integer"
		case "float64":
			want = "a number"
		case "string":
			want = "a string"
		case "[]int64":
			want = "an array of integers"
		}
		field := te.Field
		if field == "" {
			return p.fail("", "not a JSON object (got a JSON %s)", te.Value)
		}
		return p.fail(field, "want %s, got %s", want, te.Value)
	case errors.As(err, &se):
		return p.fail("", "malformed JSON at byte %d: %v", se.Offset, err)
	}
	if name, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
		name, _ = strconv.Unquote(name)
		return p.fail(name, "unknown field")
	}
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return p.fail("", "malformed JSON: unexpected end of line")
	}
	return p.fail("", "malformed JSON: %v", err)
}

func (p *traceParser) intField(name string, v *int64, def, lo, hi int64) (int, error) {
	if v == nil {
		if def < lo {
			return 0, p.fail(name, "missing")
		}
		return int(def), nil
	}
	if *v < lo || *v > hi {
		if *v < 0 {
			return 0, p.fail(name, "%d is negative, want %d..%d", *v, lo, hi)
		}
		return 0, p.fail(name, "%d out of range, want %d..%d", *v, lo, hi)
	}
	return int(*v), nil
}

func (p *traceParser) name(field string, v *string) (string, error) {
	if v == nil {
		return "", p.fail(field, "missing")
	}
	if *v == "" || len(*v) > maxNameLen {
		return "", p.fail(field, "%d bytes, want 1..%d", len(*v), maxNameLen)
	}
	return *v, nil
}

func (p *traceParser) traceRecord(r *record) error {
	if p.traceLine > 0 {
		return p.fail("type", "a second trace record (the first is on line %d)", p.traceLine)
	}
	if len(p.trace.Requests) > 0 {
		return p.fail("type", "a trace record after the first request (it must come before them)")
	}
	n, err := p.intField("block_tokens", r.BlockTokens, -1, 1, maxBlockTokens)
	if err != nil {
		return err
	}
	p.traceLine = p.line
	p.trace.BlockTokens = n
	return nil
}

func (p *traceParser) tenant(r *record) error {
	name, err := p.name("name", r.Name)
	if err != nil {
		return err
	}
	if prev, dup := p.tenants[name]; dup {
		return p.fail("name", "tenant %q already declared on line %d", name, prev)
	}
	t := Tenant{Name: name}
	if t.QuotaPages, err = p.intField("quota_pages", r.QuotaPages, 0, 0, math.MaxInt32); err != nil {
		return err
	}
	if t.ReservedPages, err = p.intField("reserved_pages", r.ReservedPages, 0, 0, math.MaxInt32); err != nil {
		return err
	}
	if t.QuotaPages > 0 && t.ReservedPages > t.QuotaPages {
		return p.fail("reserved_pages", "%d above quota_pages %d", t.ReservedPages, t.QuotaPages)
	}
	if t.SystemPrompt, err = p.intField("system_prompt", r.SystemPrompt, 0, 0, maxTraceTokens); err != nil {
		return err
	}
	if r.Domain != nil {
		if t.Domain, err = p.name("domain", r.Domain); err != nil {
			return err
		}
		if strings.HasPrefix(t.Domain, isolation.PrivateDomainPrefix) {
			return p.fail("domain", "%q starts with %q, which is reserved for tenants' own domains", t.Domain, isolation.PrivateDomainPrefix)
		}
	}
	p.tenants[name] = p.line
	p.domains[name] = t.Domain
	p.trace.Tenants = append(p.trace.Tenants, t)
	return nil
}

func (p *traceParser) request(r *record) error {
	req := Request{Line: p.line, AbortAfter: -1}
	if r.At == nil {
		return p.fail("at", "missing")
	}
	at := *r.At
	if at < 0 || at > maxTraceAt.Seconds() || math.IsNaN(at) {
		if at < 0 {
			return p.fail("at", "%v is negative, want seconds ≥ 0", at)
		}
		return p.fail("at", "%v out of range, want 0..%v seconds", at, maxTraceAt.Seconds())
	}
	req.At = time.Duration(math.Round(at * 1e9))
	if r.ID != nil {
		id, err := p.name("id", r.ID)
		if err != nil {
			return err
		}
		req.ID = id
	} else {
		req.ID = "L" + strconv.Itoa(p.line)
	}
	if prev, dup := p.ids[req.ID]; dup {
		return p.fail("id", "request %q already on line %d", req.ID, prev)
	}
	tenant, err := p.name("tenant", r.Tenant)
	if err != nil {
		return err
	}
	if _, ok := p.tenants[tenant]; !ok {
		return p.fail("tenant", "unknown tenant %q (declare it with a tenant line before its first request)", tenant)
	}
	req.Tenant = tenant
	if req.Prompt, err = p.intField("prompt", r.Prompt, -1, 1, maxTraceTokens); err != nil {
		return err
	}
	if req.Prefix, err = p.intField("prefix", r.Prefix, 0, 0, int64(req.Prompt)); err != nil {
		return err
	}
	if r.Blocks != nil {
		if req.Blocks, err = p.blocks(*r.Blocks, req.Prompt, r.Prefix != nil || r.PrefixID != nil); err != nil {
			return err
		}
	}
	switch {
	case r.PrefixID != nil && req.Prefix == 0:
		return p.fail("prefix_id", "given for a request with no prefix (set prefix ≥ 1)")
	case r.PrefixID != nil:
		if req.PrefixID, err = p.name("prefix_id", r.PrefixID); err != nil {
			return err
		}
	case req.Prefix > 0:
		req.PrefixID = DefaultPrefixID(tenant, p.domains[tenant])
	}
	if req.Output, err = p.intField("output", r.Output, -1, 0, maxTraceTokens); err != nil {
		return err
	}
	if req.MaxNew, err = p.intField("max_new", r.MaxNew, int64(req.Output), int64(req.Output), maxTraceTokens); err != nil {
		return err
	}
	if r.AbortAfter != nil {
		if req.Output == 0 {
			return p.fail("abort_after", "a request with output 0 cannot abort mid-generation")
		}
		if req.AbortAfter, err = p.intField("abort_after", r.AbortAfter, 0, 0, int64(req.Output)-1); err != nil {
			return err
		}
	}
	p.ids[req.ID] = p.line
	p.trace.Requests = append(p.trace.Requests, req)
	return nil
}

// blocks checks a request's block chain against its prompt.
func (p *traceParser) blocks(ids []int64, prompt int, hasPrefix bool) ([]int64, error) {
	bt := p.trace.BlockTokens
	switch {
	case hasPrefix:
		return nil, p.fail("blocks", "given with prefix or prefix_id: a request's shared content is either a block chain or a prefix")
	case bt == 0:
		return nil, p.fail("blocks", `no block size: declare it first with {"type":"trace","block_tokens":N}`)
	case len(ids) != BlockCount(prompt, bt):
		return nil, p.fail("blocks", "%d block IDs for a prompt of %d tokens, want %d (one per %d tokens, the last possibly partial)",
			len(ids), prompt, BlockCount(prompt, bt), bt)
	}
	for i, id := range ids {
		if id < 0 {
			return nil, p.fail("blocks", "block %d: ID %d is negative, want ≥ 0", i, id)
		}
	}
	return ids, nil
}

// DefaultPrefixID is the prefix_id of a request that names none: its
// tenant's domain if that names one, else the tenant.
func DefaultPrefixID(tenant, domain string) string {
	if domain != "" {
		return domain
	}
	return tenant
}

// WriteTrace writes t in the format ParseTrace reads. Arrival times are
// written in microseconds' precision.
func WriteTrace(w io.Writer, t *Trace) error {
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	if t.BlockTokens > 0 {
		rec := struct {
			Type        string `json:"type"`
			BlockTokens int    `json:"block_tokens"`
		}{"trace", t.BlockTokens}
		if err := enc.Encode(rec); err != nil {
			return err
		}
	}
	for _, tn := range t.Tenants {
		rec := struct {
			Type string `json:"type"`
			Tenant
		}{"tenant", tn}
		if err := enc.Encode(rec); err != nil {
			return err
		}
	}
	for _, r := range t.Requests {
		rec := struct {
			Type       string      `json:"type"`
			At         json.Number `json:"at"`
			ID         string      `json:"id"`
			Tenant     string      `json:"tenant"`
			Prompt     int         `json:"prompt"`
			Prefix     int         `json:"prefix,omitempty"`
			PrefixID   string      `json:"prefix_id,omitempty"`
			Blocks     []int64     `json:"blocks,omitempty"`
			Output     int         `json:"output"`
			MaxNew     int         `json:"max_new"`
			AbortAfter *int        `json:"abort_after,omitempty"`
		}{Type: "request", At: json.Number(strconv.FormatFloat(r.At.Round(time.Microsecond).Seconds(), 'f', -1, 64)),
			ID: r.ID, Tenant: r.Tenant, Prompt: r.Prompt, Prefix: r.Prefix, Blocks: r.Blocks, Output: r.Output, MaxNew: r.MaxNew}
		if r.Prefix > 0 {
			rec.PrefixID = r.PrefixID
		}
		if r.AbortAfter >= 0 {
			rec.AbortAfter = &r.AbortAfter
		}
		if err := enc.Encode(rec); err != nil {
			return err
		}
	}
	return bw.Flush()
}
