package kvsim

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const tenantsHeader = `{"type":"tenant","name":"acme"}
{"type":"tenant","name":"beta","quota_pages":64,"reserved_pages":8,"system_prompt":300}
`

func TestParseTraceBadInput(t *testing.T) {
	tests := []struct {
		name  string
		line  string // appended after the two tenant lines, so it is line 3
		field string
		msg   string
	}{
		{"malformed JSON", `{"type":"request",`, "", "malformed JSON"},
		{"not JSON", `hello`, "", "malformed JSON"},
		{"not an object", `[1,2]`, "", "not a JSON object"},
		{"missing type", `{"at":1}`, "type", "missing"},
		{"unknown type", `{"type":"reqest"}`, "type", "unknown record type"},
		{"blocks without a block size", `{"type":"request","at":0,"tenant":"acme","prompt":10,"blocks":[1],"output":1}`, "blocks", "no block size"},
		{"block_tokens on a request", `{"type":"request","at":0,"tenant":"acme","prompt":10,"block_tokens":4,"output":1}`, "block_tokens", "not a field"},
		{"blocks on a tenant", `{"type":"tenant","name":"c","blocks":[1]}`, "blocks", "not a field"},
		{"name on a trace record", `{"type":"trace","block_tokens":4,"name":"x"}`, "name", "not a field"},
		{"trace record without block_tokens", `{"type":"trace"}`, "block_tokens", "missing"},
		{"zero block_tokens", `{"type":"trace","block_tokens":0}`, "block_tokens", "out of range"},
		{"huge block_tokens", `{"type":"trace","block_tokens":1048577}`, "block_tokens", "out of range"},
		{"type not a string", `{"type":5}`, "type", "want a string"},
		{"unknown field", `{"type":"request","at":0,"tenant":"acme","prompt":1,"output":1,"promt":3}`, "promt", "unknown field"},
		{"tenant field on request", `{"type":"request","at":0,"tenant":"acme","prompt":1,"output":1,"quota_pages":3}`, "quota_pages", "not a field"},
		{"missing at", `{"type":"request","tenant":"acme","prompt":1,"output":1}`, "at", "missing"},
		{"negative at", `{"type":"request","at":-0.5,"tenant":"acme","prompt":1,"output":1}`, "at", "negative"},
		{"at a string", `{"type":"request","at":"soon","tenant":"acme","prompt":1,"output":1}`, "at", "want a number"},
		{"missing tenant", `{"type":"request","at":0,"prompt":1,"output":1}`, "tenant", "missing"},
		{"unknown tenant", `{"type":"request","at":0,"tenant":"gamma","prompt":1,"output":1}`, "tenant", `unknown tenant "gamma"`},
		{"missing prompt", `{"type":"request","at":0,"tenant":"acme","output":1}`, "prompt", "missing"},
		{"negative prompt", `{"type":"request","at":0,"tenant":"acme","prompt":-5,"output":1}`, "prompt", "-5 is negative"},
		{"zero prompt", `{"type":"request","at":0,"tenant":"acme","prompt":0,"output":1}`, "prompt", "out of range"},
		{"fractional prompt", `{"type":"request","at":0,"tenant":"acme","prompt":1.5,"output":1}`, "prompt", "want an integer"},
		{"huge prompt", `{"type":"request","at":0,"tenant":"acme","prompt":99999999999999999999,"output":1}`, "prompt", "want an integer"},
		{"missing output", `{"type":"request","at":0,"tenant":"acme","prompt":1}`, "output", "missing"},
		{"negative output", `{"type":"request","at":0,"tenant":"acme","prompt":1,"output":-1}`, "output", "negative"},
		{"prefix above prompt", `{"type":"request","at":0,"tenant":"acme","prompt":10,"prefix":11,"output":1}`, "prefix", "out of range"},
		{"max_new below output", `{"type":"request","at":0,"tenant":"acme","prompt":10,"output":5,"max_new":4}`, "max_new", "out of range"},
		{"abort_after at output", `{"type":"request","at":0,"tenant":"acme","prompt":10,"output":5,"abort_after":5}`, "abort_after", "out of range"},
		{"abort_after without output", `{"type":"request","at":0,"tenant":"acme","prompt":10,"output":0,"abort_after":0}`, "abort_after", "cannot abort"},
		{"empty id", `{"type":"request","at":0,"id":"","tenant":"acme","prompt":1,"output":1}`, "id", "want 1..256"},
		{"duplicate tenant", `{"type":"tenant","name":"acme"}`, "name", "already declared on line 1"},
		{"negative quota", `{"type":"tenant","name":"c","quota_pages":-1}`, "quota_pages", "negative"},
		{"reservation over quota", `{"type":"tenant","name":"c","quota_pages":4,"reserved_pages":5}`, "reserved_pages", "above quota_pages"},
		{"empty domain", `{"type":"tenant","name":"c","domain":""}`, "domain", "want 1..256"},
		{"reserved domain", `{"type":"tenant","name":"c","domain":"tenant:acme"}`, "domain", "reserved for tenants' own domains"},
		{"domain not a string", `{"type":"tenant","name":"c","domain":3}`, "domain", "want a string"},
		{"domain on a request", `{"type":"request","at":0,"tenant":"acme","prompt":1,"output":1,"domain":"x"}`, "domain", "not a field"},
		{"prefix_id on a tenant", `{"type":"tenant","name":"c","prefix_id":"x"}`, "prefix_id", "not a field"},
		{"prefix_id without prefix", `{"type":"request","at":0,"tenant":"acme","prompt":10,"prefix_id":"sys","output":1}`, "prefix_id", "no prefix"},
		{"empty prefix_id", `{"type":"request","at":0,"tenant":"acme","prompt":10,"prefix":4,"prefix_id":"","output":1}`, "prefix_id", "want 1..256"},
		{"long prefix_id", `{"type":"request","at":0,"tenant":"acme","prompt":10,"prefix":4,"prefix_id":"` + strings.Repeat("x", 257) + `","output":1}`, "prefix_id", "257 bytes"},
		{"two values on a line", `{"type":"tenant","name":"c"} {"type":"tenant","name":"d"}`, "", "after top-level value"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseTrace(strings.NewReader(tenantsHeader+tt.line+"\n"), "t.jsonl")
			require.Error(t, err)
			assert.ErrorIs(t, err, ErrBadTrace)
			var te *TraceError
			require.ErrorAs(t, err, &te)
			assert.Equal(t, 3, te.Line, "line of %v", err)
			assert.Equal(t, tt.field, te.Field, "field of %v", err)
			assert.Contains(t, err.Error(), tt.msg)
			assert.Contains(t, err.Error(), "t.jsonl:3")
		})
	}
}

