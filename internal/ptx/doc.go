// Package ptx parses and executes, on the CPU, the small subset of NVIDIA
// PTX that kvfence's own kernels are written in (cudaops/fill.ptx). It
// exists so that the tests of a machine without a GPU run the very kernel
// text a GPU would JIT-compile: cudaops' simulated driver loads the image
// the CUDA device passes to cuModuleLoadData with Parse, resolves the
// entry that cuModuleGetFunction names, packs the launch's arguments
// against the entry's declared .param list, and runs every thread of
// every block with Entry.Run.
//
// # The subset
//
// A module is .version, .target, .address_size 64 and one or more
// .entry functions. An entry declares scalar parameters (.u32, .s32,
// .b32, .u64, .s64, .b64) and byte arrays (.param .align A .b8 name[N]),
// may carry .maxntid, and its body declares registers (.pred, .b32, .u32,
// .s32, .b64, .u64, .s64; %name<N> ranges) and holds labels and these
// instructions, each optionally guarded by @%p or @!%p:
//
//	ld.param ld.global[.nc] (scalar, .v2, .v4)    st.global[.cs] (scalar, .v2, .v4)
//	mov cvta.to.global cvt (u32↔u64)              add sub mul.lo mul.wide mad.lo div rem min max
//	and or xor not shl shr                        setp selp bra[.uni] ret exit
//
// with the special registers %tid, %ntid, %ctaid and %nctaid (.x .y .z).
// Anything else, among it every other state space (.shared, .local,
// .const, module-level .global), barriers, atomics, calls, floating point
// and nested scopes, is refused by Parse with an error wrapping
// ErrInvalid that names the line: a kernel change that leaves the subset
// fails loudly instead of running differently here than on a GPU. Parse
// also checks what ptxas would: every register declared once and used at
// its declared width, every branch target defined, shift amounts .u32,
// immediates that fit their type.
//
// # The machine
//
// Threads are independent (the subset has no shared memory and no
// barriers), so Run executes them one after another, each to its ret;
// any order is one a GPU may take. Registers hold their declared width;
// arithmetic wraps as on the GPU. Generic and global addresses are the
// same numbers (cvta.to.global is the identity), and a kernel parameter's
// address, taken with mov, lies in a param window no global address can
// reach.
//
// Every load and store is checked before it happens: a global access
// must lie inside one allocation of the caller's Memory and be aligned to
// its full width (a .v4.u32 access to 16 bytes), a param access inside
// one declared parameter; otherwise Run stops with a *Fault wrapping
// ErrOutOfBounds or ErrMisaligned that names the block, the thread, the
// line and the address. Division by zero and running past the last
// instruction are faults too (ErrTrap), and so is exceeding the launch's
// instruction budget (ErrBudget), which bounds a kernel that loops
// forever. Launch errors (a grid or block the driver would refuse, an
// argument list that does not match the declared parameters by name and
// size) wrap ErrLaunch and run nothing.
package ptx
