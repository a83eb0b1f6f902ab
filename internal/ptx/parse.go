package ptx

import (
	"fmt"
	"strconv"
	"strings"
)

// Module is a parsed PTX module.
type Module struct {
	Version     string // e.g. "7.0"
	Target      string // e.g. "sm_50"
	AddressSize int    // always 64
	Entries     []*Entry
}

// Entry returns the entry function called name, as cuModuleGetFunction
// finds it, or an error wrapping ErrNotFound.
func (m *Module) Entry(name string) (*Entry, error) {
	for _, e := range m.Entries {
		if e.Name == name {
			return e, nil
		}
	}
	return nil, fmt.Errorf("%w: %q", ErrNotFound, name)
}

// Param is one declared kernel parameter and its place in the packed
// parameter buffer a launch passes (each at the next multiple of its
// alignment, as the driver lays them out).
type Param struct {
	Name   string
	Type   string // "u32", "u64", …, or "b8" for a byte array
	Size   int    // bytes
	Align  int
	Offset int
}

// Entry is one .entry function.
type Entry struct {
	Name       string
	Params     []Param
	MaxNTID    [3]uint32 // .maxntid; zeros when not declared
	ParamBytes int       // size of the packed parameter buffer
	code       []instr
	endLine    int     // of the closing brace
	paramAt    []int16 // per byte of the parameter buffer: the parameter there, or -1
	regWidth   []uint8 // per register: 1 (pred), 32 or 64
	regNames   []string
}

// Special registers occupy the first register slots of every entry.
var specialRegs = []string{
	"%tid.x", "%tid.y", "%tid.z", "%ntid.x", "%ntid.y", "%ntid.z",
	"%ctaid.x", "%ctaid.y", "%ctaid.z", "%nctaid.x", "%nctaid.y", "%nctaid.z",
}

const (
	regTid    = 0
	regNtid   = 3
	regCtaid  = 6
	regNctaid = 9
	nSpecial  = 12
)

// paramWindow is where kernel parameters live for mov and ld.param: far
// from any global address a Memory hands out.
const paramWindow = 0xc000_0000_0000_0000

type parser struct {
	toks []token
	pos  int
	mod  *Module
	// per entry
	e      *Entry
	regs   map[string]int32
	labels map[string]int
	fixups []fixup
}

type fixup struct {
	pc    int
	label string
	line  int
}

// Parse parses a PTX module of the subset (see the package doc), as a
// driver's cuModuleLoadData would receive it (a trailing NUL is allowed).
// Anything outside the subset is an error wrapping ErrInvalid that names
// the line.
func Parse(src []byte) (*Module, error) {
	toks, err := lex(src)
	if err != nil {
		return nil, err
	}
	p := &parser{toks: toks, mod: &Module{}}
	if err := p.module(); err != nil {
		return nil, err
	}
	return p.mod, nil
}

func (p *parser) line() int {
	if p.pos < len(p.toks) {
		return p.toks[p.pos].line
	}
	if len(p.toks) > 0 {
		return p.toks[len(p.toks)-1].line
	}
	return 1
}

func (p *parser) errf(format string, args ...any) error {
	return &SyntaxError{Line: p.line(), Msg: fmt.Sprintf(format, args...)}
}

func (p *parser) peek() string {
	if p.pos < len(p.toks) {
		return p.toks[p.pos].text
	}
	return ""
}

func (p *parser) next() string {
	t := p.peek()
	if p.pos < len(p.toks) {
		p.pos++
	}
	return t
}

func (p *parser) expect(want string) error {
	if got := p.peek(); got != want {
		if got == "" {
			return p.errf("expected %q, found the end of the module", want)
		}
		return p.errf("expected %q, found %q", want, got)
	}
	p.pos++
	return nil
}

func (p *parser) number() (uint64, error) {
	t := p.next()
	v, err := parseUint(t)
	if err != nil {
		p.pos--
		return 0, p.errf("expected a number, found %q", t)
	}
	return v, nil
}

func parseUint(t string) (uint64, error) {
	if t == "" || t[0] < '0' || t[0] > '9' {
		return 0, strconv.ErrSyntax
	}
	if strings.HasPrefix(t, "0x") || strings.HasPrefix(t, "0X") {
		return strconv.ParseUint(t[2:], 16, 64)
	}
	if len(t) > 1 && t[0] == '0' {
		return 0, strconv.ErrSyntax // octal: not in the subset
	}
	return strconv.ParseUint(t, 10, 64)
}

