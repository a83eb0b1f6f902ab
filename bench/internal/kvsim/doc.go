// Package kvsim is the serving simulator behind kvbench: it replays a
// multi-tenant trace against a kvfence pool and measures what the pool
// and its scrubbing cost.
//
// # Model
//
// Time is virtual. A Trace lists tenants (with the sharing domain they
// join when domains are shared) and requests (arrival, prompt, the
// prompt's shared content, output, output budget, client abort). Shared
// content is either a prefix and its identity, or a chain of block IDs
// (Mooncake's hash_ids: block i's tokens follow from its ID alone). A
// Trace comes from ParseTrace (kvbench's JSONL, see TraceFormat), from
// ParseMooncake or ParseAzure (the public traces; ReadTrace tells the
// formats apart and ImportConfig gives them tenants), or from Generate
// (seeded and deterministic: Poisson arrivals, Zipf tenant popularity,
// organisations sharing a system prompt, lognormal prompt and output
// lengths, round max_tokens budgets, a share of over-long requests and of
// aborts). Prompts get token IDs from the seed (AppendPromptTokens): equal
// over a shared prefix or chain, unique elsewhere.
//
// Bound is the most a prefix cache can hit on a trace: an infinite cache
// that every request fills before the next arrives, counted per page and
// per sharing domain as the pool counts hits. Every run reports it beside
// its hit rate, with the same count over the requests it served, which
// its hits never exceed.
//
// Run replays it as an engine with continuous batching would: every Step
// the arrived requests are offered to the pool in arrival order (requests
// preempted by a refused growth first, see below)
// (TryAdmitInto, which never waits: a busy pool refuses at once and the
// request stays queued; lack of pages holds the queue, quota waits only hold that request, permanent refusals drop the
// request and count its reason). With the prefix cache on, requests carry
// their token IDs and the pool shares the longest prefix cached in the
// tenant's domain. Running requests compute their prompts, after the
// shared prefix, within a per-step prefill budget, then publish them
// (Lease.CachePrefix); every request past its prompt writes one token's
// KV per step. A request that reached
// its output or its client's abort releases its lease; at the end of the
// serving window the live ones are released too (shutdown). Only the
// engine's compute is simulated: the pool calls, the device fills and the
// KV writes are real and timed on the wall clock.
//
// # Lease sizing, growth and preemption
//
// RunConfig.Sizing picks how admission sizes a lease. SizingFull (the
// default) reserves prompt + output budget: a lease never grows and no
// request is preempted. SizingOnDemand reserves the whole prompt (never
// less) and HeadroomTokens of output; before a request writes a token past
// its lease's pages the engine grows it by one page (Lease.TryGrow), and
// the pool's GrowthWatermark keeps a share of the pages from new
// admissions for that. A refused growth is never taken for room: the
// request writes nothing until it holds the page. A refusal the pool may
// lift (ErrPoolExhausted; ErrExceedsQuota while the tenant's other leases
// hold its quota) preempts the newest request of the batch (the newest of
// the tenant, for a quota), which may be the growing one itself, and the
// growth is tried again: newest first, as vLLM does, because it has
// computed the least and the oldest then finish first. Lease.Preempt
// publishes the full pages of the tokens the victim wrote and scrubs the
// rest; the victim goes back to the head of the queue with the page keys
// of everything it computed (its prompt, then its output so far, whose
// token IDs come from the seed: AppendOutputTokens), is admitted again
// with those as its prompt and the rest of its budget, computes again
// only what the prefix cache lost, and generates its next token. A
// preempted request never times out in the queue. A refusal nothing can
// lift (more than the pool in service or the tenant's whole quota) ends
// the request with what it generated (truncated). Re-admissions are
// counted apart (RunResult.Growth): admissions, prompt tokens and the
// prefix cache's figures are first admissions', so that hit rates stay
// comparable with the bound.
//
// # Model pools and state checkpoints
//
// RunConfig.Model runs a pool of a model preset's cache spec, allocated
// as a miniature (Miniature) with every byte reported at the model's
// size. A hybrid model's pool (a state group) shares prefixes through
// state checkpoints: the engine ends its prefill chunks on page
// boundaries and checkpoints at each, and at Lease.PrefillCheckpoint;
// RunResult.Checkpoints reports what they hit, held and cost, beside the
// same trace on the per-token pages alone (ModelPool.PerTokenOnly). See
// model.go.
//
// Each run also reports how many requests ran at once (mean over the
// steps that ran any, and max), the share of the pages leases held that
// held written KV (KVUtilisation), and time to first token, which counts
// a token as delivered when its KV is written.
//
// # What a run guarantees
//
//   - The same trace and config give the same sequence of pool calls, so
//     runs under different policies differ only in what the policy does.
//   - Every run ends with Pool.Check passing, or Run fails with
//     ErrAuditFailed.
//   - A request generates each token of its output once, however often it
//     is preempted, and never writes past the pages its lease holds (a
//     write there fails the run); a lease never grows past its prompt +
//     budget.
//   - With Audit, every freshly allocated page a lease receives that an
//     earlier lease held is read back, before the engine writes, and must
//     hold exactly the policy's scrub pattern in every region. The
//     engine's KV carries a marker naming its tenant, so a stale page is
//     attributed. A safe policy that hands out a stale page fails the
//     run; the unsafe "none" baseline is expected to and reports what it
//     leaked.
//   - With Audit, every page a lease shares from the prefix cache must
//     hold, in every region, KV of a tenant of the lease's own sharing
//     domain: another domain's KV, or no KV, fails any run, the baseline
//     included (sharing does not depend on scrubbing).
//   - Prefix hits depend on the trace, the pool size and the domain
//     layout, never on the scrub policy; they never exceed the served
//     bound (PrefixResult.ServedBound), whose lookups are the run's.
//   - With ReportGeometry, byte figures are the model's, scaled page for
//     page from the small pool actually allocated; counts and ratios do
//     not change. With a Model, the same holds group by group: pages at
//     its per-token group's bytes, state slots at its state's.
//   - On a hybrid model's pool, a request's prefix hit is the longest
//     prefix cached in its domain whose end has a checkpoint; the pool's
//     checkpoint hits equal the leases' hits.
//
// The "none" baseline runs the zero policy's bookkeeping on a device whose
// Fill does nothing (UnsafeNoScrub): it is what an engine that does not
// scrub costs, and it is never safe to serve with.
package kvsim
