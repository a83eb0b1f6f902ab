package ptx

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvfence/kvfence/internal/errcontract"
)

// mem is a Memory of a few allocations.
type mem struct {
	bases []uint64
	bufs  [][]byte
}

func (m *mem) alloc(base uint64, n int) []byte {
	b := make([]byte, n)
	m.bases = append(m.bases, base)
	m.bufs = append(m.bufs, b)
	return b
}

func (m *mem) Global(addr uint64, n int) []byte {
	for i, base := range m.bases {
		b := m.bufs[i]
		if addr >= base && addr-base < uint64(len(b)) && uint64(n) <= uint64(len(b))-(addr-base) {
			return b[addr-base : addr-base+uint64(n)]
		}
	}
	return nil
}

const header = ".version 7.0\n.target sm_50\n.address_size 64\n"

// kernel wraps a body in an entry k(.param .u64 k_out, .param .u64 k_in).
func kernel(body string) string {
	return header + `.visible .entry k(.param .u64 k_out, .param .u64 k_in)
{
	.reg .pred %p<4>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<8>;
` + body + "\n}\n"
}

func mustParse(t *testing.T, src string) *Entry {
	t.Helper()
	m, err := Parse([]byte(src))
	if err != nil {
		t.Fatalf("Parse: %v\n%s", err, src)
	}
	e, err := m.Entry("k")
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func launch1(t *testing.T, e *Entry, m *mem, out, in uint64) (Stats, error) {
	t.Helper()
	params, err := e.Pack([]Arg{U64("k_out", out), U64("k_in", in)})
	if err != nil {
		t.Fatal(err)
	}
	return e.Run(Launch{Grid: [3]uint32{1, 1, 1}, Block: [3]uint32{1, 1, 1}, Params: params, Mem: m, Budget: 1000})
}

func TestErrorContract(t *testing.T) { errcontract.Check(t, ".") }

// Every construct outside the subset must be refused, with its line, and
// never parsed into something that runs differently than on a GPU.
func TestParseAcceptedOutsideSubset(t *testing.T) {
	for _, tc := range []struct{ name, src, want string }{
		{"shared memory", kernel(".shared .align 4 .b8 buf[64];\n\tret;"), "unsupported directive \".shared\""},
		{"local memory", kernel(".local .b32 x;\n\tret;"), "unsupported directive \".local\""},
		{"barrier", kernel("bar.sync 0;\n\tret;"), "opcode \"bar.sync\" is not in the subset"},
		{"atomic", kernel("atom.global.add.u32 %r1, [%rd1], 1;\n\tret;"), "not in the subset"},
		{"unknown opcode", kernel("frobnicate.u32 %r1, %r2;\n\tret;"), "opcode \"frobnicate.u32\""},
		{"float", kernel("add.f32 %r1, %r2, %r3;\n\tret;"), "type .f32 not allowed"},
		{"shared load", kernel("ld.shared.u32 %r1, [%rd1];\n\tret;"), "state space .shared"},
		{"generic load", kernel("ld.u32 %r1, [%rd1];\n\tret;"), "generic loads are not in the subset"},
		{"param store", kernel("st.param.u32 [k_out], %r1;\n\tret;"), "only st.global"},
		{"call", kernel("call f;\n\tret;"), "opcode \"call\""},
		{"nested scope", kernel("{\n\tret;\n\t}"), "nested scopes"},
		{"module variable", header + ".global .u32 g;\n", "module-level statement \".global\""},
		{"device function", header + ".func f()\n{\n\tret;\n}\n", "module-level statement \".func\""},
		{"undeclared register", kernel("mov.u32 %r9, 1;\n\tret;"), "undeclared register %r9"},
		{"width mismatch", kernel("add.u64 %rd1, %r1, %rd2;\n\tret;"), "register %r1 is 32-bit, the operation needs 64-bit"},
		{"64-bit shift amount", kernel("shl.b64 %rd1, %rd2, %rd3;\n\tret;"), "always .u32"},
		{"undefined label", kernel("bra NOWHERE;\n\tret;"), "undefined label \"NOWHERE\""},
		{"duplicate label", kernel("L:\n\tL:\n\tret;"), "label \"L\" defined twice"},
		{"duplicate register", kernel(".reg .b32 %r3;\n\tret;"), "register %r3 declared twice"},
		{"immediate too wide", kernel("mov.u32 %r1, 0x100000000;\n\tret;"), "does not fit 32 bits"},
		{"32-bit addresses", ".version 7.0\n.target sm_50\n.address_size 32\n", "the subset is 64-bit"},
		{"no header", ".visible .entry k()\n{\n\tret;\n}\n", "before .version"},
		{"guard not a predicate", kernel("@%r1 bra L;\nL:\n\tret;"), "not a declared .pred"},
		{"vector arity", kernel("st.global.v4.u32 [%rd1], {%r1, %r2};\n\tret;"), "needs 4 source registers"},
		{"64-bit special register", kernel("mov.u64 %rd1, %tid.x;\n\tret;"), "special register %tid.x is 32-bit"},
		{"special register as operand", kernel("add.u32 %r1, %tid.x, 1;\n\tret;"), "may only be read by mov.u32"},
		{"param load past its end", kernel("ld.param.u64 %rd1, [k_out+4];\n\tret;"), "outside the 8-byte parameter"},
		{"param load of unknown name", kernel("ld.param.u64 %rd1, [k_nope];\n\tret;"), "no parameter of that name"},
		{"bitwise setp ordering", kernel("setp.lt.b32 %p1, %r1, %r2;\n\tret;"), "comparison .lt not allowed for .b32"},
		{"combined setp", kernel("setp.lt.and.u32 %p1, %r1, %r2, %p2;\n\tret;"), "exactly one comparison"},
		{"octal immediate", kernel("mov.u32 %r1, 017;\n\tret;"), "expected a number"},
		{"no entry", header, "defines no .entry"},
		{"unclosed body", header + ".visible .entry k()\n{\n\tret;\n", "not closed"},
		{"unterminated comment", kernel("/* ret;"), "unterminated /* comment"},
		{"stray character", kernel("mov.u32 %r1, 1 * 2;\n\tret;"), "unexpected character '*'"},
		{"entry directive", header + ".visible .entry k() .reqntid 32\n{\n\tret;\n}\n", "unsupported entry directive \".reqntid\""},
		{"old version", ".version 5.0\n.target sm_50\n.address_size 64\n", "unsupported .version"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.src))
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("Parse accepted it (err %v)\n%s", err, tc.src)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not say %q", err, tc.want)
			}
			var se *SyntaxError
			if !errors.As(err, &se) || se.Line < 1 {
				t.Fatalf("error %v names no line", err)
			}
		})
	}
}

