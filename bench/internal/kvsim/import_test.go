package kvsim

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const mooncakeFixture = `{"timestamp": 1500, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]}
{"timestamp": 1000, "input_length": 512, "output_length": 0, "hash_ids": [0]}

{"timestamp": 2500.5, "input_length": 1, "output_length": 7, "hash_ids": [9]}
`

func TestParseMooncake(t *testing.T) {
	tr, err := ParseMooncake(strings.NewReader(mooncakeFixture), "m.jsonl", ImportConfig{})
	require.NoError(t, err)
	assert.Equal(t, MooncakeBlockTokens, tr.BlockTokens)
	assert.Equal(t, []Tenant{{Name: "mooncake"}}, tr.Tenants)
	want := []Request{
		{Line: 2, At: 0, ID: "L2", Tenant: "mooncake", Prompt: 512, Blocks: []int64{0}, Output: 0, MaxNew: 0, AbortAfter: -1},
		{Line: 1, At: 500 * time.Millisecond, ID: "L1", Tenant: "mooncake", Prompt: 1100, Blocks: []int64{0, 1, 2}, Output: 20, MaxNew: 20, AbortAfter: -1},
		{Line: 4, At: 1500500 * time.Microsecond, ID: "L4", Tenant: "mooncake", Prompt: 1, Blocks: []int64{9}, Output: 7, MaxNew: 7, AbortAfter: -1},
	}
	assert.Equal(t, want, tr.Requests, "arrivals from the earliest timestamp, sorted")
}

func TestParseMooncakeBadInput(t *testing.T) {
	good := `{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}` + "\n"
	tests := []struct {
		name, line, field, msg string
	}{
		{"malformed JSON", `{"timestamp": 0,`, "", "malformed JSON"},
		{"not an object", `[1]`, "", "not a JSON object"},
		{"two values", `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]} {}`, "", "more than one value"},
		{"unknown field", `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0], "tenant": "a"}`, "tenant", "unknown field"},
		{"missing timestamp", `{"input_length": 1, "output_length": 1, "hash_ids": [0]}`, "timestamp", "missing"},
		{"negative timestamp", `{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [0]}`, "timestamp", "negative"},
		{"timestamp a string", `{"timestamp": "0", "input_length": 1, "output_length": 1, "hash_ids": [0]}`, "timestamp", "want a number"},
		{"huge timestamp", `{"timestamp": 1e300, "input_length": 1, "output_length": 1, "hash_ids": [0]}`, "timestamp", "out of range"},
		{"missing input_length", `{"timestamp": 0, "output_length": 1, "hash_ids": [0]}`, "input_length", "missing"},
		{"zero input_length", `{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}`, "input_length", "out of range"},
		{"fractional input_length", `{"timestamp": 0, "input_length": 1.5, "output_length": 1, "hash_ids": [0]}`, "input_length", "want an integer"},
		{"negative output_length", `{"timestamp": 0, "input_length": 1, "output_length": -4, "hash_ids": [0]}`, "output_length", "negative"},
		{"missing output_length", `{"timestamp": 0, "input_length": 1, "hash_ids": [0]}`, "output_length", "missing"},
		{"missing hash_ids", `{"timestamp": 0, "input_length": 1, "output_length": 1}`, "hash_ids", "missing"},
		{"too few hash_ids", `{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}`, "hash_ids", "2 block IDs for input_length 1025, want 3"},
		{"too many hash_ids", `{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0, 1]}`, "hash_ids", "want 1"},
		{"negative hash ID", `{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, -1]}`, "hash_ids", "block 1: ID -1 is negative"},
		{"hash ID a string", `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}`, "hash_ids", "want an integer"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// The bad line is line 3, after a good line and a blank one.
			_, err := ParseMooncake(strings.NewReader(good+"\n"+tt.line+"\n"+good), "m.jsonl", ImportConfig{})
			var te *TraceError
			require.ErrorAs(t, err, &te, "%v", err)
			assert.ErrorIs(t, err, ErrBadTrace)
			assert.Equal(t, 3, te.Line, "line of %v", err)
			assert.Equal(t, tt.field, te.Field, "field of %v", err)
			assert.Contains(t, err.Error(), "m.jsonl:3")
			assert.Contains(t, err.Error(), tt.msg)
		})
	}
	_, err := ParseMooncake(strings.NewReader("\n# nothing\n"), "m.jsonl", ImportConfig{})
	var ee *EmptyTraceError
	require.ErrorAs(t, err, &ee)
	assert.ErrorIs(t, err, ErrBadTrace)
	assert.Contains(t, err.Error(), "m.jsonl: no requests to replay")
}

