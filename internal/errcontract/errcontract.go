// Package errcontract checks, in a package's source, the error contract
// every kvfence package promises in its errors.go: each error it returns
// wraps one of its sentinels, so callers decide with errors.Is. Tests of
// each package call Check on their own directories.
//
// The check is on the source because the paths that break the promise are
// the rare ones no test reaches. It reports every errors.New inside a
// function (a sentinel belongs at package level, in errors.go) and every
// fmt.Errorf whose format, as far as its literal parts tell, has no %w.
// Test files are exempt.
package errcontract

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// Check parses the non-test Go files of dirs and reports every break of
// the contract through t. It fails when dirs hold no source at all, so a
// wrong path cannot pass silently.
func Check(t testing.TB, dirs ...string) {
	t.Helper()
	fset := token.NewFileSet()
	files := 0
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
			files++
			for _, p := range Problems(fset, f) {
				t.Errorf("%s", p)
			}
		}
	}
	if files == 0 {
		t.Fatalf("errcontract: no Go source in %v", dirs)
	}
}

// Problems returns the breaks of the contract in one parsed file, each as
// "position: what".
func Problems(fset *token.FileSet, f *ast.File) []string {
	var out []string
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
					out = append(out, fset.Position(call.Pos()).String()+": errors.New inside a function: declare a sentinel in errors.go and wrap it")
				}
			case "fmt.Errorf":
				if len(call.Args) == 0 || !strings.Contains(literal(call.Args[0]), "%w") {
					out = append(out, fset.Position(call.Pos()).String()+": fmt.Errorf without %w: wrap a sentinel")
				}
			}
			return true
		})
	}
	return out
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

// literal returns the string literals of a format expression, joined: of
// "%w: " + format, the "%w: " is known.
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
