package ptx

import (
	"errors"
	"fmt"
	"strings"
)

type opcode uint8

const (
	opLdParam opcode = iota + 1
	opLdGlobal
	opStGlobal
	opMov
	opCvt // also cvta.to.global (the identity)
	opAdd
	opSub
	opMulLo
	opMulWide
	opMadLo
	opDiv
	opRem
	opMin
	opMax
	opAnd
	opOr
	opXor
	opNot
	opShl
	opShr
	opSetp
	opSelp
	opBra
	opRet
)

type cmpKind uint8

const (
	cmpEq cmpKind = iota + 1
	cmpNe
	cmpLt
	cmpLe
	cmpGt
	cmpGe
)

// operand is a register (reg ≥ 0) or an immediate.
type operand struct {
	reg int32
	imm uint64
}

func imm(v uint64) operand { return operand{reg: -1, imm: v} }

// instr is one decoded instruction.
type instr struct {
	op       opcode
	width    uint8 // bits of the operation's type
	srcWidth uint8 // cvt: of the source; mul.wide: of the sources
	signed   bool
	cmp      cmpKind
	vec      uint8    // ld/st: elements
	dst      [4]int32 // destination registers (ld: vec of them)
	src      [4]operand
	addr     operand // ld/st: base register, or for ld.param of a symbol its window address
	off      int64
	static   bool  // ld.param of a parameter by name: checked by Parse
	guard    int32 // -1: none
	neg      bool
	target   int // bra
	line     int
	text     string
}

// errOp builds decode errors; the caller adds the line.
var errOp = errors.New("")

func opErr(format string, args ...any) error {
	return fmt.Errorf("%w"+format, append([]any{errOp}, args...)...)
}

// mods splits an opcode's modifiers off its base name.
func mods(name string) (string, []string) {
	parts := strings.Split(name, ".")
	return parts[0], parts[1:]
}

// takeType removes the last modifier as a type of the allowed kinds.
func takeType(ms []string, kinds string) (typeInfo, string, []string, error) {
	if len(ms) == 0 {
		return typeInfo{}, "", nil, opErr("missing type")
	}
	t := ms[len(ms)-1]
	ti, ok := types[t]
	if !ok || !strings.ContainsRune(kinds, rune(ti.kind)) {
		return typeInfo{}, "", nil, opErr("type .%s not allowed here", t)
	}
	return ti, t, ms[:len(ms)-1], nil
}

func (p *parser) reg(o raw, width uint8) (int32, error) {
	if o.kind != 'r' {
		return 0, opErr("expected a register, found %s", describe(o))
	}
	r, ok := p.regs[o.name]
	if !ok {
		return 0, opErr("undeclared register %s", o.name)
	}
	if r < nSpecial {
		return 0, opErr("special register %s may only be read by mov.u32", o.name)
	}
	if w := p.e.regWidth[r]; w != width {
		return 0, opErr("register %s is %s, the operation needs %s", o.name, widthName(w), widthName(width))
	}
	return r, nil
}

// value decodes a source: a register of the width, or an immediate that
// fits it.
func (p *parser) value(o raw, width uint8) (operand, error) {
	if o.kind == 'i' {
		return immediate(o, width)
	}
	r, err := p.reg(o, width)
	return operand{reg: r}, err
}

func immediate(o raw, width uint8) (operand, error) {
	v := o.imm
	if width == 32 {
		if o.neg && v > 1<<31 || !o.neg && v > 0xffffffff {
			return operand{}, opErr("immediate %s does not fit 32 bits", describe(o))
		}
		if o.neg {
			v = uint64(uint32(-int64(v)))
		}
		return imm(v), nil
	}
	if width == 1 {
		return operand{}, opErr("immediate predicate %s", describe(o))
	}
	if o.neg {
		if v > 1<<63 {
			return operand{}, opErr("immediate %s does not fit 64 bits", describe(o))
		}
		v = uint64(-int64(v))
	}
	return imm(v), nil
}

func describe(o raw) string {
	switch o.kind {
	case 'r', 's':
		return o.name
	case 'i':
		if o.neg {
			return fmt.Sprintf("-%d", o.imm)
		}
		return fmt.Sprintf("%d", o.imm)
	case 'm':
		return "[" + o.name + "]"
	case 'v':
		return "{" + strings.Join(o.elems, ", ") + "}"
	}
	return "?"
}

func widthName(w uint8) string {
	if w == 1 {
		return ".pred"
	}
	return fmt.Sprintf("%d-bit", w)
}

func count(ops []raw, n int) error {
	if len(ops) != n {
		return opErr("%d operands, want %d", len(ops), n)
	}
	return nil
}

