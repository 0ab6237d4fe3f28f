//! Deliberate contract violations, to prove that a conformance suite catches them.

/// One way to break the store contract on purpose (see `MemoryStore::with_defect`).
///
/// Each defect is a real bug seen in outbox implementations; the conformance suite's meta-test
/// requires every one of them to be caught.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(not(feature = "defects"), allow(dead_code))]
#[non_exhaustive]
pub enum Defect {
    /// Claim with an `seq > last_seen` cursor: a transaction that commits after a later one
    /// is never published.
    CursorClaim,
    /// Claim one message more than the limit.
    OverClaim,
    /// Ignore per-key order: a key's later messages flow while an earlier one is leased,
    /// waiting for a retry or dead.
    NoHeadOfLine,
    /// Accept complete/fail/release with any token, as long as the message is leased.
    NoFencingToken,
    /// Accept complete/fail/release under the right token even after the lease expired.
    CompleteIgnoresExpiry,
    /// Re-insert a retried message under a fresh id, so consumers cannot deduplicate.
    NewIdPerAttempt,
    /// Treat `FailAction::Dead` as an immediate retry: poison messages never stop.
    NoDeadLettering,
    /// Mark messages published when they are claimed, before the broker confirmed them.
    PublishedAtClaim,
    /// Compute lease ends from the relay host's clock (the real wall clock) instead of the
    /// store's clock.
    RelayClockLeases,
    /// Declare [`Capabilities::sharded_claims`](outbox_traits::Capabilities::sharded_claims)
    /// but ignore [`ClaimRequest::shard`](outbox_traits::ClaimRequest::shard): every claim
    /// looks at every key, so relays claiming different shards take each other's keys.
    ShardIgnored,
    /// Accept a lease extension of 0 (the lease ends at once): an argument rule the contract
    /// refuses with `InvalidInput`.
    ExtendAcceptsZero,
    /// Leave a key whose head waits for a retry out of `status`'s blocked keys (only dead
    /// heads count).
    StatusIgnoresRetrying,
    /// `requeue_seqs` and `discard_seqs` change nothing and return 0: the admin paths that
    /// quarantined rows need.
    SeqAdminIgnored,
    /// Keep a binary message's `payload` (JSON null) but drop its bytes and content type, as a
    /// store that never wrote the binary columns would.
    BinaryDropped,
    /// Purge in two steps, as a store without row locks might: pick the old published rows,
    /// let other callers run, then delete those still there, but return how many it picked.
    /// Two purges at once both count the rows they both picked.
    PurgeCountsPicked,
    /// Relay groups: a shard counts as free while another member's lease on it is live, so two
    /// replicas claim one shard.
    GroupSharesShards,
    /// Relay groups: a shard whose holder's lease expired is never taken over; a frozen or
    /// SIGKILLed replica's shards stay unserved.
    GroupNoTakeover,
    /// Relay groups: a takeover keeps the shard's fence, so the expired holder's work cannot
    /// be told from the new holder's.
    GroupKeepsFence,
    /// Relay groups: `leave_group` keeps the member's shards until their leases run out.
    GroupLeaveKeeps,
    /// Relay groups: a member takes every free shard, not its fair share, and gives none back.
    GroupGreedy,
}

#[cfg_attr(not(feature = "defects"), allow(dead_code))]
impl Defect {
    /// Every defect, for meta-tests that loop over them.
    pub const ALL: [Defect; 15] = [
        Defect::CursorClaim,
        Defect::OverClaim,
        Defect::NoHeadOfLine,
        Defect::NoFencingToken,
        Defect::CompleteIgnoresExpiry,
        Defect::NewIdPerAttempt,
        Defect::NoDeadLettering,
        Defect::PublishedAtClaim,
        Defect::RelayClockLeases,
        Defect::ShardIgnored,
        Defect::ExtendAcceptsZero,
        Defect::StatusIgnoresRetrying,
        Defect::SeqAdminIgnored,
        Defect::BinaryDropped,
        Defect::PurgeCountsPicked,
    ];

    /// Every relay-group defect ([`outbox_traits::RelayGroupStore`]), for the group check's
    /// meta-test: they change nothing a store check sees.
    pub const GROUP: [Defect; 5] = [
        Defect::GroupSharesShards,
        Defect::GroupNoTakeover,
        Defect::GroupKeepsFence,
        Defect::GroupLeaveKeeps,
        Defect::GroupGreedy,
    ];
}