const azureFixture = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n" +
	"2023-11-16 18:15:50.9951690,396,109\r\n" +
	"2023-11-16 18:15:46.6805900,374,44\r\n" +
	"2023-11-16 18:16:46.6805900,1,0"

func TestParseAzure(t *testing.T) {
	tr, err := ParseAzure(strings.NewReader(azureFixture), "a.csv", ImportConfig{})
	require.NoError(t, err)
	assert.Equal(t, []Tenant{{Name: "azure"}}, tr.Tenants)
	assert.Zero(t, tr.BlockTokens)
	want := []Request{
		{Line: 3, At: 0, ID: "L3", Tenant: "azure", Prompt: 374, Output: 44, MaxNew: 44, AbortAfter: -1},
		{Line: 2, At: 4314579 * time.Microsecond, ID: "L2", Tenant: "azure", Prompt: 396, Output: 109, MaxNew: 109, AbortAfter: -1},
		{Line: 4, At: time.Minute, ID: "L4", Tenant: "azure", Prompt: 1, Output: 0, MaxNew: 0, AbortAfter: -1},
	}
	assert.Equal(t, want, tr.Requests)

	// Columns in another order, RFC 3339 times.
	tr, err = ParseAzure(strings.NewReader("GeneratedTokens,TIMESTAMP,ContextTokens\n5,2024-05-10T00:00:01Z,7\n"), "b.csv", ImportConfig{})
	require.NoError(t, err)
	assert.Equal(t, []Request{{Line: 2, ID: "L2", Tenant: "azure", Prompt: 7, Output: 5, MaxNew: 5, AbortAfter: -1}}, tr.Requests)
}

func TestParseAzureBadInput(t *testing.T) {
	const header = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
	const good = "2023-11-16 18:15:46.6805900,374,44\n"
	tests := []struct {
		name, text      string
		line            int
		field, msg      string
		skipGoodPreface bool
	}{
		{"unknown column", "TIMESTAMP,ContextTokens,GeneratedTokens,Model\n", 1, "Model", "unknown column", true},
		{"missing column", "TIMESTAMP,ContextTokens\n", 1, "GeneratedTokens", "column missing", true},
		{"column twice", "TIMESTAMP,ContextTokens,contexttokens\n", 1, "ContextTokens", "given twice", true},
		{"bad time", "yesterday,10,1\n", 3, "TIMESTAMP", `"yesterday" is not a time`, false},
		{"context not an integer", "2023-11-16 18:15:46.6,ten,1\n", 3, "ContextTokens", `"ten" is not an integer`, false},
		{"zero context", "2023-11-16 18:15:46.6,0,1\n", 3, "ContextTokens", "out of range", false},
		{"negative output", "2023-11-16 18:15:46.6,10,-1\n", 3, "GeneratedTokens", "negative", false},
		{"huge context", "2023-11-16 18:15:46.6,99999999999999999999,1\n", 3, "ContextTokens", "out of range", false},
		{"too few fields", "2023-11-16 18:15:46.6,10\n", 3, "", "2 fields, want 3", false},
		{"malformed CSV", "2023-11-16 18:15:46.6,\"10,1\n", 3, "", "malformed CSV", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			text := header + good + tt.text
			if tt.skipGoodPreface {
				text = tt.text + good
			}
			_, err := ParseAzure(strings.NewReader(text), "a.csv", ImportConfig{})
			var te *TraceError
			require.ErrorAs(t, err, &te, "%v", err)
			assert.ErrorIs(t, err, ErrBadTrace)
			assert.Equal(t, tt.line, te.Line, "line of %v", err)
			assert.Equal(t, tt.field, te.Field, "field of %v", err)
			assert.Contains(t, err.Error(), tt.msg)
		})
	}
	for name, text := range map[string]string{"empty": "", "header only": header} {
		_, err := ParseAzure(strings.NewReader(text), "a.csv", ImportConfig{})
		var ee *EmptyTraceError
		require.ErrorAs(t, err, &ee, name)
		assert.Contains(t, err.Error(), "a.csv: no requests to replay", name)
	}
}

