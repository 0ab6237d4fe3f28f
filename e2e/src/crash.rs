//! What the real-process crash tests (`tests/crash_process.rs`) and the `crash-relay` binary
//! share: the settings the binary reads from its environment, the lines it prints, and the
//! messages both sides build.
//!
//! The binary has two modes, chosen by its first argument:
//!
//! - `crash-relay relay`: a relay over the source ([`SOURCE`]) into the broker ([`BROKER_URL`]),
//!   in batches of [`BATCH`] messages, one batch in flight. With [`FAILPOINT`] set (`F3`, or
//!   `F3:2` for its second hit) it prints the failpoint's details, then `reached F3`, and parks;
//!   with [`FAILPOINT_ACTION`]` = wait` it instead waits for one byte on standard input and goes
//!   on. Most points print `batch <id,...>` (the interrupted batch) before `reached`; F7 prints
//!   `dead <id,...>` (the messages its `fail` dead-lettered), F6 also `lease until <ms>` (the
//!   lease end its `extend` returned, in Unix milliseconds); for F6 the hit counts publishes
//!   (`F6:3`: the third publish is held). [`LEASE_MS`] shortens the lease,
//!   [`POISON`] makes one message permanently rejected. Without a failpoint, or once released, it drains until idle, prints
//!   `lease lost <n>` if the store fenced any of its transitions, then `drained <n>` (messages it
//!   marked published), and exits 0.
//! - `crash-relay produce`: one producer transaction writing a business row and [`PRODUCE_COUNT`]
//!   outbox messages ([`message`] from [`PRODUCE_FIRST`] on, tagged [`PRODUCE_TAG`]). It prints
//!   `ids <id,...>`; with `FAILPOINT=F9a` it then prints `reached F9a` and parks inside the open
//!   transaction, with `F9b` it parks right after the COMMIT returned; without a failpoint it
//!   prints `committed <n>` and exits 0.

use outbox::NewMessage;

/// `postgres` or `sqlite`.
pub const SOURCE: &str = "CRASH_SOURCE";
/// Postgres URL (with `CRASH_SOURCE=postgres`).
pub const POSTGRES_URL: &str = "CRASH_POSTGRES_URL";
/// Postgres schema holding the `outbox` and [`BUSINESS_TABLE`] tables.
pub const POSTGRES_SCHEMA: &str = "CRASH_POSTGRES_SCHEMA";
/// SQLite file (with `CRASH_SOURCE=sqlite`), holding the `outbox` and [`BUSINESS_TABLE`] tables.
pub const SQLITE_PATH: &str = "CRASH_SQLITE_PATH";
/// Broker URL, given to `outbox::broker::connect` (`nats://...`, `redis://...`,
/// `kafka://...`).
pub const BROKER_URL: &str = "CRASH_BROKER_URL";
/// Relay batch size; default [`DEFAULT_BATCH`].
pub const BATCH: &str = "CRASH_BATCH";
/// Relay lease in milliseconds; default the engine's (30 s). F6 uses a short one, so that the
/// engine extends it (at half-time) while a publish is held.
pub const LEASE_MS: &str = "CRASH_LEASE_MS";
/// The number `n` of the poison message ([`message`]): the relay's publisher rejects it
/// permanently (and does not attempt the later messages of its key in the same batch), so the
/// relay dead-letters it; the relay then lets the key's later messages flow past it
/// (`HeadPolicy::Skip`).
pub const POISON: &str = "CRASH_POISON";
/// The failpoint, `Fx` or `Fx:n` (the `n`th time it is passed; default the first).
pub const FAILPOINT: &str = "FAILPOINT";
/// `park` (default: stop there for good, until killed) or `wait` (go on after one byte on
/// standard input: the harness decides when, e.g. after SIGSTOP and SIGCONT).
pub const FAILPOINT_ACTION: &str = "FAILPOINT_ACTION";
/// Producer: number of the first message ([`message`]).
pub const PRODUCE_FIRST: &str = "PRODUCE_FIRST";
/// Producer: how many messages its transaction writes.
pub const PRODUCE_COUNT: &str = "PRODUCE_COUNT";
/// Producer: the tag written into each payload.
pub const PRODUCE_TAG: &str = "PRODUCE_TAG";

/// Messages per relay claim unless [`BATCH`] says otherwise: small, so a run spans several
/// batches and a failpoint's hit count picks one in the middle.
pub const DEFAULT_BATCH: usize = 20;

/// Partition keys the messages spread over.
pub const KEYS: usize = 20;

/// The business table the producer writes in the same transaction as its messages:
/// `orders (id TEXT PRIMARY KEY, tag TEXT NOT NULL)`, created by the test.
pub const BUSINESS_TABLE: &str = "orders";

/// The partition key of message `n`: scattered by a multiplicative hash, so a batch of
/// consecutive messages holds several messages of some keys and none of others (with `n % KEYS`
/// every key would appear once per [`KEYS`] messages, and a batch's own order would never
/// matter).
pub fn key(n: usize) -> String {
    let scattered = (n as u64).wrapping_mul(2_654_435_761) >> 7;
    format!("customer-{}", scattered % KEYS as u64)
}

/// The `n`th message of a scenario: keyed by [`key`], payloads carry escapes and non-ASCII text
/// so that a publisher that re-encodes them would be caught, and the tag says which kind of
/// transaction wrote it (committed, rolled back, killed before or after commit).
pub fn message(n: usize, tag: &str) -> NewMessage {
    let key = key(n);
    NewMessage::new(
        "order",
        aggregate_id(n),
        "order.placed",
        serde_json::json!({
            "n": n,
            "tag": tag,
            "customer": key,
            "note": "grüße ✓ \"quoted\" \\ back\tslash",
        }),
    )
    .with_partition_key(key)
    .with_header("tenant", "acme")
}

/// The aggregate id of message `n` (`order-<n>`): how the relay recognises the poison message.
pub fn aggregate_id(n: usize) -> String {
    format!("order-{n}")
}

/// The id of the business row a producer transaction starting at message `first` writes.
pub fn business_row(first: usize) -> String {
    format!("order-batch-{first}")
}