func isIdent(t string) bool {
	if t == "" || strings.ContainsAny(t, ".%") {
		return false
	}
	c := t[0]
	return c == '_' || c == '$' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z'
}

func (p *parser) module() error {
	seen := map[string]bool{}
	for p.peek() != "" {
		switch t := p.peek(); t {
		case ".version":
			p.next()
			v := p.next()
			if !versionOK(v) {
				p.pos--
				return p.errf("unsupported .version %q (the subset is PTX ISA 6.0 to 8.x)", v)
			}
			p.mod.Version = v
			seen[t] = true
		case ".target":
			p.next()
			tgt := p.next()
			if !strings.HasPrefix(tgt, "sm_") {
				p.pos--
				return p.errf("unsupported .target %q", tgt)
			}
			p.mod.Target = tgt
			if p.peek() == "," {
				return p.errf(".target options are not in the subset")
			}
			seen[t] = true
		case ".address_size":
			p.next()
			n, err := p.number()
			if err != nil {
				return err
			}
			if n != 64 {
				p.pos--
				return p.errf(".address_size %d: the subset is 64-bit", n)
			}
			p.mod.AddressSize = 64
			seen[t] = true
		case ".visible", ".entry":
			if !seen[".version"] || !seen[".target"] || !seen[".address_size"] {
				return p.errf("an entry before .version, .target and .address_size 64")
			}
			if err := p.entry(); err != nil {
				return err
			}
		default:
			return p.errf("unsupported module-level statement %q", t)
		}
	}
	if len(p.mod.Entries) == 0 {
		return p.errf("the module defines no .entry")
	}
	return nil
}

func versionOK(v string) bool {
	major, minor, ok := strings.Cut(v, ".")
	if !ok {
		return false
	}
	mj, err1 := strconv.Atoi(major)
	_, err2 := strconv.Atoi(minor)
	return err1 == nil && err2 == nil && mj >= 6 && mj <= 8
}

// typeInfo describes a PTX fundamental type of the subset.
type typeInfo struct {
	width  uint8 // bits; 1 for .pred
	signed bool
	kind   byte // 'b', 'u', 's' or 'p'
}

var types = map[string]typeInfo{
	"pred": {1, false, 'p'},
	"b32":  {32, false, 'b'}, "u32": {32, false, 'u'}, "s32": {32, true, 's'},
	"b64": {64, false, 'b'}, "u64": {64, false, 'u'}, "s64": {64, true, 's'},
}

func (p *parser) entry() error {
	if p.peek() == ".visible" {
		p.next()
	}
	if err := p.expect(".entry"); err != nil {
		return err
	}
	name := p.next()
	if !isIdent(name) {
		p.pos--
		return p.errf("bad entry name %q", name)
	}
	for _, e := range p.mod.Entries {
		if e.Name == name {
			p.pos--
			return p.errf("entry %q defined twice", name)
		}
	}
	e := &Entry{Name: name}
	p.e = e
	p.regs = map[string]int32{}
	p.labels = map[string]int{}
	p.fixups = nil
	for i, s := range specialRegs {
		p.regs[s] = int32(i)
		e.regWidth = append(e.regWidth, 32)
		e.regNames = append(e.regNames, s)
	}
	if err := p.expect("("); err != nil {
		return err
	}
	if p.peek() != ")" {
		for {
			if err := p.param(); err != nil {
				return err
			}
			if p.peek() != "," {
				break
			}
			p.next()
		}
	}
	if err := p.expect(")"); err != nil {
		return err
	}
	e.paramAt = make([]int16, e.ParamBytes)
	for i := range e.paramAt {
		e.paramAt[i] = -1
	}
	for i, prm := range e.Params {
		for b := prm.Offset; b < prm.Offset+prm.Size; b++ {
			e.paramAt[b] = int16(i)
		}
	}
	for p.peek() != "{" {
		switch t := p.next(); t {
		case ".maxntid":
			for i := 0; i < 3; i++ {
				n, err := p.number()
				if err != nil {
					return err
				}
				if n == 0 || n > 1024 {
					p.pos--
					return p.errf(".maxntid %d out of range", n)
				}
				e.MaxNTID[i] = uint32(n)
				if p.peek() != "," {
					break
				}
				p.next()
			}
			for i := range e.MaxNTID {
				if e.MaxNTID[i] == 0 {
					e.MaxNTID[i] = 1
				}
			}
		default:
			p.pos--
			return p.errf("unsupported entry directive %q", t)
		}
	}
	p.next() // {
	if err := p.body(); err != nil {
		return err
	}
	for _, f := range p.fixups {
		pc, ok := p.labels[f.label]
		if !ok {
			return &SyntaxError{Line: f.line, Msg: fmt.Sprintf("branch to undefined label %q", f.label)}
		}
		e.code[f.pc].target = pc
	}
	p.mod.Entries = append(p.mod.Entries, e)
	return nil
}