// -trace-tenants: request i goes to tenant i mod N; with an organisation
// size, the tenants form domains.
func TestImportSpreadsTenants(t *testing.T) {
	var lines strings.Builder
	for i := range 7 {
		lines.WriteString(`{"timestamp": ` + string(rune('0'+i)) + `, "input_length": 10, "output_length": 1, "hash_ids": [0]}` + "\n")
	}
	tr, err := ParseMooncake(strings.NewReader(lines.String()), "", ImportConfig{Tenants: 3, OrgSize: 2})
	require.NoError(t, err)
	assert.Equal(t, []Tenant{{Name: "mooncake-00", Domain: "org-00"}, {Name: "mooncake-01", Domain: "org-00"},
		{Name: "mooncake-02", Domain: "org-01"}}, tr.Tenants)
	var got []string
	for _, r := range tr.Requests {
		got = append(got, r.Tenant)
	}
	assert.Equal(t, []string{"mooncake-00", "mooncake-01", "mooncake-02", "mooncake-00", "mooncake-01", "mooncake-02", "mooncake-00"}, got)

	tr, err = ParseAzure(strings.NewReader(azureFixture), "", ImportConfig{Tenants: 2})
	require.NoError(t, err)
	assert.Equal(t, []Tenant{{Name: "azure-00"}, {Name: "azure-01"}}, tr.Tenants, "no organisation size: no domains")
	_, err = ParseAzure(strings.NewReader(azureFixture), "", ImportConfig{Tenants: 256})
	assert.ErrorIs(t, err, ErrBadConfig)
}

func TestReadTraceDetectsFormat(t *testing.T) {
	kv := "# a kvbench trace\n" + tenantsHeader + `{"type":"request","at":0,"tenant":"acme","prompt":5,"output":1}` + "\n"
	long := `{"timestamp": 0, "input_length": 600000, "output_length": 1, "hash_ids": [` + strings.Repeat("7, ", 1171) + "7]}\n"
	for _, tt := range []struct {
		name, text, want string
		requests         int
	}{
		{"kvbench", kv, FormatKvbench, 1},
		{"mooncake", mooncakeFixture, FormatMooncake, 3},
		{"mooncake, a line longer than the detector peeks", strings.Repeat(long, 10), FormatMooncake, 10},
		{"azure", azureFixture, FormatAzure, 3},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tr, format, err := ReadTrace(strings.NewReader(tt.text), "f", FormatAuto, ImportConfig{})
			require.NoError(t, err)
			assert.Equal(t, tt.want, format)
			assert.Len(t, tr.Requests, tt.requests)
		})
	}
	_, _, err := ReadTrace(strings.NewReader("\n\nhello world\n"), "f.txt", "", ImportConfig{})
	var te *TraceError
	require.ErrorAs(t, err, &te)
	assert.Equal(t, 3, te.Line)
	assert.Contains(t, err.Error(), "cannot tell the trace format")
	// An explicit format is not second-guessed: a Mooncake file read as
	// kvbench's fails on its first line.
	_, _, err = ReadTrace(strings.NewReader(mooncakeFixture), "m", FormatKvbench, ImportConfig{})
	assert.ErrorContains(t, err, `m:1: field "type": missing`)
	_, _, err = ReadTrace(strings.NewReader(kv), "k", FormatAuto, ImportConfig{Tenants: 2})
	assert.ErrorIs(t, err, ErrBadConfig, "a kvbench trace names its own tenants")
	_, _, err = ReadTrace(strings.NewReader(kv), "k", "csv", ImportConfig{})
	assert.ErrorIs(t, err, ErrBadConfig)
}

