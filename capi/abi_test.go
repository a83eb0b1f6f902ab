package main

import (
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/kvfence/kvfence/capi/internal/bridge"
)

// These tests build the library the way users do (go build
// -buildmode=c-shared / c-archive), compare the hand-written kvfence.h with
// the header cgo generates, and run testdata/capi_test.c against both
// builds. They skip when cgo or gcc is unavailable.

var (
	sharedOnce sync.Once
	sharedDir  string
	sharedErr  error
)

func goTool(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	p := filepath.Join(os.Getenv("GOROOT"), "bin", "go")
	if _, err := os.Stat(p); err != nil {
		t.Skip("go command not found")
	}
	return p
}

func needCgo(t *testing.T) {
	t.Helper()
	out, err := exec.Command(goTool(t), "env", "CGO_ENABLED").Output()
	if err != nil || strings.TrimSpace(string(out)) != "1" {
		t.Skip("cgo disabled: the C ABI cannot be built")
	}
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("gcc not found")
	}
}

// buildShared builds libkvfence.so and its generated header once per test
// binary, in a directory removed by TestMain.
func buildShared(t *testing.T) string {
	t.Helper()
	needCgo(t)
	sharedOnce.Do(func() {
		sharedDir, sharedErr = os.MkdirTemp("", "kvfence-capi-")
		if sharedErr != nil {
			return
		}
		cmd := exec.Command(goTool(t), "build", "-buildmode=c-shared", "-o", filepath.Join(sharedDir, "libkvfence.so"), ".")
		if out, err := cmd.CombinedOutput(); err != nil {
			sharedErr = fmt.Errorf("go build -buildmode=c-shared: %v\n%s", err, out)
		}
	})
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	return sharedDir
}

func TestMain(m *testing.M) {
	code := m.Run()
	if sharedDir != "" {
		os.RemoveAll(sharedDir)
	}
	os.Exit(code)
}

// decl is one function declaration, normalised: const dropped (it does not
// change the ABI and cgo cannot express it), parameter names dropped,
// pointers written "T*".
type decl struct {
	ret    string
	params []string
}

func (d decl) String() string { return d.ret + "(" + strings.Join(d.params, ", ") + ")" }

var (
	blockComment = regexp.MustCompile(`(?s)/\*.*?\*/`)
	lineComment  = regexp.MustCompile(`//[^\n]*`)
	spaces       = regexp.MustCompile(`\s+`)
	starSpaces   = regexp.MustCompile(`\s*\*\s*`)
	paramName    = regexp.MustCompile(`^(.*?[\s*])(\w+)$`)
)

func normType(s string) string {
	s = spaces.ReplaceAllString(" "+s+" ", " ")
	s = strings.ReplaceAll(s, " const ", " ")
	s = starSpaces.ReplaceAllString(s, "*")
	return strings.TrimSpace(s)
}

func parseDecl(ret, params string) decl {
	d := decl{ret: normType(ret)}
	params = strings.TrimSpace(params)
	if params == "" || params == "void" {
		return d
	}
	for _, p := range strings.Split(params, ",") {
		p = strings.TrimSpace(p)
		if m := paramName.FindStringSubmatch(p); m != nil {
			p = m[1]
		}
		d.params = append(d.params, normType(p))
	}
	return d
}

// declsMatching collects the kvf_ functions that re finds in src (comments
// stripped); re's groups are return type, name, parameters.
func declsMatching(t *testing.T, src string, re *regexp.Regexp) map[string]decl {
	t.Helper()
	src = lineComment.ReplaceAllString(blockComment.ReplaceAllString(src, " "), " ")
	out := make(map[string]decl)
	for _, m := range re.FindAllStringSubmatch(src, -1) {
		if _, dup := out[m[2]]; dup {
			t.Errorf("%s declared twice", m[2])
		}
		out[m[2]] = parseDecl(m[1], m[3])
	}
	return out
}

var (
	// KVF_API kvf_status kvf_admit(kvf_pool pool, ...);
	handDecl = regexp.MustCompile(`KVF_API\s+([\w\s\*]+?)\s*\b(kvf_[a-z]\w*)\s*\(([^)]*)\)\s*;`)
	// extern kvf_status kvf_admit(kvf_pool pool, ...);
	cgoDecl = regexp.MustCompile(`extern\s+([\w\s\*]+?)\s*\b(kvf_[a-z]\w*)\s*\(([^)]*)\)\s*;`)
	// kvf_status kvf_last_error(kvf_error_info *info) {
	cDef = regexp.MustCompile(`(?m)^([\w][\w\s\*]*?)\s*\b(kvf_[a-z]\w*)\s*\(([^)]*)\)\s*\{`)
)

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestHeaderMatchesCgo keeps include/kvfence.h, the header users include,
// identical in names and argument types to what the library exports: the
// cgo-generated declarations of the Go exports plus the functions defined
// in C (lasterror.c).
func TestHeaderMatchesCgo(t *testing.T) {
	dir := buildShared(t)
	hand := declsMatching(t, readFile(t, "include/kvfence.h"), handDecl)
	gen := declsMatching(t, readFile(t, filepath.Join(dir, "libkvfence.h")), cgoDecl)
	cdefs := declsMatching(t, readFile(t, "lasterror.c"), cDef)
	if len(hand) < 15 || len(gen) < 10 || len(cdefs) < 5 {
		t.Fatalf("parsed %d header, %d cgo, %d C declarations: the parser no longer sees them", len(hand), len(gen), len(cdefs))
	}
	exported := maps.Clone(gen)
	for name, d := range cdefs {
		if _, dup := exported[name]; dup {
			t.Errorf("%s is both a Go export and defined in C", name)
		}
		exported[name] = d
	}
	for _, name := range slices.Sorted(maps.Keys(exported)) {
		h, ok := hand[name]
		switch {
		case !ok:
			t.Errorf("%s is exported as %v but missing from include/kvfence.h", name, exported[name])
		case h.String() != exported[name].String():
			t.Errorf("%s: kvfence.h declares %v, library exports %v", name, h, exported[name])
		}
	}
	for _, name := range slices.Sorted(maps.Keys(hand)) {
		if _, ok := exported[name]; !ok {
			t.Errorf("kvfence.h declares %s, which the library does not export", name)
		}
	}
}