func noMods(ms []string) error {
	if len(ms) > 0 {
		return opErr("unsupported modifier .%s", ms[0])
	}
	return nil
}

// decode fills in from an opcode name and its operands, or says why the
// instruction is outside the subset.
func (p *parser) decode(in *instr, name string, ops []raw) error {
	base, ms := mods(name)
	switch base {
	case "ld":
		return p.decodeLd(in, ms, ops)
	case "st":
		return p.decodeSt(in, ms, ops)
	case "mov":
		return p.decodeMov(in, ms, ops)
	case "cvta":
		if strings.Join(ms, ".") != "to.global.u64" {
			return opErr("only cvta.to.global.u64 is in the subset")
		}
		in.op, in.width, in.srcWidth = opCvt, 64, 64
		return p.unary(in, ops, 64, 64)
	case "cvt":
		if len(ms) != 2 {
			return opErr("cvt needs a destination and a source type")
		}
		d, okd := types[ms[0]]
		s, oks := types[ms[1]]
		if !okd || !oks || d.kind == 'p' || s.kind == 'p' || d.kind == 'b' || s.kind == 'b' || d.width == s.width {
			return opErr("only integer widening or narrowing cvt is in the subset")
		}
		in.op, in.width, in.srcWidth, in.signed = opCvt, d.width, s.width, s.signed
		return p.unary(in, ops, d.width, s.width)
	case "add", "sub", "div", "rem", "min", "max":
		ti, _, rest, err := takeType(ms, "us")
		if err != nil {
			return err
		}
		if err := noMods(rest); err != nil {
			return err
		}
		in.op = map[string]opcode{"add": opAdd, "sub": opSub, "div": opDiv, "rem": opRem, "min": opMin, "max": opMax}[base]
		in.width, in.signed = ti.width, ti.signed
		return p.binary(in, ops, ti.width)
	case "mul", "mad":
		ti, _, rest, err := takeType(ms, "us")
		if err != nil {
			return err
		}
		if len(rest) != 1 || rest[0] != "lo" && !(rest[0] == "wide" && base == "mul") {
			return opErr("only mul.lo, mul.wide and mad.lo are in the subset")
		}
		in.width, in.signed = ti.width, ti.signed
		if rest[0] == "wide" {
			if ti.width != 32 {
				return opErr("mul.wide of 64-bit operands")
			}
			in.op, in.width, in.srcWidth = opMulWide, 64, 32
			if err := count(ops, 3); err != nil {
				return err
			}
			var err error
			if in.dst[0], err = p.reg(ops[0], 64); err != nil {
				return err
			}
			for i := range 2 {
				if in.src[i], err = p.value(ops[1+i], 32); err != nil {
					return err
				}
			}
			return nil
		}
		if base == "mul" {
			in.op = opMulLo
			return p.binary(in, ops, ti.width)
		}
		in.op = opMadLo
		if err := count(ops, 4); err != nil {
			return err
		}
		var err2 error
		if in.dst[0], err2 = p.reg(ops[0], ti.width); err2 != nil {
			return err2
		}
		for i := range 3 {
			if in.src[i], err2 = p.value(ops[1+i], ti.width); err2 != nil {
				return err2
			}
		}
		return nil
	case "and", "or", "xor", "not":
		ti, _, rest, err := takeType(ms, "bp")
		if err != nil {
			return err
		}
		if err := noMods(rest); err != nil {
			return err
		}
		in.op = map[string]opcode{"and": opAnd, "or": opOr, "xor": opXor, "not": opNot}[base]
		in.width = ti.width
		if base == "not" {
			return p.unary(in, ops, ti.width, ti.width)
		}
		return p.binary(in, ops, ti.width)
	case "shl", "shr":
		kinds := "b"
		if base == "shr" {
			kinds = "bus"
		}
		ti, _, rest, err := takeType(ms, kinds)
		if err != nil {
			return err
		}
		if err := noMods(rest); err != nil {
			return err
		}
		in.op, in.width, in.signed = opShl, ti.width, ti.signed
		if base == "shr" {
			in.op = opShr
		}
		if err := count(ops, 3); err != nil {
			return err
		}
		if in.dst[0], err = p.reg(ops[0], ti.width); err != nil {
			return err
		}
		if in.src[0], err = p.value(ops[1], ti.width); err != nil {
			return err
		}
		if in.src[1], err = p.value(ops[2], 32); err != nil {
			return opErr("shift amount: %v (it is always .u32)", err)
		}
		return nil
	case "setp":
		ti, tname, rest, err := takeType(ms, "bus")
		if err != nil {
			return err
		}
		if len(rest) != 1 {
			return opErr("setp needs exactly one comparison (no .and/.or combination)")
		}
		c := rest[0]
		cmps := map[string]cmpKind{"eq": cmpEq, "ne": cmpNe}
		if ti.kind == 's' {
			cmps["lt"], cmps["le"], cmps["gt"], cmps["ge"] = cmpLt, cmpLe, cmpGt, cmpGe
		}
		if ti.kind == 'u' {
			for k, v := range map[string]cmpKind{"lt": cmpLt, "le": cmpLe, "gt": cmpGt, "ge": cmpGe, "lo": cmpLt, "ls": cmpLe, "hi": cmpGt, "hs": cmpGe} {
				cmps[k] = v
			}
		}
		k, ok := cmps[c]
		if !ok {
			return opErr("comparison .%s not allowed for .%s", c, tname)
		}
		in.op, in.width, in.signed, in.cmp = opSetp, ti.width, ti.signed, k
		if err := count(ops, 3); err != nil {
			return err
		}
		if in.dst[0], err = p.reg(ops[0], 1); err != nil {
			return err
		}
		for i := range 2 {
			if in.src[i], err = p.value(ops[1+i], ti.width); err != nil {
				return err
			}
		}
		return nil
	case "selp":
		ti, _, rest, err := takeType(ms, "bus")
		if err != nil {
			return err
		}
		if err := noMods(rest); err != nil {
			return err
		}
		in.op, in.width = opSelp, ti.width
		if err := count(ops, 4); err != nil {
			return err
		}
		if in.dst[0], err = p.reg(ops[0], ti.width); err != nil {
			return err
		}
		for i := range 2 {
			if in.src[i], err = p.value(ops[1+i], ti.width); err != nil {
				return err
			}
		}
		r, err := p.reg(ops[3], 1)
		in.src[2] = operand{reg: r}
		return err
	case "bra":
		if len(ms) > 1 || len(ms) == 1 && ms[0] != "uni" {
			return opErr("unsupported bra modifier")
		}
		if err := count(ops, 1); err != nil {
			return err
		}
		if ops[0].kind != 's' {
			return opErr("branch target %s is not a label", describe(ops[0]))
		}
		in.op = opBra
		p.fixups = append(p.fixups, fixup{pc: len(p.e.code), label: ops[0].name, line: in.line})
		return nil
	case "ret", "exit":
		if len(ms) > 1 || len(ms) == 1 && ms[0] != "uni" {
			return opErr("unsupported modifier")
		}
		in.op = opRet
		return count(ops, 0)
	}
	return opErr("opcode %q is not in the subset", name)
}