// A trace without a request (an empty file, comments only, tenants only)
// is refused, naming the file: replaying it would report zeros as figures.
func TestParseTraceEmpty(t *testing.T) {
	for name, in := range map[string]string{
		"empty":        "",
		"blank":        "\n\n",
		"comments":     "# nothing yet\n",
		"tenants only": tenantsHeader,
	} {
		t.Run(name, func(t *testing.T) {
			tr, err := ParseTrace(strings.NewReader(in), "w.jsonl")
			require.ErrorIs(t, err, ErrBadTrace)
			assert.Nil(t, tr)
			var ee *EmptyTraceError
			require.ErrorAs(t, err, &ee)
			assert.Equal(t, strings.Count(in, "\n"), ee.Lines)
			assert.Contains(t, err.Error(), "w.jsonl: no requests")
		})
	}
	_, err := ParseTrace(strings.NewReader(""), "")
	assert.Contains(t, err.Error(), "trace: no requests", "a name when none is given")
}

// blocksHeader declares blocks of 4 tokens and a tenant.
const blocksHeader = `{"type":"trace","block_tokens":4}
{"type":"tenant","name":"acme"}
`

func TestParseTraceBlocksBadInput(t *testing.T) {
	tests := []struct {
		name  string
		line  string // line 3
		field string
		msg   string
	}{
		{"too few blocks", `{"type":"request","at":0,"tenant":"acme","prompt":9,"blocks":[1,2],"output":1}`, "blocks", "2 block IDs for a prompt of 9 tokens, want 3"},
		{"too many blocks", `{"type":"request","at":0,"tenant":"acme","prompt":8,"blocks":[1,2,3],"output":1}`, "blocks", "want 2"},
		{"no blocks", `{"type":"request","at":0,"tenant":"acme","prompt":1,"blocks":[],"output":1}`, "blocks", "want 1"},
		{"negative block ID", `{"type":"request","at":0,"tenant":"acme","prompt":8,"blocks":[1,-2],"output":1}`, "blocks", "block 1: ID -2 is negative"},
		{"fractional block ID", `{"type":"request","at":0,"tenant":"acme","prompt":8,"blocks":[1,2.5],"output":1}`, "blocks", "want an integer"},
		{"blocks not an array", `{"type":"request","at":0,"tenant":"acme","prompt":8,"blocks":7,"output":1}`, "blocks", "want an array of integers"},
		{"blocks and a prefix", `{"type":"request","at":0,"tenant":"acme","prompt":8,"prefix":4,"blocks":[1,2],"output":1}`, "blocks", "either a block chain or a prefix"},
		{"a second trace record", `{"type":"trace","block_tokens":8}`, "type", "second trace record (the first is on line 1)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseTrace(strings.NewReader(blocksHeader+tt.line+"\n"), "b.jsonl")
			var te *TraceError
			require.ErrorAs(t, err, &te)
			assert.ErrorIs(t, err, ErrBadTrace)
			assert.Equal(t, 3, te.Line, "line of %v", err)
			assert.Equal(t, tt.field, te.Field, "field of %v", err)
			assert.Contains(t, err.Error(), tt.msg)
		})
	}
	// The block size must be known before the first request.
	_, err := ParseTrace(strings.NewReader(`{"type":"tenant","name":"acme"}
{"type":"request","at":0,"tenant":"acme","prompt":1,"output":1}
{"type":"trace","block_tokens":4}
`), "late.jsonl")
	assert.ErrorContains(t, err, `late.jsonl:3: field "type": a trace record after the first request`)
}

