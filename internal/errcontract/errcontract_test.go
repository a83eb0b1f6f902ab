package errcontract

import (
	"go/parser"
	"go/token"
	"strings"
	"testing"
)

func TestProblemsFindsEveryBreak(t *testing.T) {
	src := `package p

import ("errors"; "fmt")

var ErrX = errors.New("p: x") // a sentinel: fine

func good(n int) error { return fmt.Errorf("%w: n = %d", ErrX, n) }
func joined(f string) error { return fmt.Errorf("%w: "+f, ErrX) }
func bare() error { return errors.New("p: made up here") }
func unwrapped(n int) error { return fmt.Errorf("p: n = %d", n) }
func dynamic(f string) error { return fmt.Errorf(f) }
`
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "p.go", src, 0)
	if err != nil {
		t.Fatal(err)
	}
	got := Problems(fset, f)
	want := []string{"p.go:9:28: errors.New inside", "p.go:10:38: fmt.Errorf without %w", "p.go:11:39: fmt.Errorf without %w"}
	if len(got) != len(want) {
		t.Fatalf("got %d problems, want %d: %q", len(got), len(want), got)
	}
	for i := range want {
		if !strings.HasPrefix(got[i], want[i]) {
			t.Errorf("problem %d = %q, want it to start with %q", i, got[i], want[i])
		}
	}
}
