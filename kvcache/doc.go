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
//     every in-use page's refcount is the number of live leases holding it,
//     and each tenant is charged once per page its leases hold. Check
//     proves it.
//  4. Tenant-scoped sharing only: pages are shared only inside one sharing
//     domain (isolation.Domain), chosen server-side from the tenant.
//
// # Prefix sharing
//
// Every tenant belongs to one sharing domain: its own by default, or one
// the operator names in TenantConfig.Domain for several tenants. A page's
// allocator owner is its domain's ID (not its tenant's), so the
// allocator's rule that Retain keeps the owner is the rule that pages are
// shared only inside a domain. Tenants are charged separately: a tenant
// pays once for each page its leases hold, however many of them share it
// (for the default private domains: once per domain).
//
// A request may carry its prompt's token IDs (or keys derived by
// PageKeys). Admit derives BlockKeys, a SHA-256 chain over full pages
// rooted at the domain and adapter, shares the longest chain cached in the
// tenant's domain (never the page holding the last prompt token, which the
// engine writes), and allocates the rest: the lease still holds every page
// prompt + max new tokens need. Lease.HitTokens tells the engine where to
// start prefill. After prefill and Commit, Lease.CachePrefix publishes the
// computed full prompt pages; a published page is immutable.
//
// A published page that no lease holds stays Cached, on an LRU list, until
// an admission short of free pages evicts it: eviction takes least recently
// used pages of any domain, sends them through the quarantine (filled,
// fill completed) and only then lets them be handed out, so no other domain
// ever receives a cached page unscrubbed. Sharing inside the domain needs
// no scrub. The index is keyed by (domain, key): even a forged or colliding
// key cannot reach another domain's page. Events (Pool.Events) report
// stored, removed and cleared keys to KV-aware routers without ever
// blocking the pool.
// # Concurrency and lock order
//
// Pool and Lease methods are safe for concurrent use. There is one lock,
// Pool.mu, which guards the allocator, the registry, the quarantine's
// bookkeeping and the lease table; lower packages take no locks of their
// own except the device's internal one, which is always innermost and never
// calls back. Device fills run outside Pool.mu. The page semaphore (FIFO,
// golang.org/x/sync/semaphore) counts clean free pages not yet claimed by an
// admission (cached pages are not in it: eviction scrubs them first, and
// their fill's completion releases them into it); a blocking Acquire runs
// without Pool.mu held. So the order is:
//
//	semaphore → Pool.mu → device
//
// TryAcquire and Release never block and may run under Pool.mu. Key
// hashing runs outside Pool.mu. Events are sent under Pool.mu with a
// non-blocking send. Handoff page copies (Outgoing.ReadPages,
// Incoming.WritePages) are vetted under Pool.mu and run outside it, with
// the lease pinned: a release of a pinned lease, and Close, wait on a
// condition variable of Pool.mu until the copies are done (handoff.go).
//
// A Lease's own fields are immutable while it lives, except the written
// watermark, the state and the handoff phase (handoff.go), which are
// atomics, and its prefix-publication fields (how far CachePrefix got; the
// keys AttachTokens sets once on a lease admitted without them), which
// change only under Pool.mu.
package kvcache
