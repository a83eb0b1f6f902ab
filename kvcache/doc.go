// Package kvcache is the API an inference engine embeds: a Pool of paged
// KV-cache memory shared by tenants, and the Lease an engine holds for each
// admitted request.
//
// # Model
//
// A Pool owns N pages (allocator), the tenants and their quotas
// (isolation.Registry), the scrubber (isolation.Quarantine) and the device
// memory that backs the pages (cudaops.Device). An engine calls Admit before
// prefill. Admit either returns a Lease that already holds every page the
// request can ever need (prompt + max new tokens), with its block table
// ready, or an *AdmissionError that names the numbers. Nothing in between
// exists: no placeholder lease, no partial allocation, no truncated prompt.
// When the request ends the engine calls Release; the lease's pages are
// filled (zero, poison or canary) on the device, and only when that fill has
// completed do they return to the free list.
//
// # Guarantees
//
//  1. Fail closed: no page ID leaves the pool except in a live Lease.
//     Requests longer than MaxContextTokens or than the pool, over quota,
//     malformed, or arriving while the pool is faulted or closed are refused
//     with nothing allocated.
//  2. Clean before reuse: a released page is filled and the fill's fence has
//     completed before any lease can receive it. A failed fill retires its
//     pages and faults the pool; every admission then fails with
//     ErrPoolFaulted until ClearFault.
//  3. Nothing lost: free + in use + cached + quarantined + retired = total,
//     every in-use page belongs to exactly one live lease of its tenant, and
//     tenants' usage equals their leases' pages. Check proves it.
//
// # Concurrency and lock order
//
// Pool and Lease methods are safe for concurrent use. There is one lock,
// Pool.mu, which guards the allocator, the registry, the quarantine's
// bookkeeping and the lease table; lower packages take no locks of their
// own except the device's internal one, which is always innermost and never
// calls back. Device fills run outside Pool.mu. The page semaphore (FIFO,
// golang.org/x/sync/semaphore) counts clean free pages not yet claimed by an
// admission; it is acquired without Pool.mu held. So the order is:
//
//	semaphore → Pool.mu → device
//
// A Lease's own fields are immutable while it lives, except the written
// watermark, the state and the handoff phase (handoff.go), which are
// atomics.
package kvcache
