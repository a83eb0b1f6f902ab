package bench

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
)

// TestNoWaitingAdmission keeps every admission under bench/ non-waiting.
// kvcache's Admit and AdmitInto follow golang.org/x/sync/semaphore: they
// wait until their context is done, context.Background() included, for
// pages or quota to free up. The simulator and the benchmarks expect a
// busy pool to refuse at once (the simulator's queue is where requests
// wait, and nothing would ever free pages for a benchmark parked inside
// the pool), so they must call TryAdmit / TryAdmitInto; one Admit left
// behind would hang kvbench on the first full pool.
func TestNoWaitingAdmission(t *testing.T) {
	fset := token.NewFileSet()
	var found []string
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") {
			return err
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			if sel, ok := call.Fun.(*ast.SelectorExpr); ok && (sel.Sel.Name == "Admit" || sel.Sel.Name == "AdmitInto") {
				found = append(found, fset.Position(call.Pos()).String()+": "+sel.Sel.Name)
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(found) > 0 {
		t.Errorf("waiting admissions under bench/ (use TryAdmit / TryAdmitInto):\n\t%s", strings.Join(found, "\n\t"))
	}
}