func (p *parser) param() error {
	if err := p.expect(".param"); err != nil {
		return err
	}
	prm := Param{}
	t := p.next()
	if t == ".align" {
		a, err := p.number()
		if err != nil {
			return err
		}
		if a == 0 || a&(a-1) != 0 || a > 16 {
			p.pos--
			return p.errf(".align %d is not a power of two up to 16", a)
		}
		prm.Align = int(a)
		if p.next() != ".b8" {
			p.pos--
			return p.errf("an aligned parameter must be a .b8 array")
		}
		prm.Type = "b8"
	} else {
		ti, ok := types[strings.TrimPrefix(t, ".")]
		if !ok || ti.kind == 'p' || !strings.HasPrefix(t, ".") {
			p.pos--
			return p.errf("unsupported parameter type %q", t)
		}
		prm.Type = t[1:]
		prm.Size = int(ti.width / 8)
		prm.Align = prm.Size
	}
	prm.Name = p.next()
	if !isIdent(prm.Name) {
		p.pos--
		return p.errf("bad parameter name %q", prm.Name)
	}
	for _, o := range p.e.Params {
		if o.Name == prm.Name {
			p.pos--
			return p.errf("parameter %q declared twice", prm.Name)
		}
	}
	if prm.Type == "b8" {
		if err := p.expect("["); err != nil {
			return err
		}
		n, err := p.number()
		if err != nil {
			return err
		}
		if n == 0 || n > 32764 {
			p.pos--
			return p.errf("array parameter of %d bytes", n)
		}
		prm.Size = int(n)
		if err := p.expect("]"); err != nil {
			return err
		}
	} else if p.peek() == "[" {
		return p.errf("arrays must be .b8")
	}
	off := (p.e.ParamBytes + prm.Align - 1) &^ (prm.Align - 1)
	prm.Offset = off
	p.e.ParamBytes = off + prm.Size
	if p.e.ParamBytes > 32764 {
		return p.errf("parameters take %d bytes, more than a launch can pass", p.e.ParamBytes)
	}
	p.e.Params = append(p.e.Params, prm)
	return nil
}

// body parses statements up to the closing brace.
func (p *parser) body() error {
	for {
		t := p.peek()
		switch {
		case t == "":
			return p.errf("the entry's body is not closed")
		case t == "}":
			p.e.endLine = p.line()
			p.next()
			return nil
		case t == "{":
			return p.errf("nested scopes are not in the subset")
		case t == ".reg":
			if err := p.regDecl(); err != nil {
				return err
			}
		case strings.HasPrefix(t, "."):
			return p.errf("unsupported directive %q in an entry (the subset has registers only: no .shared, .local or .const)", t)
		case p.pos+1 < len(p.toks) && p.toks[p.pos+1].text == ":":
			if !isIdent(t) {
				return p.errf("bad label %q", t)
			}
			if _, dup := p.labels[t]; dup {
				return p.errf("label %q defined twice", t)
			}
			p.labels[t] = len(p.e.code)
			p.pos += 2
		default:
			if err := p.instruction(); err != nil {
				return err
			}
		}
	}
}

func (p *parser) regDecl() error {
	p.next() // .reg
	t := p.next()
	ti, ok := types[strings.TrimPrefix(t, ".")]
	if !ok || !strings.HasPrefix(t, ".") {
		p.pos--
		return p.errf("unsupported register type %q", t)
	}
	for {
		name := p.next()
		if !strings.HasPrefix(name, "%") || len(name) < 2 || strings.Contains(name, ".") || !isIdent(name[1:]) {
			p.pos--
			return p.errf("bad register name %q", name)
		}
		names := []string{name}
		if p.peek() == "<" {
			p.next()
			n, err := p.number()
			if err != nil {
				return err
			}
			if n == 0 || n > 4096 {
				p.pos--
				return p.errf("register range of %d", n)
			}
			if err := p.expect(">"); err != nil {
				return err
			}
			names = names[:0]
			for i := range n {
				names = append(names, name+strconv.FormatUint(i, 10))
			}
		}
		for _, n := range names {
			if _, dup := p.regs[n]; dup {
				return p.errf("register %s declared twice", n)
			}
			p.regs[n] = int32(len(p.e.regWidth))
			p.e.regWidth = append(p.e.regWidth, ti.width)
			p.e.regNames = append(p.e.regNames, n)
		}
		if p.peek() != "," {
			break
		}
		p.next()
	}
	return p.expect(";")
}

