//! The scenario generator reaches every situation the invariants are about: a suite that never
//! produced a late commit or a stale completion would pass broken stores.

use outbox_conformance_tests::property::measure_coverage;
use outbox_conformance_tests::MemoryHarness;

#[test]
fn generated_scenarios_reach_every_situation() {
    let c = measure_coverage(&MemoryHarness, 300).expect("the reference store passes");
    eprintln!("coverage of 300 scenarios: {c:#?}");
    let reached = [
        ("committed messages", c.committed),
        ("rolled-back messages", c.rolled_back),
        (
            "late commits (lower seq committed after a higher one was claimed)",
            c.late_commits,
        ),
        ("deliveries", c.deliveries),
        ("duplicates after an ambiguous publish", c.dup_ambiguous),
        (
            "duplicates after a crash between publish and complete",
            c.dup_crash,
        ),
        ("duplicates after a lease expiry", c.dup_expiry),
        ("transitions refused with LeaseLost", c.lease_lost),
        ("dead letters", c.dead),
        ("requeues", c.requeued),
        ("dead messages requeued or discarded by seq", c.by_seq),
        (
            "status checks that saw a key blocked by a retrying head",
            c.blocked_retrying,
        ),
        (
            "status checks that saw a key blocked by a dead head",
            c.blocked_dead,
        ),
        ("discards", c.discarded),
        ("purged messages", c.purged),
        ("crashes holding a batch", c.crashes_holding),
        ("messages held back behind their key's head", c.held_back),
        (
            "steps where two relays' calls ran at the same moment",
            c.together,
        ),
        (
            "enqueues writing a key another open transaction wrote (concurrent writers of a key)",
            c.same_key_writers,
        ),
        (
            "messages claimed while an earlier message of their key was uncommitted",
            c.overtaken,
        ),
        ("claims of one shard that returned messages", c.sharded),
        (
            "claimable messages a claim of one shard left out as another shard's",
            c.shard_ruled_out,
        ),
        (
            "claims of one shard while another relay held leases of another shard (a group's division)",
            c.disjoint_shards,
        ),
    ];
    let missing: Vec<&str> = reached
        .iter()
        .filter(|(_, n)| *n == 0)
        .map(|(what, _)| *what)
        .collect();
    assert!(
        missing.is_empty(),
        "300 scenarios never produced: {missing:?}"
    );
}