// The line a refusal names is the offending one.
func TestParseNamedWrongLine(t *testing.T) {
	src := kernel("mov.u32 %r1, 1;\n\tbar.sync 0;\n\tret;")
	_, err := Parse([]byte(src))
	var se *SyntaxError
	if !errors.As(err, &se) {
		t.Fatal(err)
	}
	want := strings.Count(src[:strings.Index(src, "bar.sync")], "\n") + 1
	if se.Line != want {
		t.Fatalf("line %d, want %d", se.Line, want)
	}
}

// A Go argument list that differs from the declared parameters in count,
// order (name) or size must not launch.
func TestPackAcceptedMismatchedArguments(t *testing.T) {
	src := header + `.visible .entry k(.param .u64 k_a, .param .u32 k_b, .param .align 4 .b8 k_c[12])
{
	ret;
}`
	m, err := Parse([]byte(src))
	if err != nil {
		t.Fatal(err)
	}
	e, _ := m.Entry("k")
	if got := []int{e.Params[0].Offset, e.Params[1].Offset, e.Params[2].Offset, e.ParamBytes}; fmt.Sprint(got) != "[0 8 12 24]" {
		t.Fatalf("layout %v", got)
	}
	good := []Arg{U64("k_a", 1), U32("k_b", 2), {"k_c", make([]byte, 12)}}
	if _, err := e.Pack(good); err != nil {
		t.Fatal(err)
	}
	for name, args := range map[string][]Arg{
		"too few":       good[:2],
		"too many":      append(append([]Arg{}, good...), U32("k_d", 0)),
		"swapped":       {U32("k_b", 2), U64("k_a", 1), good[2]},
		"u32 as u64":    {U64("k_a", 1), U64("k_b", 2), good[2]},
		"short array":   {U64("k_a", 1), U32("k_b", 2), {"k_c", make([]byte, 8)}},
		"renamed param": {U64("k_x", 1), U32("k_b", 2), good[2]},
	} {
		if _, err := e.Pack(args); !errors.Is(err, ErrLaunch) {
			t.Errorf("%s: Pack = %v, want ErrLaunch", name, err)
		}
	}
	if _, err := m.Entry("nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Entry(nope) = %v", err)
	}
}