// raw is an operand as written, before the opcode gives it a meaning.
type raw struct {
	kind  byte // 'r' register (or special register), 'i' immediate, 's' symbol, 'm' [address], 'v' {vector}
	name  string
	imm   uint64
	neg   bool
	off   int64
	elems []string
}

func (p *parser) operand() (raw, error) {
	switch t := p.peek(); {
	case t == "[":
		p.next()
		base := p.next()
		r := raw{kind: 'm', name: base}
		if !strings.HasPrefix(base, "%") && !isIdent(base) {
			p.pos--
			return r, p.errf("bad address %q", base)
		}
		if s := p.peek(); s == "+" || s == "-" {
			p.next()
			n, err := p.number()
			if err != nil {
				return r, err
			}
			if n > 1<<31 {
				p.pos--
				return r, p.errf("address offset %d too large", n)
			}
			r.off = int64(n)
			if s == "-" {
				r.off = -r.off
			}
		}
		return r, p.expect("]")
	case t == "{":
		p.next()
		r := raw{kind: 'v'}
		for {
			e := p.next()
			if !strings.HasPrefix(e, "%") {
				p.pos--
				return r, p.errf("vector element %q is not a register", e)
			}
			r.elems = append(r.elems, e)
			if p.peek() != "," {
				break
			}
			p.next()
		}
		return r, p.expect("}")
	case t == "-":
		p.next()
		n, err := p.number()
		if err != nil {
			return raw{}, err
		}
		return raw{kind: 'i', imm: n, neg: true}, nil
	case strings.HasPrefix(t, "%"):
		p.next()
		return raw{kind: 'r', name: t}, nil
	case t != "" && t[0] >= '0' && t[0] <= '9':
		n, err := p.number()
		return raw{kind: 'i', imm: n}, err
	case isIdent(t):
		p.next()
		return raw{kind: 's', name: t}, nil
	}
	return raw{}, p.errf("bad operand %q", p.peek())
}

// instruction parses one guarded instruction up to its semicolon.
func (p *parser) instruction() error {
	start := p.pos
	line := p.line()
	in := instr{guard: -1, line: line}
	if p.peek() == "@" {
		p.next()
		if p.peek() == "!" {
			p.next()
			in.neg = true
		}
		g := p.next()
		r, ok := p.regs[g]
		if !ok || p.e.regWidth[r] != 1 {
			p.pos--
			return p.errf("guard %q is not a declared .pred register", g)
		}
		in.guard = r
	}
	name := p.next()
	if name == "" || strings.HasPrefix(name, "%") || !('a' <= name[0] && name[0] <= 'z') {
		p.pos--
		return p.errf("expected an instruction, found %q", name)
	}
	var ops []raw
	if p.peek() != ";" {
		for {
			o, err := p.operand()
			if err != nil {
				return err
			}
			ops = append(ops, o)
			if p.peek() != "," {
				break
			}
			p.next()
		}
	}
	if err := p.expect(";"); err != nil {
		return err
	}
	var b strings.Builder
	for i, t := range p.toks[start : p.pos-1] {
		if i > 0 && t.text != "," && t.text != "]" && t.text != "}" && t.text != "+" &&
			p.toks[start+i-1].text != "[" && p.toks[start+i-1].text != "{" && p.toks[start+i-1].text != "+" &&
			p.toks[start+i-1].text != "@" && p.toks[start+i-1].text != "!" && p.toks[start+i-1].text != "-" {
			b.WriteByte(' ')
		}
		b.WriteString(t.text)
	}
	in.text = b.String()
	if err := p.decode(&in, name, ops); err != nil {
		return &SyntaxError{Line: line, Msg: fmt.Sprintf("`%s`: %v", in.text, err)}
	}
	p.e.code = append(p.e.code, in)
	return nil
}