func (p *parser) unary(in *instr, ops []raw, dw, sw uint8) error {
	if err := count(ops, 2); err != nil {
		return err
	}
	var err error
	if in.dst[0], err = p.reg(ops[0], dw); err != nil {
		return err
	}
	in.src[0], err = p.value(ops[1], sw)
	return err
}

func (p *parser) binary(in *instr, ops []raw, w uint8) error {
	if err := count(ops, 3); err != nil {
		return err
	}
	var err error
	if in.dst[0], err = p.reg(ops[0], w); err != nil {
		return err
	}
	for i := range 2 {
		if in.src[i], err = p.value(ops[1+i], w); err != nil {
			return err
		}
	}
	return nil
}

// vecMod removes a .v2/.v4 modifier, if any.
func vecMod(ms []string) (uint8, []string, error) {
	var out []string
	v := uint8(1)
	for _, m := range ms {
		switch m {
		case "v2", "v4":
			if v != 1 {
				return 0, nil, opErr("two vector modifiers")
			}
			v = map[string]uint8{"v2": 2, "v4": 4}[m]
		default:
			out = append(out, m)
		}
	}
	return v, out, nil
}

func (p *parser) decodeLd(in *instr, ms []string, ops []raw) error {
	ti, _, ms, err := takeType(ms, "bus")
	if err != nil {
		return err
	}
	in.vec, ms, err = vecMod(ms)
	if err != nil {
		return err
	}
	if len(ms) == 0 {
		return opErr("ld needs a state space (.param or .global): generic loads are not in the subset")
	}
	in.width = ti.width
	switch ms[0] {
	case "param":
		in.op = opLdParam
		if in.vec != 1 {
			return opErr("vector ld.param is not in the subset")
		}
		if err := noMods(ms[1:]); err != nil {
			return err
		}
	case "global":
		in.op = opLdGlobal
		if len(ms) == 2 && ms[1] == "nc" {
			ms = ms[1:]
		}
		if err := noMods(ms[1:]); err != nil {
			return err
		}
	default:
		return opErr("state space .%s is not in the subset", ms[0])
	}
	if err := count(ops, 2); err != nil {
		return err
	}
	if in.vec > 1 {
		if ops[0].kind != 'v' || len(ops[0].elems) != int(in.vec) {
			return opErr("a .v%d load needs %d destination registers in braces", in.vec, in.vec)
		}
		for i, e := range ops[0].elems {
			if in.dst[i], err = p.reg(raw{kind: 'r', name: e}, ti.width); err != nil {
				return err
			}
		}
	} else if in.dst[0], err = p.reg(ops[0], ti.width); err != nil {
		return err
	}
	return p.address(in, ops[1])
}

