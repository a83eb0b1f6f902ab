// Package kvcache is the API an inference engine embeds: a Pool of paged
// KV-cache memory shared by tenants, and the Lease an engine holds for each
// admitted request.
//
// # Model
//
// A Pool owns N pages (allocator), the tenants and their quotas (its
// tenant books, internal/tenancy), the scrubber (its quarantine,
// internal/scrub) and the device memory that backs the pages
// (cudaops.Device, which it never hands out: callers reach pages through
// their leases, Lease.ReadPage and WritePage, or address them from
// Pool.Regions). An engine calls Admit before
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
// # One request, from Admit to its pages and back
//
// Admit, TryAdmit and BeginImport run the same admission (admit.go):
//
//  1. Outside the lock, the request is checked on its own (IDs, token
//     counts, prefix material, MaxContextTokens). A context that is done
//     already never admits.
//  2. Under Pool.mu, attemptLocked decides, in one critical section, from
//     everything it depends on: the pool's state, the tenant, a duplicate
//     ID, the pool's capacity and the tenant's quota (refusals no release
//     can cure), the cached prefix, and then isolation.Decide,
//     the one rule for quota and reservations, given the pages the pool can
//     hand out and whether earlier admissions wait for pages.
//  3. Granted, it takes the tenant's charge, shares the matched prefix and
//     allocates the rest; the lease enters the lease table, live.
//     Otherwise the refusal is counted (refuseLocked, the one place that
//     counts) and returned, or, for Admit, the admission waits.
//
// Only three things happen outside the lock, and each is followed by
// another attempt: deriving the prompt's page keys (SHA-256, once per
// request, and only when they are needed: a prompt given as tokens is
// matched under the lock in its domain's trie, by the tokens themselves,
// unless the domain holds pages published by keys alone), scrubbing
// cached pages the admission evicted (their pages are promised to it
// meanwhile: group.claimed), and waiting.
//
// The way back (release.go) is one function too, endLease, for Release,
// Abort, an export's ack or reclaim deadline and an aborted import: under
// Pool.mu it waits for page copies in flight, takes the lease off the
// books (shared pages back to the prefix cache, the others quarantined,
// the tenant uncharged) and counts the fill in Pool.fills; outside it,
// scrub fills the pages and, once the fence has completed, returns them to
// the free list. Close refuses new admissions, wakes waiting ones, waits
// for admissions and copies in progress, ends every lease, drops the
// prefix cache, and waits for every fill before it closes the device.
//
// # Cache groups
//
// A pool's pages are described by a cache spec (Config.Cache; a Geometry
// is the spec of one per-token group of K and V regions, GeometrySpec):
// groups of regions, each group its own page space with its own
// allocator, tenant books and quarantine space. Every group is an
// ordinary group (groups.go): admission decides and takes every group in
// one attempt, all or nothing; the end of a lease releases every group
// into one scrub batch, which the quarantine fills with one device
// operation (cudaops.FillSpans); Stats and Check cover every group the
// same way. What differs is how much a lease holds in each: the
// per-token group (group 0) holds the request's tokens, and alone grows
// and is shared by the prefix cache; a sliding-window group holds a ring
// of pages (Lease.SlideWindows scrubs the pages that left the window); a
// state group holds one slot. See cachespec.go for the model.
//
// # Sizing, growth and preemption
//
// By default a lease holds every page prompt + max new tokens can need
// (SizeFull). Under SizeOnDemand (Config.Sizing, overridden per tenant and
// per request) admission reserves the whole prompt plus a headroom of
// output tokens, and the engine calls Lease.Grow before it writes past the
// lease's capacity. The prompt is never grown: it is admitted whole or
// refused, so no placeholder can come back this way. Growth is decided by
// the same rule as admission, all or nothing, and passes both the queue
// of waiting admissions and the pages the growth watermark
// (Config.GrowthWatermark) keeps from them; a refused growth tells the
// engine to finish or preempt the request. Lease.Preempt ends a lease but
// publishes the full pages of its written tokens in its domain, so that
// admitting the request again with those tokens shares them back. grow.go
// has the details, and how a swap to host memory would plug in.
//
// # Waiting
//
// Admit follows golang.org/x/sync/semaphore's Acquire: it waits until it is
// admitted or ctx is done, first come first served, and a done context
// never admits. TryAdmit and TryBeginImport never wait. A waiter for pages
// holds the line: later admissions may take only their tenant's own unused
// reservation ahead of it, so a tenant under its reservation is admitted
// at once whatever others attempt. A waiter for quota holds nobody up.
// admit.go has the one table of what wakes a waiter.
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
// rooted at the domain and adapter (and covering each page's extra key
// material, Request.PageExtra, such as the images behind a multimodal
// prompt's placeholder tokens), shares the longest chain cached in the
// tenant's domain (never the page holding the last prompt token, which the
// engine writes), and allocates the rest: the lease still holds every page
// prompt + max new tokens need. The match is made once per attempt and
// reused while the index has not changed (its epoch). Lease.HitTokens
// tells the engine where to start prefill. After prefill and Commit,
// Lease.CachePrefix publishes the computed full prompt pages; a published
// page is immutable.
//
// A published page that no lease holds stays Cached, on an LRU list, until
// an admission short of free pages evicts it: eviction takes least recently
// used pages of any domain, sends them through the quarantine (filled,
// fill completed) and only then lets them be handed out, so no other domain
// ever receives a cached page unscrubbed. Sharing inside the domain needs
// no scrub. The index (prefixIndex) is keyed by (domain, key): even a
// forged or colliding key cannot reach another domain's page. Events
// (Pool.Events) report stored, removed and cleared keys to KV-aware
// routers without ever blocking the pool; package kvevents publishes them
// in vLLM's wire format. An event's Keys are the receiver's; handed back
// once read (Pool.ReturnEventKeys), the array carries a later event's
// keys, so that a pool whose consumer does this allocates nothing per
// event. With Prefix.EventTokens, stored events carry their pages' token
// IDs too (for routers that derive their own keys from tokens), in arrays
// recycled the same way (Pool.ReturnEventTokens).
//
// A pool with window or state groups shares a prefix only with the state
// at its end: its prefix cache keeps state checkpoints (checkpoint.go).
// The engine says when its state reflects exactly n tokens, n at a page
// boundary (Lease.CheckpointState; Lease.PrefillCheckpoint is where a
// prefill chunk should end for an identical prompt to reuse all it can);
// kvfence copies the state slot and the window's pages there on the
// device into units the cache owns, and publishes the pages below n in
// the lease's domain. A hit is the longest cached prefix ending at a
// checkpoint of the domain; Admit copies the checkpoint into the lease's
// fresh units before it returns, the watermark at the hit. A checkpoint
// pins its pages; checkpoints are evicted least recently used, for slots
// or for the pages they pin, scrubbed like pages; Prefix.MaxCheckpoints,
// Prefix.CheckpointSlots and TenantConfig.MaxCheckpoints bound them.
//
// # The host tier
//
// With Config.HostTier a pool has a second page space in host memory
// (tier.go): page-locked on CUDA, Go memory on the Host. A cached page the
// device's LRU evicts is copied there (offload) instead of dropped, and
// its entry stays in the prefix index, keyed as before by domain and key:
// a walk or lookup that reaches it matches it like a page on the device.
// An admission whose prefix continues in the tier takes fresh pages for
// those pages, all or nothing like any other, and copies the tier's
// copies into them before the lease is handed out (onload); they are hits
// (HitTokens), and shared from then on. A failed copy refuses the
// admission (ErrOnloadFailed) with nothing handed out. Preempt swaps a
// request's private written pages to the tier, all or none, and its next
// admission in the same domain copies them back. The tier evicts its
// least recently used pages within each domain's share
// (TenantConfig.TierPages), fills every slot it frees with the pool's
// scrub policy before anything else is written to it, and Check covers it:
// free + cached + in flight + quarantined + retired = its slots. In a
// pool with sliding-window or state groups it keeps, in slots of their
// own (HostTierConfig.Checkpoints), the state checkpoints the device
// evicts: a hybrid hit's state comes from there as it would from the
// device, copied into the lease's fresh units before it is handed out.
//
// # Operations
//
// Stats has the figures an operator graphs (package metrics exports them
// to Prometheus), per-tenant admissions and refusals, and the latency of
// scrub fills. Config.Logger, if set, gets one record for each refused
// configuration, failed fill and canary mismatch, with its numbers;
// nothing is logged per admission or release.
//
// # Errors
//
// Every error the package returns wraps one of the sentinels of errors.go;
// match with errors.Is. Admission refusals are *AdmissionError values with
// Need, Have and Limit; Retryable and Permanent say whether to try again.
// Check joins one error per inconsistency, each wrapping ErrCorrupt.
//
// # Concurrency and lock order
//
// Pool and Lease methods are safe for concurrent use. There is one lock,
// Pool.mu, which guards the allocator, the registry, the quarantine's
// bookkeeping, the prefix index, the lease table and the waiting queue;
// lower packages take no locks of their own except the device's internal
// one, which is always innermost: it calls back into kvcache only for a
// staged copy (cudaops.StagedCopier), whose callbacks move bytes between
// staging and the caller's buffers and take no lock. So the order is:
//
//	Pool.mu → device
//
// A method whose name ends in Locked needs Pool.mu held by its caller
// (under the invariants build tag, or -race, it asserts so), and none of
// them takes it. Device fills, key hashing and waiting run without
// Pool.mu. Events are sent under Pool.mu with a non-blocking send. Handoff
// page copies (Outgoing.ReadUnits, Incoming.WriteUnits) are vetted under
// Pool.mu and run outside it, with the lease pinned: an end of a pinned
// lease, and Close, wait on a condition variable of Pool.mu (Pool.quiet)
// until the copies are done. Outgoing.UnitViews lends the units' host
// memory itself to a transport the same way: pinned until the transport
// calls done; and Incoming.LendPages an import's, for a transport that
// writes them out of band (remote memory access): pinned until
// PageLoan.Return, each unit summed where it landed (PageLoan.Landed),
// or each of its blocks as it lands, where the transport's own threads
// write them (PageLoan.Watch, landing.go).
//
// A Lease's own fields are immutable while it lives, except the written
// watermark, the state and the handoff phase (phase.go), which are
// atomics, and its prefix-publication fields (how far CachePrefix got; the
// keys AttachTokens sets once on a lease admitted without them), which
// change only under Pool.mu. A Lease is one incarnation at a time: each
// admission into it numbers it anew (Lease.seq), and an export or import
// belongs to one incarnation only.
package kvcache
