package ptx

import (
	"encoding/binary"
	"fmt"
)

// Memory is the global memory a launch may touch.
type Memory interface {
	// Global returns the n bytes at addr, to be read or written in place,
	// or nil unless all of them lie inside one allocation.
	Global(addr uint64, n int) []byte
}

// Arg is one launch argument: the parameter it is for, by name, and its
// bytes (little-endian, exactly the parameter's size).
type Arg struct {
	Name  string
	Bytes []byte
}

// U32 is a 4-byte argument.
func U32(name string, v uint32) Arg {
	return Arg{name, binary.LittleEndian.AppendUint32(nil, v)}
}

// U64 is an 8-byte argument.
func U64(name string, v uint64) Arg {
	return Arg{name, binary.LittleEndian.AppendUint64(nil, v)}
}

// Pack lays args out as the entry's parameter buffer, as cuLaunchKernel
// copies them. The arguments must be the entry's parameters, in order,
// by name, each exactly its declared size: anything else is an error
// wrapping ErrLaunch, so Go code that passes arguments the kernel text
// does not declare fails here instead of handing a GPU garbage.
func (e *Entry) Pack(args []Arg) ([]byte, error) {
	if len(args) != len(e.Params) {
		return nil, fmt.Errorf("%w: %s declares %d parameters, the launch passes %d", ErrLaunch, e.Name, len(e.Params), len(args))
	}
	buf := make([]byte, e.ParamBytes)
	for i, a := range args {
		prm := e.Params[i]
		if a.Name != prm.Name {
			return nil, fmt.Errorf("%w: %s parameter %d is %s, the launch passes %s", ErrLaunch, e.Name, i, prm.Name, a.Name)
		}
		if len(a.Bytes) != prm.Size {
			return nil, fmt.Errorf("%w: %s parameter %s is .%s (%d bytes), the launch passes %d bytes",
				ErrLaunch, e.Name, prm.Name, prm.Type, prm.Size, len(a.Bytes))
		}
		copy(buf[prm.Offset:], a.Bytes)
	}
	return buf, nil
}

// Launch is one kernel launch.
type Launch struct {
	Grid, Block [3]uint32
	Params      []byte // from Pack
	Mem         Memory
	// Budget bounds the instructions executed by all threads together;
	// it must be positive.
	Budget int64
}

// Stats are what a launch did.
type Stats struct {
	Threads      int64
	Instructions int64
	Loads        int64 // global loads
	Stores       int64 // global stores
	BytesLoaded  int64
	BytesStored  int64
}

func (l Launch) check(e *Entry) error {
	g, b := l.Grid, l.Block
	switch {
	case g[0] == 0 || g[1] == 0 || g[2] == 0 || g[0] > 1<<31-1 || g[1] > 65535 || g[2] > 65535:
		return fmt.Errorf("%w: grid (%d,%d,%d)", ErrLaunch, g[0], g[1], g[2])
	case b[0] == 0 || b[1] == 0 || b[2] == 0 || b[0] > 1024 || b[1] > 1024 || b[2] > 64 ||
		uint64(b[0])*uint64(b[1])*uint64(b[2]) > 1024:
		return fmt.Errorf("%w: block (%d,%d,%d)", ErrLaunch, b[0], b[1], b[2])
	case e.MaxNTID[0] != 0 && uint64(b[0])*uint64(b[1])*uint64(b[2]) > uint64(e.MaxNTID[0])*uint64(e.MaxNTID[1])*uint64(e.MaxNTID[2]):
		return fmt.Errorf("%w: block (%d,%d,%d) exceeds %s's .maxntid %d,%d,%d", ErrLaunch, b[0], b[1], b[2], e.Name,
			e.MaxNTID[0], e.MaxNTID[1], e.MaxNTID[2])
	case len(l.Params) != e.ParamBytes:
		return fmt.Errorf("%w: %d parameter bytes for %s's %d", ErrLaunch, len(l.Params), e.Name, e.ParamBytes)
	case l.Budget <= 0:
		return fmt.Errorf("%w: instruction budget %d", ErrLaunch, l.Budget)
	case l.Mem == nil:
		return fmt.Errorf("%w: no memory", ErrLaunch)
	}
	return nil
}

// poison is what a register holds before the thread writes it, so a read
// of an unwritten register is garbage here as on a GPU, never a lucky 0.
const poison = 0xbad0_c0de_bad0_c0de

func mask(w uint8) uint64 {
	switch w {
	case 1:
		return 1
	case 32:
		return 0xffffffff
	}
	return ^uint64(0)
}