// binop is a kernel computing op over two 64-bit inputs (or their low 32
// bits) and storing the result.
func binop(op, typ string) string {
	w := 64
	if strings.HasSuffix(typ, "32") {
		w = 32
	}
	load := `ld.param.u64 %rd1, [k_out];
	ld.param.u64 %rd2, [k_in];
	ld.global.u64 %rd3, [%rd2];
	ld.global.u64 %rd4, [%rd2+8];
	cvt.u32.u64 %r1, %rd3;
	cvt.u32.u64 %r2, %rd4;
	`
	a, b, d := "%rd3", "%rd4", "%rd5"
	if w == 32 {
		a, b, d = "%r1", "%r2", "%r3"
	}
	switch op {
	case "shl", "shr":
		b = "%r2"
	}
	var body string
	switch op {
	case "not":
		body = fmt.Sprintf("not.%s %s, %s;", typ, d, a)
	case "setp.lt", "setp.le", "setp.gt", "setp.ge", "setp.eq", "setp.ne", "setp.lo", "setp.hs":
		body = fmt.Sprintf("%s.%s %%p1, %s, %s;\n\tselp.%s %s, 1, 0, %%p1;", op, typ, a, b, typ, d)
	case "mul.wide":
		body = fmt.Sprintf("mul.wide.%s %%rd5, %%r1, %%r2;", typ)
		d = "%rd5"
	case "mad.lo":
		body = fmt.Sprintf("mad.lo.%s %s, %s, %s, %s;", typ, d, a, b, a)
	case "cvt.s64.s32", "cvt.u64.u32":
		body = fmt.Sprintf("%s %%rd5, %%r1;", op)
		d = "%rd5"
	default:
		body = fmt.Sprintf("%s.%s %s, %s, %s;", op, typ, d, a, b)
	}
	store := "st.global.u64 [%rd1], %rd5;"
	if d == "%r3" {
		store = "st.global.u32 [%rd1], %r3;"
	}
	return kernel(load + body + "\n\t" + store + "\n\tret;")
}