// address decodes [base+off]: a 64-bit register, or for ld.param the name
// of a parameter.
func (p *parser) address(in *instr, o raw) error {
	if o.kind != 'm' {
		return opErr("expected an address in brackets, found %s", describe(o))
	}
	in.off = o.off
	if strings.HasPrefix(o.name, "%") {
		r, err := p.reg(raw{kind: 'r', name: o.name}, 64)
		if err != nil {
			return opErr("address: %v", err)
		}
		in.addr = operand{reg: r}
		return nil
	}
	if in.op != opLdParam {
		return opErr("address [%s]: only ld.param may name a variable (module variables are not in the subset)", o.name)
	}
	for _, prm := range p.e.Params {
		if prm.Name == o.name {
			// Known now: check it once, here, instead of at every run.
			n := int64(in.width / 8)
			if o.off < 0 || o.off+n > int64(prm.Size) {
				return opErr("address [%s%+d]: a %d-byte load outside the %d-byte parameter", o.name, o.off, n, prm.Size)
			}
			if (int64(prm.Offset)+o.off)%n != 0 {
				return opErr("address [%s%+d]: a misaligned %d-byte load", o.name, o.off, n)
			}
			in.addr = imm(paramWindow + uint64(prm.Offset))
			in.static = true
			return nil
		}
	}
	return opErr("address [%s]: no parameter of that name", o.name)
}

func (p *parser) decodeSt(in *instr, ms []string, ops []raw) error {
	ti, _, ms, err := takeType(ms, "bus")
	if err != nil {
		return err
	}
	in.vec, ms, err = vecMod(ms)
	if err != nil {
		return err
	}
	if len(ms) == 0 || ms[0] != "global" {
		return opErr("only st.global is in the subset")
	}
	if len(ms) == 2 && ms[1] == "cs" {
		ms = ms[1:]
	}
	if err := noMods(ms[1:]); err != nil {
		return err
	}
	in.op, in.width = opStGlobal, ti.width
	if err := count(ops, 2); err != nil {
		return err
	}
	if err := p.address(in, ops[0]); err != nil {
		return err
	}
	if in.vec > 1 {
		if ops[1].kind != 'v' || len(ops[1].elems) != int(in.vec) {
			return opErr("a .v%d store needs %d source registers in braces", in.vec, in.vec)
		}
		for i, e := range ops[1].elems {
			r, err := p.reg(raw{kind: 'r', name: e}, ti.width)
			if err != nil {
				return err
			}
			in.src[i] = operand{reg: r}
		}
		return nil
	}
	in.src[0], err = p.value(ops[1], ti.width)
	return err
}

func (p *parser) decodeMov(in *instr, ms []string, ops []raw) error {
	ti, _, rest, err := takeType(ms, "bus")
	if err != nil {
		return err
	}
	if err := noMods(rest); err != nil {
		return err
	}
	in.op, in.width, in.srcWidth = opMov, ti.width, ti.width
	if err := count(ops, 2); err != nil {
		return err
	}
	if in.dst[0], err = p.reg(ops[0], ti.width); err != nil {
		return err
	}
	switch o := ops[1]; o.kind {
	case 'r':
		if r, ok := p.regs[o.name]; ok && r < nSpecial {
			if ti.width != 32 {
				return opErr("special register %s is 32-bit", o.name)
			}
			in.src[0] = operand{reg: r}
			return nil
		}
	case 's':
		for _, prm := range p.e.Params {
			if prm.Name == o.name {
				if ti.width != 64 {
					return opErr("the address of parameter %s needs a 64-bit register", o.name)
				}
				in.src[0] = imm(paramWindow + uint64(prm.Offset))
				return nil
			}
		}
		return opErr("mov of %s: only a parameter's address may be taken", o.name)
	}
	in.src[0], err = p.value(ops[1], ti.width)
	return err
}
