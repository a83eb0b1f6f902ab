// Package isolation holds the rules that keep tenants of one kvfence pool
// apart, as configuration and pure functions: what an operator declares
// for a tenant (TenantConfig, Sizing), who may hold how many pages
// (Decide), inside which scope pages may be shared (sharing domains),
// and what a freed page is filled with (ScrubPolicy).
//
// It knows pages only as counts. The books these rules are applied to
// (the tenant registry, the quarantine that scrubs freed pages) are the
// kvcache pool's own machinery, kept under its lock and out of the
// public API; nothing here holds state or a lock.
//
// # Tenants, quotas and reservations
//
// A tenant has a quota (the most pages it may hold at once; zero means the
// whole pool) and a reservation (pages no other tenant may take, whether or
// not this tenant uses them; at most its quota). The sum of reservations
// never exceeds the pool. A tenant is charged once for every page its live
// leases hold, however many of its leases share the page.
//
// Every admission is decided by one function, Decide, from the tenant's
// state (TenantState), the
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
//  5. Otherwise the admission is granted, and the pool charges the tenant.
//
// # Sharing domains
//
// Every tenant is in exactly one sharing domain at a time, chosen by
// server-side configuration (TenantConfig.Domain; by default its own,
// PrivateDomainPrefix + its name). Pages are shared only inside one
// domain; nothing a request carries can choose it.
//
// # Scrubbing
//
// A ScrubPolicy turns into a cudaops.FillSpec: zero bytes, a poison that is
// a finite number in the KV dtype (never NaN or Inf, which would spread
// through masked attention as 0 × NaN = NaN), or a per-page canary whose
// words are forced finite and which is verified when the page is handed
// out again.
package isolation