// sext sign-extends the low w bits of v.
func sext(v uint64, w uint8) int64 {
	if w == 32 {
		return int64(int32(uint32(v)))
	}
	return int64(v)
}

func get(regs []uint64, o operand) uint64 {
	if o.reg >= 0 {
		return regs[o.reg]
	}
	return o.imm
}

// Run executes every thread of every block of the launch, one thread at a
// time, and returns what they did. A thread that faults stops the launch
// with a *Fault; what earlier threads stored stays stored, as on a GPU.
func (e *Entry) Run(l Launch) (Stats, error) {
	if err := l.check(e); err != nil {
		return Stats{}, err
	}
	m := machine{e: e, l: &l, budget: l.Budget, regs: make([]uint64, len(e.regWidth))}
	tmpl := make([]uint64, len(e.regWidth))
	for i, w := range e.regWidth {
		tmpl[i] = poison & mask(w)
	}
	for i := range 3 {
		tmpl[regNtid+i] = uint64(l.Block[i])
		tmpl[regNctaid+i] = uint64(l.Grid[i])
	}
	var blk, thr [3]uint32
	for blk[2] = 0; blk[2] < l.Grid[2]; blk[2]++ {
		for blk[1] = 0; blk[1] < l.Grid[1]; blk[1]++ {
			for blk[0] = 0; blk[0] < l.Grid[0]; blk[0]++ {
				for thr[2] = 0; thr[2] < l.Block[2]; thr[2]++ {
					for thr[1] = 0; thr[1] < l.Block[1]; thr[1]++ {
						for thr[0] = 0; thr[0] < l.Block[0]; thr[0]++ {
							copy(m.regs, tmpl)
							for i := range 3 {
								m.regs[regTid+i] = uint64(thr[i])
								m.regs[regCtaid+i] = uint64(blk[i])
							}
							m.st.Threads++
							if in, msg, kind := m.thread(); kind != nil {
								m.st.Instructions = l.Budget - m.budget
								return m.st, &Fault{Kind: kind, Entry: e.Name, Block: blk, Thread: thr, Line: in.line, Instr: in.text, Msg: msg}
							}
						}
					}
				}
			}
		}
	}
	m.st.Instructions = l.Budget - m.budget
	return m.st, nil
}

// machine is a launch in progress: the registers of the thread that runs.
type machine struct {
	e      *Entry
	l      *Launch
	regs   []uint64
	budget int64
	st     Stats
}

// thread runs the current thread to its ret. On a fault it returns the
// instruction, what happened and the kind.
//
// It, global and Run's loop are not instrumented by the race detector
// (go:norace): they touch only the launch's own registers and the
// Memory's bytes, which one goroutine at a time owns for the launch
// (cudaops' simulated driver runs kernels under its mutex), so there is
// nothing to detect, and instrumented they are ten times slower.
//
//go:norace
func (m *machine) thread() (*instr, string, error) {
	code, regs := m.e.code, m.regs
	pc := 0
	for {
		if pc >= len(code) {
			end := &instr{line: m.e.endLine, text: "}"}
			return end, "the thread ran past the last instruction without ret", ErrTrap
		}
		in := &code[pc]
		if m.budget == 0 {
			return in, fmt.Sprintf("%d instructions executed", m.l.Budget), ErrBudget
		}
		m.budget--
		pc++
		if in.guard >= 0 && (regs[in.guard] != 0) == in.neg {
			continue
		}
		a, b := get(regs, in.src[0]), get(regs, in.src[1])
		var v uint64
		switch in.op {
		case opLdParam:
			addr := get(regs, in.addr) + uint64(in.off)
			n := int(in.width / 8)
			if !in.static {
				if why := m.e.paramAccess(addr, n); why != "" {
					kind := ErrOutOfBounds
					if why == "misaligned" {
						kind = ErrMisaligned
					}
					return in, fmt.Sprintf("%d-byte ld.param at %#x: %s", n, addr, why), kind
				}
			}
			off := addr - paramWindow
			if n == 4 {
				v = uint64(binary.LittleEndian.Uint32(m.l.Params[off:]))
			} else {
				v = binary.LittleEndian.Uint64(m.l.Params[off:])
			}
			regs[in.dst[0]] = v
			continue
		case opLdGlobal, opStGlobal:
			if msg, kind := m.global(in); kind != nil {
				return in, msg, kind
			}
			continue
		case opMov:
			v = a
		case opCvt:
			if in.signed && in.srcWidth < in.width {
				v = uint64(sext(a, in.srcWidth))
			} else {
				v = a
			}
		case opAdd:
			v = a + b
		case opSub:
			v = a - b
		case opMulLo:
			v = a * b
		case opMulWide:
			if in.signed {
				v = uint64(sext(a, 32) * sext(b, 32))
			} else {
				v = a * b
			}
		case opMadLo:
			v = a*b + get(regs, in.src[2])
		case opDiv, opRem:
			if b == 0 {
				return in, "division by zero", ErrTrap
			}
			switch {
			case in.signed && in.op == opDiv:
				v = uint64(sext(a, in.width) / sext(b, in.width))
			case in.signed:
				v = uint64(sext(a, in.width) % sext(b, in.width))
			case in.op == opDiv:
				v = a / b
			default:
				v = a % b
			}
		case opMin, opMax:
			less := a < b
			if in.signed {
				less = sext(a, in.width) < sext(b, in.width)
			}
			if less == (in.op == opMin) {
				v = a
			} else {
				v = b
			}
		case opAnd:
			v = a & b
		case opOr:
			v = a | b
		case opXor:
			v = a ^ b
		case opNot:
			v = ^a
		case opShl:
			if b < uint64(in.width) {
				v = a << b
			}
		case opShr:
			switch {
			case in.signed:
				v = uint64(sext(a, in.width) >> min(b, uint64(in.width-1)))
			case b < uint64(in.width):
				v = a >> b
			}
		case opSetp:
			if compare(in, a, b) {
				v = 1
			}
			regs[in.dst[0]] = v
			continue
		case opSelp:
			v = b
			if regs[in.src[2].reg] != 0 {
				v = a
			}
		case opBra:
			pc = in.target
			continue
		case opRet:
			return nil, "", nil
		}
		regs[in.dst[0]] = v & mask(in.width)
	}
}

