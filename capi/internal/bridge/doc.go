// Package bridge is the logic behind kvfence's C ABI (package capi, built
// with -buildmode=c-shared or c-archive). It lives apart from the cgo
// export layer so that it can be tested, fuzzed and benchmarked with plain
// `go test`, race detector included, and so that the export layer stays a
// thin translation of C arguments.
//
// # Model
//
// C never holds a Go pointer. Pools and leases are named by 64-bit handles
// drawn from one counter that never repeats, so a destroyed pool's or freed
// lease's handle can never name another object: every call on it returns
// ErrInvalidHandle. A pool handle passed where a lease is expected (or the
// reverse) is likewise an invalid handle.
//
// Every error maps to exactly one Status (Classify), the integer a C call
// returns; the numbers behind an admission refusal or a short buffer travel
// in Info.
//
// # Invariants
//
//  1. A lease entry, once freed, stays freed: calls that looked it up just
//     before the free see freed under the entry's lock and fail with
//     ErrInvalidHandle. This is what lets the *kvcache.Lease inside be
//     recycled for the next admission without a racing caller reading the
//     new owner's block table.
//  2. Data only leaves through caller buffers whose capacity was checked
//     first; a short buffer is reported with the size needed and nothing
//     is written.
//
// Lock order: leaseEntry.mu → (kvcache) Pool.mu → device.
// poolEntry.mu only guards the interned tenant names and is never held
// across a call into kvcache.
package bridge