// The interpreter's arithmetic must be the GPU's: wrapping at the type's
// width, sign where the type is signed, clamped shifts.
func TestRunComputedWrongValues(t *testing.T) {
	s32 := func(v uint64) int32 { return int32(uint32(v)) }
	b2u := func(b bool) uint64 {
		if b {
			return 1
		}
		return 0
	}
	ops := []struct {
		op, typ string
		f       func(a, b uint64) uint64
	}{
		{"add", "u32", func(a, b uint64) uint64 { return uint64(uint32(a) + uint32(b)) }},
		{"add", "s64", func(a, b uint64) uint64 { return a + b }},
		{"sub", "u32", func(a, b uint64) uint64 { return uint64(uint32(a) - uint32(b)) }},
		{"sub", "u64", func(a, b uint64) uint64 { return a - b }},
		{"mul.lo", "u32", func(a, b uint64) uint64 { return uint64(uint32(a) * uint32(b)) }},
		{"mul.lo", "u64", func(a, b uint64) uint64 { return a * b }},
		{"mul.wide", "u32", func(a, b uint64) uint64 { return uint64(uint32(a)) * uint64(uint32(b)) }},
		{"mul.wide", "s32", func(a, b uint64) uint64 { return uint64(int64(s32(a)) * int64(s32(b))) }},
		{"mad.lo", "u64", func(a, b uint64) uint64 { return a*b + a }},
		{"div", "u64", func(a, b uint64) uint64 { return a / b }},
		{"rem", "u32", func(a, b uint64) uint64 { return uint64(uint32(a) % uint32(b)) }},
		{"div", "s32", func(a, b uint64) uint64 { return uint64(uint32(s32(a) / s32(b))) }},
		{"min", "u64", func(a, b uint64) uint64 { return min(a, b) }},
		{"max", "s32", func(a, b uint64) uint64 { return uint64(uint32(max(s32(a), s32(b)))) }},
		{"min", "s64", func(a, b uint64) uint64 { return uint64(min(int64(a), int64(b))) }},
		{"and", "b64", func(a, b uint64) uint64 { return a & b }},
		{"or", "b32", func(a, b uint64) uint64 { return uint64(uint32(a | b)) }},
		{"xor", "b64", func(a, b uint64) uint64 { return a ^ b }},
		{"not", "b32", func(a, _ uint64) uint64 { return uint64(^uint32(a)) }},
		{"shl", "b64", func(a, b uint64) uint64 { return shiftL(a, uint32(b), 64) }},
		{"shl", "b32", func(a, b uint64) uint64 { return shiftL(uint64(uint32(a)), uint32(b), 32) }},
		{"shr", "u64", func(a, b uint64) uint64 { return shiftR(a, uint32(b), 64) }},
		{"shr", "s32", func(a, b uint64) uint64 { return uint64(uint32(s32(a) >> min(uint32(b), 31))) }},
		{"shr", "s64", func(a, b uint64) uint64 { return uint64(int64(a) >> min(uint32(b), 63)) }},
		{"setp.lt", "s32", func(a, b uint64) uint64 { return b2u(s32(a) < s32(b)) }},
		{"setp.lo", "u64", func(a, b uint64) uint64 { return b2u(a < b) }},
		{"setp.ge", "u32", func(a, b uint64) uint64 { return b2u(uint32(a) >= uint32(b)) }},
		{"setp.hs", "u64", func(a, b uint64) uint64 { return b2u(a >= b) }},
		{"setp.le", "s64", func(a, b uint64) uint64 { return b2u(int64(a) <= int64(b)) }},
		{"setp.gt", "s64", func(a, b uint64) uint64 { return b2u(int64(a) > int64(b)) }},
		{"setp.eq", "b64", func(a, b uint64) uint64 { return b2u(a == b) }},
		{"setp.ne", "b32", func(a, b uint64) uint64 { return b2u(uint32(a) != uint32(b)) }},
		{"cvt.s64.s32", "", func(a, _ uint64) uint64 { return uint64(int64(s32(a))) }},
		{"cvt.u64.u32", "", func(a, _ uint64) uint64 { return uint64(uint32(a)) }},
	}
	rng := rand.New(rand.NewPCG(1, 2))
	edge := []uint64{0, 1, 2, 31, 32, 33, 63, 64, 65, 0x7fffffff, 0x80000000, 0xffffffff, 1 << 32, 1<<63 - 1, 1 << 63, ^uint64(0)}
	for _, o := range ops {
		e := mustParse(t, binop(o.op, o.typ))
		for i := range 300 {
			var a, b uint64
			if i < len(edge)*len(edge) && i < 256 {
				a, b = edge[i%len(edge)], edge[i/len(edge)%len(edge)]
			} else {
				a, b = rng.Uint64(), rng.Uint64()>>rng.IntN(64)
			}
			if (o.op == "div" || o.op == "rem") && (o.typ == "u64" && b == 0 || o.typ != "u64" && uint32(b) == 0) {
				continue
			}
			if o.op == "div" && o.typ == "s32" && s32(a) == -1<<31 && s32(b) == -1 {
				continue // overflows: unspecified in PTX
			}
			m := &mem{}
			out := m.alloc(0x1000, 8)
			in := m.alloc(0x2000, 16)
			binary.LittleEndian.PutUint64(in, a)
			binary.LittleEndian.PutUint64(in[8:], b)
			if _, err := launch1(t, e, m, 0x1000, 0x2000); err != nil {
				t.Fatalf("%s.%s: %v", o.op, o.typ, err)
			}
			got := binary.LittleEndian.Uint64(out)
			if strings.HasSuffix(o.typ, "32") && o.op != "mul.wide" && !strings.HasPrefix(o.op, "cvt") {
				got &= 0xffffffff
			}
			if want := o.f(a, b); got != want {
				t.Fatalf("%s.%s %#x, %#x = %#x, want %#x", o.op, o.typ, a, b, got, want)
			}
		}
	}
}

