package ptx

import (
	"errors"
	"fmt"
)

// Sentinel errors. Every error this package returns wraps one of them.
var (
	// ErrInvalid: the text is not PTX of the subset (Parse).
	ErrInvalid = errors.New("ptx: invalid or unsupported PTX")
	// ErrNotFound: no entry of that name (Module.Entry).
	ErrNotFound = errors.New("ptx: no such entry")
	// ErrLaunch: a launch the driver would refuse: bad grid or block
	// dimensions, arguments that do not match the declared parameters.
	ErrLaunch = errors.New("ptx: invalid launch")
	// ErrOutOfBounds: a load or store outside memory it may touch.
	ErrOutOfBounds = errors.New("ptx: access out of bounds")
	// ErrMisaligned: a load or store not aligned to its width.
	ErrMisaligned = errors.New("ptx: misaligned access")
	// ErrBudget: the launch executed more instructions than allowed.
	ErrBudget = errors.New("ptx: instruction budget exhausted")
	// ErrTrap: division by zero, or a thread ran past the last
	// instruction.
	ErrTrap = errors.New("ptx: trap")
)

// SyntaxError is a refused module: the line and what is wrong there.
type SyntaxError struct {
	Line int
	Msg  string
}

func (e *SyntaxError) Error() string { return fmt.Sprintf("ptx: line %d: %s", e.Line, e.Msg) }

// Unwrap makes every SyntaxError an ErrInvalid.
func (e *SyntaxError) Unwrap() error { return ErrInvalid }

// Fault is a thread that stopped on an error while running.
type Fault struct {
	Kind   error // ErrOutOfBounds, ErrMisaligned, ErrBudget or ErrTrap
	Entry  string
	Block  [3]uint32
	Thread [3]uint32
	Line   int    // source line of the faulting instruction
	Instr  string // its text
	Msg    string // what happened, e.g. the address and width
}

func (f *Fault) Error() string {
	return fmt.Sprintf("%v: %s block (%d,%d,%d) thread (%d,%d,%d) line %d `%s`: %s", f.Kind, f.Entry,
		f.Block[0], f.Block[1], f.Block[2], f.Thread[0], f.Thread[1], f.Thread[2], f.Line, f.Instr, f.Msg)
}

// Unwrap returns the fault's kind.
func (f *Fault) Unwrap() error { return f.Kind }