// sharedTraces finds the public traces (see their README): in
// $KVFENCE_TRACES, else in the nearest shared/traces beside a directory
// above this one (../shared/traces of the checkout, wherever it is).
// Tests that read them skip when they are absent.
func sharedTraces() string {
	if dir := os.Getenv("KVFENCE_TRACES"); dir != "" {
		return dir
	}
	dir, err := os.Getwd()
	if err != nil {
		return ""
	}
	for {
		if fi, err := os.Stat(filepath.Join(dir, "shared", "traces")); err == nil && fi.IsDir() {
			return filepath.Join(dir, "shared", "traces")
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

func openSharedTrace(t *testing.T, rel string) *os.File {
	t.Helper()
	dir := sharedTraces()
	if dir == "" {
		t.Skipf("%s absent (the public traces live in ../shared/traces, or set KVFENCE_TRACES)", rel)
	}
	f, err := os.Open(filepath.Join(dir, rel))
	if os.IsNotExist(err) {
		t.Skipf("%s absent from %s", rel, dir)
	}
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	return f
}

// The public traces import whole, and the Mooncake ones' bounds are near
// the cache ratios their paper gives (FAST '25, Table 2: 66 % and 40 %;
// its own count, of blocks rather than of pages).
func TestImportSharedTraces(t *testing.T) {
	for _, tt := range []struct {
		file     string
		format   string
		requests int
		bound    float64
	}{
		{"mooncake/synthetic_trace.jsonl", FormatMooncake, 3993, 0.66},
		{"mooncake/conversation_trace.jsonl", FormatMooncake, 12031, 0.40},
		{"azure/AzureLLMInferenceTrace_conv.csv", FormatAzure, 19366, 0},
		{"azure/AzureLLMInferenceTrace_code.csv", FormatAzure, 8819, 0},
	} {
		t.Run(tt.file, func(t *testing.T) {
			tr, format, err := ReadTrace(openSharedTrace(t, tt.file), tt.file, FormatAuto, ImportConfig{})
			require.NoError(t, err)
			assert.Equal(t, tt.format, format)
			assert.Len(t, tr.Requests, tt.requests)
			b := Bound(tr, 16, 1<<20, DomainsPerTenant)
			assert.Equal(t, tt.requests, b.Requests)
			assert.InDelta(t, tt.bound, b.HitRate, 0.03, "bound %.4f", b.HitRate)
		})
	}
}

// Whatever ReadTrace accepts, in any format, writes to a kvbench trace
// that parses to the same requests; whatever it refuses is a TraceError
// with a line, or an empty trace.
func FuzzReadTrace(f *testing.F) {
	f.Add(mooncakeFixture)
	f.Add(azureFixture)
	f.Add(`{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1, 9223372036854775807]}`)
	f.Add("ContextTokens,TIMESTAMP,GeneratedTokens\n5,2023-11-16 18:15:46.6805900,0\n\"x\n")
	f.Add(blocksHeader + `{"type":"request","at":0,"tenant":"acme","prompt":5,"blocks":[3,4],"output":1}`)
	f.Fuzz(func(t *testing.T, in string) {
		tr, _, err := ReadTrace(strings.NewReader(in), "fuzz", FormatAuto, ImportConfig{Tenants: 2, OrgSize: 2})
		if err != nil {
			var te *TraceError
			var ee *EmptyTraceError
			switch {
			case errors.As(err, &te):
				require.ErrorIs(t, err, ErrBadTrace)
				require.Positive(t, te.Line, "%v", err)
			case errors.As(err, &ee):
			default:
				require.ErrorIs(t, err, ErrBadConfig) // a kvbench trace spread over tenants
			}
			return
		}
		var buf bytes.Buffer
		require.NoError(t, WriteTrace(&buf, tr))
		back, err := ParseTrace(&buf, "")
		require.NoError(t, err, "re-parsing\n%s", buf.String())
		require.Len(t, back.Requests, len(tr.Requests))
		require.Equal(t, tr.BlockTokens, back.BlockTokens)
		for i, r := range tr.Requests {
			b := back.Requests[i]
			b.Line, r.Line = 0, 0
			r.At = r.At.Round(time.Microsecond)
			if len(r.Blocks) == 0 {
				r.Blocks = nil
			}
			require.Equal(t, r, b)
		}
	})
}