func shiftL(a uint64, b uint32, w uint32) uint64 {
	if b >= w {
		return 0
	}
	v := a << b
	if w == 32 {
		v &= 0xffffffff
	}
	return v
}

func shiftR(a uint64, b uint32, w uint32) uint64 {
	if b >= w {
		return 0
	}
	return a >> b
}

// A register read before any write must not read as zero: code that
// forgot an initialisation would pass here and fail on a GPU.
func TestRunReadUnwrittenRegisterAsZero(t *testing.T) {
	e := mustParse(t, kernel(`ld.param.u64 %rd1, [k_out];
	st.global.u64 [%rd1], %rd6;
	ret;`))
	m := &mem{}
	out := m.alloc(0x1000, 8)
	if _, err := launch1(t, e, m, 0x1000, 0); err != nil {
		t.Fatal(err)
	}
	if v := binary.LittleEndian.Uint64(out); v == 0 {
		t.Fatal("an unwritten register read as 0")
	}
}

// Every thread of every block runs exactly once, with its own indices.
func TestRunSkippedThreads(t *testing.T) {
	e := mustParse(t, kernel(`ld.param.u64 %rd1, [k_out];
	mov.u32 %r1, %ctaid.z;
	mov.u32 %r2, %nctaid.y;
	mov.u32 %r3, %ctaid.y;
	mad.lo.u32 %r1, %r1, %r2, %r3;
	mov.u32 %r2, %nctaid.x;
	mov.u32 %r3, %ctaid.x;
	mad.lo.u32 %r1, %r1, %r2, %r3;   // block index
	mov.u32 %r2, %ntid.y;
	mov.u32 %r3, %tid.y;
	mov.u32 %r4, %ntid.x;
	mul.lo.u32 %r2, %r2, %r4;         // threads per block
	mov.u32 %r5, %tid.x;
	mad.lo.u32 %r3, %r3, %r4, %r5;    // thread index in block
	mad.lo.u32 %r1, %r1, %r2, %r3;    // global index
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd2, %rd1, %rd2;
	ld.global.u32 %r6, [%rd2];
	add.u32 %r6, %r6, 1;
	st.global.u32 [%rd2], %r6;
	ret;`))
	grid, block := [3]uint32{3, 2, 2}, [3]uint32{4, 2, 1}
	n := 3 * 2 * 2 * 4 * 2
	m := &mem{}
	out := m.alloc(0x1000, 4*n)
	params, _ := e.Pack([]Arg{U64("k_out", 0x1000), U64("k_in", 0)})
	st, err := e.Run(Launch{Grid: grid, Block: block, Params: params, Mem: m, Budget: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if v := binary.LittleEndian.Uint32(out[4*i:]); v != 1 {
			t.Fatalf("thread %d ran %d times", i, v)
		}
	}
	if st.Threads != int64(n) || st.Stores != int64(n) || st.BytesStored != int64(4*n) || st.Loads != int64(n) {
		t.Fatalf("stats %+v", st)
	}
}

// Loads and stores outside memory, misaligned ones, runaway loops,
// division by zero and falling off the end must stop the launch with a
// fault that names the thread, never run on.
func TestRunLetBadAccessThrough(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		kind       error
		want       string
	}{
		{"store past the end", "ld.param.u64 %rd1, [k_out];\n\tst.global.u32 [%rd1+8], %r1;\n\tret;", ErrOutOfBounds, "4-byte store at 0x1008"},
		{"misaligned 8-byte store", "ld.param.u64 %rd1, [k_out];\n\tst.global.u64 [%rd1+4], %rd1;\n\tret;", ErrMisaligned, "8-byte store at 0x1004"},
		{"vector straddling the end", "ld.param.u64 %rd1, [k_out];\n\tmov.u32 %r1, 0;\n\tst.global.v2.u32 [%rd1+8], {%r1, %r1};\n\tret;", ErrOutOfBounds, "8-byte store"},
		{"load below the start", "ld.param.u64 %rd1, [k_out];\n\tld.global.u32 %r1, [%rd1-4];\n\tret;", ErrOutOfBounds, "load at 0xffc"},
		{"misaligned vector", "ld.param.u64 %rd1, [k_out];\n\tmov.u32 %r1, 0;\n\tst.global.v4.u32 [%rd1+8], {%r1, %r1, %r1, %r1};\n\tret;", ErrMisaligned, "16-byte store at 0x1008"},
		{"global access to a param", "mov.u64 %rd1, k_out;\n\tld.global.u32 %r1, [%rd1];\n\tret;", ErrOutOfBounds, ""},
		{"param load past the params", "mov.u64 %rd1, k_in;\n\tld.param.u32 %r1, [%rd1+8];\n\tret;", ErrOutOfBounds, "not a parameter's address"},
		{"misaligned param load", "mov.u64 %rd1, k_out;\n\tld.param.u32 %r1, [%rd1+2];\n\tret;", ErrMisaligned, "misaligned"},
		{"runaway loop", "L:\n\tbra L;\n\tret;", ErrBudget, "1000 instructions"},
		{"division by zero", "mov.u32 %r1, 0;\n\tdiv.u32 %r2, 7, %r1;\n\tret;", ErrTrap, "division by zero"},
		{"no ret", "mov.u32 %r1, 0;", ErrTrap, "past the last instruction"},
		{"empty body", "", ErrTrap, "past the last instruction"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := Parse([]byte(kernel(tc.body)))
			if err != nil {
				t.Fatal(err)
			}
			e, _ := m.Entry("k")
			mm := &mem{}
			mm.alloc(0x1000, 8)
			_, err = launch1(t, e, mm, 0x1000, 0)
			var f *Fault
			if !errors.Is(err, tc.kind) || !errors.As(err, &f) {
				t.Fatalf("Run = %v, want a %v fault", err, tc.kind)
			}
			if !strings.Contains(err.Error(), tc.want) || f.Line == 0 || f.Entry != "k" {
				t.Fatalf("fault %q lacks %q or a line", err, tc.want)
			}
		})
	}
	// A param load through a register, within a parameter, is fine.
	e := mustParse(t, kernel("mov.u64 %rd1, k_in;\n\tld.param.u32 %r1, [%rd1+4];\n\tret;"))
	if _, err := launch1(t, e, &mem{}, 0, 0x1234_5678_0000_0000); err != nil {
		t.Fatal(err)
	}
}

