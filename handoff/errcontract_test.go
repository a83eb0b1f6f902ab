package handoff

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestErrorContract holds this package and handoff/grpcx to the promise
// of errors.go: every error they return wraps one of their sentinels (or
// kvcache's), so that a caller can always decide with errors.Is. Checked
// in the source, because the paths that break the promise are the rare
// ones a test does not reach: no errors.New inside a function (a sentinel
// belongs in errors.go), and no fmt.Errorf without %w. Tests are exempt.
func TestErrorContract(t *testing.T) {
	checkErrorContract(t, ".", "grpcx")
}

// checkErrorContract parses the non-test Go files of dirs and reports
// every errors.New inside a function and every fmt.Errorf whose format
// has no %w.
func checkErrorContract(t *testing.T, dirs ...string) {
	t.Helper()
	fset := token.NewFileSet()
	checked := 0
	for _, dir := range dirs {
		names, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range names {
			if strings.HasSuffix(name, "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
			if err != nil {
				t.Fatal(err)
			}
			checked++
			for _, decl := range f.Decls {
				_, inFunc := decl.(*ast.FuncDecl)
				ast.Inspect(decl, func(n ast.Node) bool {
					call, ok := n.(*ast.CallExpr)
					if !ok {
						return true
					}
					switch callee(call) {
					case "errors.New":
						if inFunc {
							t.Errorf("%v: errors.New inside a function: declare a sentinel in errors.go and wrap it", fset.Position(call.Pos()))
						}
					case "fmt.Errorf":
						if len(call.Args) == 0 || !strings.Contains(literal(call.Args[0]), "%w") {
							t.Errorf("%v: fmt.Errorf without %%w: wrap a sentinel", fset.Position(call.Pos()))
						}
					}
					return true
				})
			}
		}
	}
	if checked == 0 {
		t.Fatalf("no source files in %v", dirs)
	}
}

// callee names a call of a package-qualified function, e.g. "fmt.Errorf".
func callee(call *ast.CallExpr) string {
	sel, ok := call.Fun.(*ast.SelectorExpr)
	if !ok {
		return ""
	}
	pkg, ok := sel.X.(*ast.Ident)
	if !ok {
		return ""
	}
	return pkg.Name + "." + sel.Sel.Name
}

// literal returns the string literals of a format expression, joined: all
// of "%w: " + format is known but format.
func literal(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.BasicLit:
		s, _ := strconv.Unquote(e.Value)
		return s
	case *ast.BinaryExpr:
		return literal(e.X) + literal(e.Y)
	case *ast.ParenExpr:
		return literal(e.X)
	}
	return ""
}
