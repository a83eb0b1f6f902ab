// Package isolation holds the rules that keep tenants of one kvfence pool
// apart: who may hold how many pages (Registry, Decide), inside which scope
// pages may be shared (Domain), what a freed page is filled with
// (ScrubPolicy) and how a freed page becomes clean before anyone else can
// receive it (Quarantine).
//
// It knows pages only as counts and IDs. The allocator (below it) moves
// pages between states; the kvcache pool (above it) owns the lock under
// which every type here is used and decides when to call what.
//
// # Tenants, quotas and reservations
//
// A tenant has a quota (the most pages it may hold at once; zero means the
// whole pool) and a reservation (pages no other tenant may take, whether or
// not this tenant uses them; at most its quota). The sum of reservations
// never exceeds the pool. A tenant is charged once for every page its live
// leases hold, however many of its leases share the page.
//
// Every admission is decided by one function, Registry.Decide, from the
// admission's Demand (pages charged to the tenant, pages taken from the
// pool) and the pool's Supply (pages it can hand out now, pages in service,
// whether earlier admissions queue for pages). In order:
//
//  1. A charge beyond the tenant's quota is refused (OverQuota), unless the
//     quota is no smaller than the pool in service: then the pool, not the
//     quota, is what the tenant waits for, and the refusal says so
//     (PoolShort), so that a scheduler keeps such a request in line instead
//     of letting smaller ones overtake it.
//  2. A take beyond the pool's supply is refused (PoolShort).
//  3. A take that would cut into other tenants' unused reservations is
//     refused (Reserved).
//  4. While earlier admissions queue for pages, a tenant may take only its
//     own unused reservation ahead of them (PoolShort otherwise): this is
//     what makes waiting first come, first served, and what lets a tenant
//     under its reservation in without waiting whatever others attempt.
//  5. Otherwise the admission is granted, and Apply charges the tenant.
//
// # Sharing domains
//
// See Domain: every tenant is in exactly one domain at a time, chosen by
// server-side configuration; a domain's ID is the allocator owner of every
// page its tenants hold, so the allocator's same-owner rule for sharing is
// the rule that pages are shared only inside one domain.
//
// # Scrubbing
//
// A ScrubPolicy turns into a cudaops.FillSpec: zero bytes, a poison that is
// a finite number in the KV dtype (never NaN or Inf, which would spread
// through masked attention as 0 × NaN = NaN), or a per-page canary whose
// words are forced finite and which is verified when the page is handed
// out again. See Quarantine for the life of a freed page.
//
// # Invariants (checked by Registry.Check and Quarantine.CheckLocked)
//
//   - every tenant has an ID equal to its index + 1, is found under its
//     name, and uses at least zero pages;
//   - the registry's sum of unused reservations equals the sum over its
//     tenants of max(0, Reserved − Used);
//   - every tenant is in exactly one registered domain, and each domain's
//     tenant count is the number of tenants in it;
//   - every quarantined page belongs to a fill in flight, and pages leave
//     quarantine only through FinishLocked (clean, or retired on error).
//
// # Concurrency
//
// Nothing here is safe for concurrent use on its own: Registry and the
// methods of Quarantine whose names end in Locked run under the owning
// pool's lock (Quarantine asserts it under the invariants build tag).
// Quarantine.Issue touches only the device and runs without the lock.
package isolation