// A launch the driver refuses must not run.
func TestRunAcceptedBadLaunch(t *testing.T) {
	src := header + ".visible .entry k(.param .u64 k_out) .maxntid 128, 1, 1\n{\n\tret;\n}\n"
	m, err := Parse([]byte(src))
	if err != nil {
		t.Fatal(err)
	}
	e, _ := m.Entry("k")
	params, _ := e.Pack([]Arg{U64("k_out", 0)})
	good := Launch{Grid: [3]uint32{1, 1, 1}, Block: [3]uint32{128, 1, 1}, Params: params, Mem: &mem{}, Budget: 1 << 20}
	if _, err := e.Run(good); err != nil {
		t.Fatal(err)
	}
	for name, mod := range map[string]func(*Launch){
		"block over .maxntid": func(l *Launch) { l.Block[0] = 129 },
		"block of 1025":       func(l *Launch) { l.Block = [3]uint32{1025, 1, 1} },
		"empty grid":          func(l *Launch) { l.Grid[1] = 0 },
		"grid y over 65535":   func(l *Launch) { l.Grid[1] = 65536 },
		"short params":        func(l *Launch) { l.Params = l.Params[:4] },
		"no budget":           func(l *Launch) { l.Budget = 0 },
		"no memory":           func(l *Launch) { l.Mem = nil },
	} {
		l := good
		mod(&l)
		if _, err := e.Run(l); !errors.Is(err, ErrLaunch) {
			t.Errorf("%s: Run = %v, want ErrLaunch", name, err)
		}
		if err := e.CheckLaunch(l); !errors.Is(err, ErrLaunch) {
			t.Errorf("%s: CheckLaunch = %v, want ErrLaunch", name, err)
		}
	}
}