func TestParseTraceBlocks(t *testing.T) {
	in := blocksHeader + `{"type":"request","at":1,"id":"a","tenant":"acme","prompt":9,"blocks":[0,1,2],"output":3}
{"type":"request","at":0,"id":"b","tenant":"acme","prompt":4,"blocks":[0],"output":0}
{"type":"request","at":2,"id":"c","tenant":"acme","prompt":5,"prefix":2,"output":1}
`
	tr, err := ParseTrace(strings.NewReader(in), "")
	require.NoError(t, err)
	assert.Equal(t, 4, tr.BlockTokens)
	require.Len(t, tr.Requests, 3)
	assert.Equal(t, Request{Line: 4, At: 0, ID: "b", Tenant: "acme", Prompt: 4, Blocks: []int64{0}, MaxNew: 0, AbortAfter: -1}, tr.Requests[0])
	assert.Equal(t, []int64{0, 1, 2}, tr.Requests[1].Blocks)
	assert.Nil(t, tr.Requests[2].Blocks, "a request with a prefix has no chain")
	assert.Equal(t, "acme", tr.Requests[2].PrefixID)

	// A trace with blocks writes back to the same trace.
	var buf bytes.Buffer
	require.NoError(t, WriteTrace(&buf, tr))
	assert.True(t, strings.HasPrefix(buf.String(), `{"type":"trace","block_tokens":4}`+"\n"), buf.String())
	back, err := ParseTrace(&buf, "")
	require.NoError(t, err)
	for i := range back.Requests {
		back.Requests[i].Line = tr.Requests[i].Line
	}
	assert.Equal(t, tr, back)
}

func TestParseTraceDuplicateID(t *testing.T) {
	in := tenantsHeader + `{"type":"request","at":0,"id":"x","tenant":"acme","prompt":1,"output":1}
# a comment, then a blank line

{"type":"request","at":1,"id":"x","tenant":"acme","prompt":1,"output":1}
`
	_, err := ParseTrace(strings.NewReader(in), "")
	var te *TraceError
	require.ErrorAs(t, err, &te)
	assert.Equal(t, 6, te.Line)
	assert.Equal(t, "id", te.Field)
	assert.Contains(t, err.Error(), "already on line 3")
}