// TestStatusCodes keeps the header's enum, the C status names and the Go
// statuses identical.
func TestStatusCodes(t *testing.T) {
	header := blockComment.ReplaceAllString(readFile(t, "include/kvfence.h"), " ")
	enum := make(map[bridge.Status]string)
	for _, m := range regexp.MustCompile(`\b(KVF_(?:OK|ERR_\w+))\s*=\s*(\d+)`).FindAllStringSubmatch(header, -1) {
		v, _ := strconv.Atoi(m[2])
		if prev, dup := enum[bridge.Status(v)]; dup {
			t.Errorf("%s and %s share value %d", prev, m[1], v)
		}
		enum[bridge.Status(v)] = m[1]
	}
	if want := bridge.Statuses(); !maps.Equal(enum, want) {
		t.Errorf("kvfence.h enum\n%v\nGo statuses\n%v", enum, want)
	}
	names := make(map[string]string)
	for _, m := range regexp.MustCompile(`case (KVF_\w+): return "(\w+)";`).FindAllStringSubmatch(readFile(t, "lasterror.c"), -1) {
		names[m[1]] = m[2]
	}
	for _, n := range enum {
		if names[n] != n {
			t.Errorf("kvf_status_name(%s) = %q", n, names[n])
		}
	}
	if len(names) != len(enum) {
		t.Errorf("lasterror.c names %d statuses, the header has %d", len(names), len(enum))
	}
}

func runCTest(t *testing.T, bin string, env ...string) {
	t.Helper()
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	t.Logf("%s", out)
	if err != nil {
		t.Fatalf("%s: %v", bin, err)
	}
	if !strings.Contains(string(out), "checks passed") {
		t.Fatalf("%s did not report its checks", bin)
	}
}

func gcc(t *testing.T, args ...string) {
	t.Helper()
	base := []string{"-std=c11", "-Wall", "-Wextra", "-Werror", "-Iinclude", "testdata/capi_test.c"}
	out, err := exec.Command("gcc", append(base, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("gcc: %v\n%s", err, out)
	}
}

// TestCProgramShared runs the C test program against libkvfence.so.
func TestCProgramShared(t *testing.T) {
	dir := buildShared(t)
	bin := filepath.Join(dir, "capi_test")
	gcc(t, "-L"+dir, "-lkvfence", "-lpthread", "-o", bin)
	runCTest(t, bin, "LD_LIBRARY_PATH="+dir)
}

// TestCProgramArchive links the C test program statically against
// libkvfence.a (-buildmode=c-archive).
func TestCProgramArchive(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the library a second time")
	}
	needCgo(t)
	dir := t.TempDir()
	lib := filepath.Join(dir, "libkvfence.a")
	if out, err := exec.Command(goTool(t), "build", "-buildmode=c-archive", "-o", lib, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build -buildmode=c-archive: %v\n%s", err, out)
	}
	bin := filepath.Join(dir, "capi_test")
	gcc(t, lib, "-lpthread", "-o", bin)
	runCTest(t, bin)
}

// TestPythonExample runs examples/python/demo.py against the library: it
// loads it with dlopen (ctypes), which fails if the library's static TLS
// outgrows glibc's surplus for dlopened libraries.
func TestPythonExample(t *testing.T) {
	dir := buildShared(t)
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not found")
	}
	cmd := exec.Command(py, "../examples/python/demo.py")
	cmd.Env = append(os.Environ(), "KVFENCE_LIB="+filepath.Join(dir, "libkvfence.so"))
	out, err := cmd.CombinedOutput()
	t.Logf("%s", out)
	if err != nil {
		t.Fatalf("demo.py: %v", err)
	}
	for _, want := range []string{"block table", "KVF_ERR_EXCEEDS_QUOTA need=125 limit=64", "free=256/256",
		"chat-2 hit 96 tokens", "identical prompt hit 0 tokens", "forged manifest refused: KVF_ERR_BAD_MAC",
		"decode lease prefilled, 32 pages, 300 prompt tokens written", "replay refused: KVF_ERR_REPLAY",
		"prefill pool 256/256 pages free, decode pool 256/256",
		"ranks: 15 pages quarantined before rank 1 stepped", "ranks: 16/16 pages free once every rank reported",
		"over both shards passed", "rank 1 after the pool's destruction: error KVF_ERR_POOL_CLOSED",
		"(Lease.release, RankWorker.step)"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("demo output lacks %q", want)
		}
	}
}