// Guards select: @%p runs when p is true, @!%p when it is false.
func TestRunIgnoredGuards(t *testing.T) {
	e := mustParse(t, kernel(`ld.param.u64 %rd1, [k_out];
	mov.u32 %r1, 5;
	setp.eq.u32 %p1, %r1, 5;
	mov.u32 %r2, 0;
	@%p1 add.u32 %r2, %r2, 1;
	@!%p1 add.u32 %r2, %r2, 10;
	not.pred %p2, %p1;
	@%p2 add.u32 %r2, %r2, 100;
	@!%p2 bra SKIP;
	add.u32 %r2, %r2, 1000;
SKIP:
	st.global.u32 [%rd1], %r2;
	ret;`))
	m := &mem{}
	out := m.alloc(0x1000, 4)
	if _, err := launch1(t, e, m, 0x1000, 0); err != nil {
		t.Fatal(err)
	}
	if v := binary.LittleEndian.Uint32(out); v != 1 {
		t.Fatalf("got %d, want 1", v)
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(binop("add", "u64")))
	f.Add([]byte(kernel("L:\n\t@%p1 bra L;\n\tst.global.cs.v4.u32 [%rd1+16], {%r1, %r2, %r3, %r4};\n\tret;")))
	f.Add([]byte(header + ".visible .entry k(.param .align 8 .b8 k_a[64]) .maxntid 256\n{\n\tret;\n}\n"))
	f.Add([]byte(header + ".entry k()\n{\n}\n"))
	f.Fuzz(func(t *testing.T, src []byte) {
		m, err := Parse(src)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		// What parses runs, or faults, without panicking.
		for _, e := range m.Entries {
			args := make([]Arg, len(e.Params))
			for i, p := range e.Params {
				args[i] = Arg{p.Name, make([]byte, p.Size)}
			}
			params, err := e.Pack(args)
			if err != nil {
				t.Fatal(err)
			}
			mm := &mem{}
			mm.alloc(0, 64)
			_, _ = e.Run(Launch{Grid: [3]uint32{2, 1, 1}, Block: [3]uint32{2, 1, 1}, Params: params, Mem: mm, Budget: 10000})
		}
	})
}
