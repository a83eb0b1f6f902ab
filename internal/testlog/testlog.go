// Package testlog collects what a component logs, for its tests: a
// buffer any goroutine may write, a JSON slog.Logger over it, and the
// records read back.
package testlog

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// Buffer is a log's output. The zero value is ready to use.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write implements io.Writer; it is safe for concurrent use.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String is everything logged so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Logger logs into b as JSON, one line a record, every level from Debug.
func (b *Buffer) Logger() *slog.Logger {
	return slog.New(slog.NewJSONHandler(b, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// Records returns the records logged so far, each decoded into a map.
func (b *Buffer) Records(t testing.TB) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(b.String()), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("a log line that is not a JSON record: %v\n%s", err, line)
		}
		out = append(out, m)
	}
	return out
}

// WaitFor waits up to 10 s for the log to hold want, and fails t if it
// does not.
func (b *Buffer) WaitFor(t testing.TB, want string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(b.String(), want); {
		if time.Now().After(deadline) {
			t.Fatalf("%q not logged in\n%s", want, b.String())
		}
		time.Sleep(time.Millisecond)
	}
}