func TestParseTraceGood(t *testing.T) {
	in := tenantsHeader + `
{"type":"request","at":2.5,"tenant":"acme","prompt":100,"output":10}
  {"type":"request","at":0.000001,"id":"b1","tenant":"beta","prompt":400,"prefix":300,"output":20,"max_new":64,"abort_after":7}
`
	tr, err := ParseTrace(strings.NewReader(in), "")
	require.NoError(t, err)
	assert.Equal(t, []Tenant{{Name: "acme"}, {Name: "beta", QuotaPages: 64, ReservedPages: 8, SystemPrompt: 300}}, tr.Tenants)
	require.Len(t, tr.Requests, 2)
	// Sorted by arrival.
	assert.Equal(t, Request{Line: 5, At: time.Microsecond, ID: "b1", Tenant: "beta", Prompt: 400, Prefix: 300, PrefixID: "beta",
		Output: 20, MaxNew: 64, AbortAfter: 7}, tr.Requests[0])
	assert.Equal(t, Request{Line: 4, At: 2500 * time.Millisecond, ID: "L4", Tenant: "acme", Prompt: 100,
		Output: 10, MaxNew: 10, AbortAfter: -1}, tr.Requests[1])
	assert.Equal(t, 7, tr.Requests[0].Generated())
	assert.Equal(t, 10, tr.Requests[1].Generated())
	assert.Equal(t, 2500*time.Millisecond, tr.Duration())
}

func TestParseTracePrefixIDs(t *testing.T) {
	in := `{"type":"tenant","name":"a","domain":"org"}
{"type":"tenant","name":"b"}
{"type":"request","at":0,"id":"a1","tenant":"a","prompt":10,"prefix":4,"output":1}
{"type":"request","at":0,"id":"a2","tenant":"a","prompt":10,"prefix":4,"prefix_id":"public","output":1}
{"type":"request","at":0,"id":"b1","tenant":"b","prompt":10,"prefix":4,"output":1}
{"type":"request","at":0,"id":"b2","tenant":"b","prompt":10,"output":1}
`
	tr, err := ParseTrace(strings.NewReader(in), "")
	require.NoError(t, err)
	assert.Equal(t, "org", tr.Tenants[0].Domain)
	assert.Empty(t, tr.Tenants[1].Domain)
	var ids []string
	for _, r := range tr.Requests {
		ids = append(ids, r.PrefixID)
	}
	assert.Equal(t, []string{"org", "public", "b", ""}, ids, "default: the tenant's domain, else its name; none without a prefix")
}

func TestWriteParseRoundTrip(t *testing.T) {
	tr, err := Generate(testGenConfig(7))
	require.NoError(t, err)
	require.NotEmpty(t, tr.Requests)
	var buf bytes.Buffer
	require.NoError(t, WriteTrace(&buf, tr))
	back, err := ParseTrace(&buf, "")
	require.NoError(t, err)
	for i := range back.Requests {
		back.Requests[i].Line = 0
	}
	assert.Equal(t, tr, back)
}

func FuzzParseTrace(f *testing.F) {
	f.Add(tenantsHeader + `{"type":"request","at":1,"tenant":"acme","prompt":5,"output":2,"abort_after":1}`)
	f.Add(`{"type":"tenant","name":"x","quota_pages":1}` + "\n" + `{"type":"request","at":0,"tenant":"x","prompt":1,"output":0}`)
	f.Add(`{"type":"request","at":1e400}`)
	f.Add(`{"type":"tenant","name":"x","domain":"org"}` + "\n" + `{"type":"request","at":0,"tenant":"x","prompt":9,"prefix":3,"prefix_id":"p","output":0}`)
	f.Add("{\"type\":\"tenant\",\"name\":\"\xff\"}\n#\n\n[]")
	f.Add(blocksHeader + `{"type":"request","at":0,"tenant":"acme","prompt":9,"blocks":[0,1,2],"output":3,"max_new":8}`)
	f.Fuzz(func(t *testing.T, in string) {
		tr, err := ParseTrace(strings.NewReader(in), "fuzz")
		if err != nil {
			var te *TraceError
			if errors.As(err, &te) {
				require.ErrorIs(t, err, ErrBadTrace)
				require.Positive(t, te.Line)
			}
			return
		}
		// Whatever parses writes back to a trace that parses the same.
		var buf bytes.Buffer
		require.NoError(t, WriteTrace(&buf, tr))
		back, err := ParseTrace(&buf, "")
		require.NoError(t, err, "re-parsing\n%s", buf.String())
		require.Len(t, back.Requests, len(tr.Requests))
		for i, r := range tr.Requests {
			b := back.Requests[i]
			b.Line, r.Line = 0, 0
			r.At = r.At.Round(time.Microsecond)
			require.Equal(t, r, b)
		}
	})
}