//go:norace
func compare(in *instr, a, b uint64) bool {
	if in.signed {
		x, y := sext(a, in.width), sext(b, in.width)
		switch in.cmp {
		case cmpLt:
			return x < y
		case cmpLe:
			return x <= y
		case cmpGt:
			return x > y
		case cmpGe:
			return x >= y
		}
	}
	switch in.cmp {
	case cmpEq:
		return a == b
	case cmpNe:
		return a != b
	case cmpLt:
		return a < b
	case cmpLe:
		return a <= b
	case cmpGt:
		return a > b
	}
	return a >= b
}

// global runs a global load or store, checked.
//
//go:norace
func (m *machine) global(in *instr) (string, error) {
	regs := m.regs
	addr := get(regs, in.addr) + uint64(in.off)
	w := int(in.width / 8)
	n := w * int(in.vec)
	verb := "load"
	if in.op == opStGlobal {
		verb = "store"
	}
	if addr%uint64(n) != 0 {
		return fmt.Sprintf("%d-byte %s at %#x", n, verb, addr), ErrMisaligned
	}
	mem := m.l.Mem.Global(addr, n)
	if mem == nil {
		return fmt.Sprintf("%d-byte %s at %#x is not inside one allocation", n, verb, addr), ErrOutOfBounds
	}
	for i := range int(in.vec) {
		if in.op == opLdGlobal {
			if w == 4 {
				regs[in.dst[i]] = uint64(binary.LittleEndian.Uint32(mem[4*i:]))
			} else {
				regs[in.dst[i]] = binary.LittleEndian.Uint64(mem[8*i:])
			}
			continue
		}
		x := get(regs, in.src[i])
		if w == 4 {
			binary.LittleEndian.PutUint32(mem[4*i:], uint32(x))
		} else {
			binary.LittleEndian.PutUint64(mem[8*i:], x)
		}
	}
	if in.op == opLdGlobal {
		m.st.Loads++
		m.st.BytesLoaded += int64(n)
	} else {
		m.st.Stores++
		m.st.BytesStored += int64(n)
	}
	return "", nil
}

// paramAccess checks an n-byte ld.param at addr: it must lie inside one
// declared parameter and be aligned to n. It returns why not, or "".
//
//go:norace
func (e *Entry) paramAccess(addr uint64, n int) string {
	off := addr - paramWindow
	if addr < paramWindow || off >= uint64(e.ParamBytes) || uint64(n) > uint64(e.ParamBytes)-off {
		return "not a parameter's address"
	}
	if addr%uint64(n) != 0 {
		return "misaligned"
	}
	if p := e.paramAt[off]; p < 0 || e.paramAt[off+uint64(n)-1] != p {
		return "not inside one parameter"
	}
	return ""
}

// CheckLaunch reports, running nothing, why Run would refuse l (its
// grid, block, parameter buffer or budget), or nil.
func (e *Entry) CheckLaunch(l Launch) error { return l.check(e) }
