//! Relay settings and their validation.

use std::time::Duration;

use outbox_traits::{Capabilities, Error, HeadPolicy};

use crate::backoff::Backoff;

/// The most claim shards a relay accepts ([`RelayConfig::claim_shards`]).
pub const MAX_CLAIM_SHARDS: usize = 256;

/// The batch size of a relay given none, over a store that declares no
/// [`Capabilities::preferred_batch`].
pub const DEFAULT_BATCH_SIZE: usize = 500;

/// The claim shards of a relay given none, over a store that declares no
/// [`Capabilities::preferred_claim_shards`] (or cannot shard): one claim at a time.
pub const DEFAULT_CLAIM_SHARDS: usize = 1;

/// Settings of a [`Relay`](crate::Relay), built with [`RelayConfig::builder`] (which checks
/// them) and read with getters of the same names:
///
/// ```
/// use std::time::Duration;
/// use outbox_engine::RelayConfig;
/// let config = RelayConfig::builder()
///     .batch_size(100)
///     .lease(Duration::from_secs(10))
///     .build()?;
/// assert_eq!(config.batch_size(), Some(100));
/// assert!(RelayConfig::builder().concurrency(0).build().is_err());
/// # Ok::<(), outbox_traits::Error>(())
/// ```
///
/// The batch size and the claim shards left at `None` are chosen by the store (see
/// [`RelayConfig::tuned_for`]): a user who sets nothing gets what the store declares fastest.
/// [`RelayConfig::default`] is `RelayConfig::builder().build()`.
#[derive(Debug, Clone, PartialEq)]
pub struct RelayConfig {
    /// Most messages per claim (and per publish call). Default `None`: the store's
    /// [`Capabilities::preferred_batch`] (Postgres: 2,000), else [`DEFAULT_BATCH_SIZE`] (500).
    pub(crate) batch_size: Option<usize>,
    /// How long a claim is held before another relay may take it over. The relay extends it at
    /// half-time while a publish is still running. Default: 30 s.
    pub(crate) lease: Duration,
    /// Attempts after which a transiently failing message is dead-lettered: a failure of a
    /// message that already has `max_attempts - 1` recorded attempts kills it. Default: 10.
    pub(crate) max_attempts: u32,
    /// Back-off of failed messages (the delay before their next attempt, by the store's clock).
    /// Default: 1 s doubling up to 5 min, ±20 %.
    pub(crate) backoff: Backoff,
    /// Back-off of the relay itself when a store call fails (claim, complete, fail, extend,
    /// release, wake-up subscription): short, so the relay resumes soon after an outage.
    /// Default: 100 ms doubling up to 30 s, ±20 %.
    pub(crate) store_backoff: Backoff,
    /// Batches in flight at once: while one is being published the next is claimed. Default: 2.
    pub(crate) concurrency: usize,
    /// Claims that may run at once, each over its own shard of the partition keys. Default
    /// `None`: the store's [`Capabilities::preferred_claim_shards`] if it declares
    /// [`Capabilities::sharded_claims`] (Postgres: 2), else [`DEFAULT_CLAIM_SHARDS`] (1), with no
    /// warning.
    ///
    /// Takes effect only when the store declares [`Capabilities::sharded_claims`]: the relay
    /// then splits the keys into `claim_shards` shards (see
    /// [`ClaimShard`](outbox_traits::ClaimShard)) and runs one claim per shard at a time, so a
    /// claim's latency no longer bounds the drain alone. With any other store it runs one claim
    /// at a time, as with 1, and, when more were asked for explicitly, logs a warning saying so
    /// when its loop starts.
    ///
    /// [`concurrency`](Self::concurrency) stays the total of batches in flight across the
    /// shards (a running claim counts as one, since it becomes one), and each shard has at most
    /// `ceil(concurrency / claim_shards)` in flight. More shards than `concurrency` are allowed:
    /// each shard then has at most 1 batch in flight, and within the total not all of them at
    /// once. Per-key order and fencing never depend on this setting; it only lets claims run
    /// side by side. Recommended on Postgres: 2, with `concurrency` 2 and batches of 2,000 (see
    /// the README's "Speed"). At most
    /// [`MAX_CLAIM_SHARDS`]: each shard is a claim request and a pacing state the loop looks at
    /// on every turn, and beyond `concurrency` shards no more claims can run at once.
    pub(crate) claim_shards: Option<usize>,
    /// What a dead head message does to its key's later messages. Default: [`HeadPolicy::Block`].
    pub(crate) head_policy: HeadPolicy,
    /// First wait after an empty claim; it doubles on each further empty claim up to
    /// `poll_max`, and is also the pause after a partial claim. Default: 10 ms.
    pub(crate) poll_min: Duration,
    /// Longest wait between claims when idle (wake-ups cut it short). Default: 100 ms.
    ///
    /// Stores without wake-ups (MariaDB, SQLite, Postgres with NOTIFY off) find a message
    /// written after an idle spell only at the next poll, so this bounds their latency; an
    /// idle relay then makes about ten cheap claims a second (measured in `BENCHMARKS.md`,
    /// "Latency for SQL writers"). With wake-ups (Postgres) a commit cuts the wait short and
    /// this is only the fallback.
    pub(crate) poll_max: Duration,
    /// Deadline used when the relay is stopped without an explicit one ([`Relay::run`] and a
    /// dropped [`RelayHandle`]). Default: 10 s.
    ///
    /// [`Relay::run`]: crate::Relay::run
    /// [`RelayHandle`]: crate::RelayHandle
    pub(crate) shutdown_deadline: Duration,
    /// The relay group this relay joins (`None`, the default: no group). Relays of one outbox
    /// that name the same group divide its claim shards between them, each claiming only the
    /// shards it holds a lease on (see [`crate::group`] and
    /// [`RelayGroupStore`](outbox_traits::RelayGroupStore)); a relay that holds none waits as a
    /// hot standby. Needs a store that supports groups, handed over with
    /// [`Relay::with_group_store`](crate::Relay::with_group_store) (the `outbox-relay` program
    /// does it for Postgres and MariaDB); without one the relay logs a warning and runs as without
    /// a group.
    /// Only [`Relay::run`](crate::Relay::run) and [`Relay::spawn`](crate::Relay::spawn) join;
    /// drains claim every shard.
    pub(crate) group: Option<String>,
    /// How long a group member's heartbeat and shard leases last (database clock); it renews
    /// them every third of it, and at least every second. A member that dies or freezes has its
    /// shards taken over within about this long; one that joins gets its share within about a
    /// second whatever the lease. Default: 10 s.
    pub(crate) group_lease: Duration,
}

impl RelayConfig {
    /// A builder starting from the defaults (each setter's docs give its default).
    pub fn builder() -> RelayConfigBuilder {
        RelayConfigBuilder::default()
    }

    /// A builder starting from this config's values, to derive a config from another (the
    /// `outbox-relay` program derives each outbox's from the top-level one).
    pub fn to_builder(&self) -> RelayConfigBuilder {
        RelayConfigBuilder {
            config: self.clone(),
        }
    }

    /// Most messages per claim; `None`: the store chooses. See [`RelayConfigBuilder::batch_size`].
    pub fn batch_size(&self) -> Option<usize> {
        self.batch_size
    }

    /// How long a claim is held before another relay may take it over. See [`RelayConfigBuilder::lease`].
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Attempts after which a transiently failing message is dead-lettered. See [`RelayConfigBuilder::max_attempts`].
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Back-off of failed messages. See [`RelayConfigBuilder::backoff`].
    pub fn backoff(&self) -> Backoff {
        self.backoff
    }

    /// Back-off of the relay itself when a store call fails. See [`RelayConfigBuilder::store_backoff`].
    pub fn store_backoff(&self) -> Backoff {
        self.store_backoff
    }

    /// Batches in flight at once. See [`RelayConfigBuilder::concurrency`].
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// Claims that may run at once, each over its own shard of the keys; `None`: the store chooses. See [`RelayConfigBuilder::claim_shards`].
    pub fn claim_shards(&self) -> Option<usize> {
        self.claim_shards
    }

    /// What a dead head message does to its key's later messages. See [`RelayConfigBuilder::head_policy`].
    pub fn head_policy(&self) -> HeadPolicy {
        self.head_policy
    }

    /// First wait after an empty claim. See [`RelayConfigBuilder::poll_min`].
    pub fn poll_min(&self) -> Duration {
        self.poll_min
    }

    /// Longest wait between claims when idle. See [`RelayConfigBuilder::poll_max`].
    pub fn poll_max(&self) -> Duration {
        self.poll_max
    }

    /// Deadline used when the relay is stopped without an explicit one. See [`RelayConfigBuilder::shutdown_deadline`].
    pub fn shutdown_deadline(&self) -> Duration {
        self.shutdown_deadline
    }

    /// The relay group this relay joins, if any. See [`RelayConfigBuilder::group`].
    pub fn group(&self) -> Option<&str> {
        self.group.as_deref()
    }

    /// How long a group member's heartbeat and shard leases last. See [`RelayConfigBuilder::group_lease`].
    pub fn group_lease(&self) -> Duration {
        self.group_lease
    }
}

impl Default for RelayConfig {
    /// The defaults: `RelayConfig::builder().build()`.
    fn default() -> Self {
        Self {
            batch_size: None,
            lease: Duration::from_secs(30),
            max_attempts: 10,
            backoff: Backoff::default(),
            store_backoff: Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(30),
                ..Backoff::default()
            },
            concurrency: 2,
            claim_shards: None,
            head_policy: HeadPolicy::Block,
            poll_min: Duration::from_millis(10),
            poll_max: Duration::from_millis(100),
            shutdown_deadline: Duration::from_secs(10),
            group: None,
            group_lease: Duration::from_secs(10),
        }
    }
}

/// Builder of [`RelayConfig`]; [`RelayConfigBuilder::build`] checks every setting.
#[derive(Debug, Clone, Default)]
pub struct RelayConfigBuilder {
    config: RelayConfig,
}

impl RelayConfigBuilder {
    /// Most messages per claim (and per publish call). `None` (the default): the store's
    /// [`Capabilities::preferred_batch`] (Postgres: 2,000), else [`DEFAULT_BATCH_SIZE`] (500).
    pub fn batch_size(mut self, batch_size: impl Into<Option<usize>>) -> Self {
        self.config.batch_size = batch_size.into();
        self
    }

    /// How long a claim is held before another relay may take it over. The relay extends it at
    /// half-time while a publish is still running. Default: 30 s.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// Attempts after which a transiently failing message is dead-lettered: a failure of a
    /// message that already has `max_attempts - 1` recorded attempts kills it. Default: 10.
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.config.max_attempts = max_attempts;
        self
    }

    /// Back-off of failed messages (the delay before their next attempt, by the store's clock).
    /// Default: 1 s doubling up to 5 min, ±20 %.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.config.backoff = backoff;
        self
    }

    /// Back-off of the relay itself when a store call fails (claim, complete, fail, extend,
    /// release, wake-up subscription): short, so the relay resumes soon after an outage.
    /// Default: 100 ms doubling up to 30 s, ±20 %.
    pub fn store_backoff(mut self, store_backoff: Backoff) -> Self {
        self.config.store_backoff = store_backoff;
        self
    }

    /// Batches in flight at once: while one is being published the next is claimed. Default: 2.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.config.concurrency = concurrency;
        self
    }

    /// Claims that may run at once, each over its own shard of the partition keys. Default
    /// `None`: the store's [`Capabilities::preferred_claim_shards`] if it declares
    /// [`Capabilities::sharded_claims`] (Postgres: 2), else [`DEFAULT_CLAIM_SHARDS`] (1), with no
    /// warning.
    ///
    /// Takes effect only when the store declares [`Capabilities::sharded_claims`]: the relay
    /// then splits the keys into `claim_shards` shards (see
    /// [`ClaimShard`](outbox_traits::ClaimShard)) and runs one claim per shard at a time, so a
    /// claim's latency no longer bounds the drain alone. With any other store it runs one claim
    /// at a time, as with 1, and, when more were asked for explicitly, logs a warning saying so
    /// when its loop starts.
    ///
    /// [`concurrency`](Self::concurrency) stays the total of batches in flight across the
    /// shards (a running claim counts as one, since it becomes one), and each shard has at most
    /// `ceil(concurrency / claim_shards)` in flight. More shards than `concurrency` are allowed:
    /// each shard then has at most 1 batch in flight, and within the total not all of them at
    /// once. Per-key order and fencing never depend on this setting; it only lets claims run
    /// side by side. Recommended on Postgres: 2, with `concurrency` 2 and batches of 2,000 (see
    /// the README's "Speed"). At most
    /// [`MAX_CLAIM_SHARDS`]: each shard is a claim request and a pacing state the loop looks at
    /// on every turn, and beyond `concurrency` shards no more claims can run at once.
    pub fn claim_shards(mut self, claim_shards: impl Into<Option<usize>>) -> Self {
        self.config.claim_shards = claim_shards.into();
        self
    }

    /// What a dead head message does to its key's later messages. Default: [`HeadPolicy::Block`].
    pub fn head_policy(mut self, head_policy: HeadPolicy) -> Self {
        self.config.head_policy = head_policy;
        self
    }

    /// First wait after an empty claim; it doubles on each further empty claim up to
    /// `poll_max`, and is also the pause after a partial claim. Default: 10 ms.
    pub fn poll_min(mut self, poll_min: Duration) -> Self {
        self.config.poll_min = poll_min;
        self
    }

    /// Longest wait between claims when idle (wake-ups cut it short). Default: 100 ms.
    ///
    /// Stores without wake-ups (MariaDB, SQLite, Postgres with NOTIFY off) find a message
    /// written after an idle spell only at the next poll, so this bounds their latency; an
    /// idle relay then makes about ten cheap claims a second (measured in `BENCHMARKS.md`,
    /// "Latency for SQL writers"). With wake-ups (Postgres) a commit cuts the wait short and
    /// this is only the fallback.
    pub fn poll_max(mut self, poll_max: Duration) -> Self {
        self.config.poll_max = poll_max;
        self
    }

    /// Deadline used when the relay is stopped without an explicit one ([`Relay::run`] and a
    /// dropped [`RelayHandle`]). Default: 10 s.
    ///
    /// [`Relay::run`]: crate::Relay::run
    /// [`RelayHandle`]: crate::RelayHandle
    pub fn shutdown_deadline(mut self, shutdown_deadline: Duration) -> Self {
        self.config.shutdown_deadline = shutdown_deadline;
        self
    }

    /// The relay group this relay joins (`None`, the default: no group). Relays of one outbox
    /// that name the same group divide its claim shards between them, each claiming only the
    /// shards it holds a lease on (see [`crate::group`] and
    /// [`RelayGroupStore`](outbox_traits::RelayGroupStore)); a relay that holds none waits as a
    /// hot standby. Needs a store that supports groups, handed over with
    /// [`Relay::with_group_store`](crate::Relay::with_group_store) (the `outbox-relay` program
    /// does it for Postgres); without one the relay logs a warning and runs as without a group.
    /// Only [`Relay::run`](crate::Relay::run) and [`Relay::spawn`](crate::Relay::spawn) join;
    /// drains claim every shard.
    pub fn group(mut self, group: impl Into<Option<String>>) -> Self {
        self.config.group = group.into();
        self
    }

    /// How long a group member's heartbeat and shard leases last (database clock); it renews
    /// them every third of it, and at least every second. A member that dies or freezes has its
    /// shards taken over within about this long; one that joins gets its share within about a
    /// second whatever the lease. Default: 10 s.
    pub fn group_lease(mut self, group_lease: Duration) -> Self {
        self.config.group_lease = group_lease;
        self
    }

    /// Check the settings and build the config; [`Error::InvalidInput`] says which one to fix.
    pub fn build(self) -> Result<RelayConfig, Error> {
        self.config.validate()?;
        Ok(self.config)
    }
}

/// Who chose a setting that the store may choose ([`Tuning`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chosen {
    /// Set explicitly in the [`RelayConfig`].
    Config,
    /// Left unset, and taken from what the store declares ([`Capabilities`]).
    Store,
    /// Left unset, and the store declares nothing for it: the relay's default.
    Default,
}

impl Chosen {
    /// `config`, `store` or `default`, for logs and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            Chosen::Config => "config",
            Chosen::Store => "store",
            Chosen::Default => "default",
        }
    }
}

/// The batch size and claim shards a relay runs with, once its [`RelayConfig`] meets the store's
/// [`Capabilities`] ([`RelayConfig::tuned_for`], [`Relay::tuning`](crate::Relay::tuning)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// Most messages per claim.
    pub batch_size: usize,
    /// Who chose [`Tuning::batch_size`].
    pub batch_size_chosen: Chosen,
    /// Claims run side by side, one per shard of the keys (1: one claim at a time over every
    /// key). Always 1 with a store that does not declare [`Capabilities::sharded_claims`].
    pub claim_shards: usize,
    /// Who chose [`Tuning::claim_shards`].
    pub claim_shards_chosen: Chosen,
    /// More than one shard was asked for explicitly of a store that cannot shard: the relay
    /// runs one claim at a time and warns.
    pub shards_ignored: bool,
}

impl RelayConfig {
    /// The batch size and claim shards this config runs with over a store that declares
    /// `caps`: an explicit setting wins; an unset one is the store's preference, else the
    /// default (500 messages, 1 claim at a time). A store that cannot shard always gets one
    /// claim at a time.
    ///
    /// ```
    /// use outbox_engine::{Chosen, RelayConfig};
    /// use outbox_traits::Capabilities;
    /// let postgres_like = Capabilities::none()
    ///     .with_sharded_claims(true)
    ///     .with_preferred_claim_shards(2)
    ///     .with_preferred_batch(2000);
    /// let tuning = RelayConfig::default().tuned_for(&postgres_like);
    /// assert_eq!((tuning.claim_shards, tuning.batch_size), (2, 2000));
    /// assert_eq!(tuning.claim_shards_chosen, Chosen::Store);
    /// let explicit = RelayConfig::builder().claim_shards(1).build()?;
    /// assert_eq!(explicit.tuned_for(&postgres_like).claim_shards, 1);
    /// # Ok::<(), outbox_traits::Error>(())
    /// ```
    pub fn tuned_for(&self, caps: &Capabilities) -> Tuning {
        let (batch_size, batch_size_chosen) = match (self.batch_size, caps.preferred_batch) {
            (Some(n), _) => (n, Chosen::Config),
            (None, Some(n)) => (n, Chosen::Store),
            (None, None) => (DEFAULT_BATCH_SIZE, Chosen::Default),
        };
        let preferred = caps.preferred_claim_shards.filter(|_| caps.sharded_claims);
        let (asked, claim_shards_chosen) = match (self.claim_shards, preferred) {
            (Some(n), _) => (n, Chosen::Config),
            (None, Some(n)) => (n, Chosen::Store),
            (None, None) => (DEFAULT_CLAIM_SHARDS, Chosen::Default),
        };
        let shards_ignored = !caps.sharded_claims && asked > 1;
        Tuning {
            batch_size,
            batch_size_chosen,
            claim_shards: if caps.sharded_claims { asked } else { 1 },
            claim_shards_chosen,
            shards_ignored,
        }
    }

    /// Check the settings; [`Error::InvalidInput`] says which one to fix.
    fn validate(&self) -> Result<(), Error> {
        let bad = |msg: String| Err(Error::invalid_input(format!("relay config: {msg}")));
        if self.batch_size == Some(0) {
            return bad(
                "batch_size is 0; it must be at least 1 (or unset: the store's choice, else 500)"
                    .into(),
            );
        }
        if self.lease.is_zero() {
            return bad("lease is 0; it must be longer than a publish takes (default 30s)".into());
        }
        if self.max_attempts == 0 {
            return bad("max_attempts is 0; it must be at least 1 (default 10)".into());
        }
        if self.concurrency == 0 {
            return bad("concurrency is 0; at least 1 batch must be in flight (default 2)".into());
        }
        if let Some(shards) = self.claim_shards {
            check_claim_shards(shards).or_else(bad)?;
        }
        if let Some(group) = &self.group {
            if group.is_empty() || group.len() > outbox_traits::MAX_GROUP_NAME_BYTES {
                return bad(format!(
                    "group name must be 1 to {} bytes long",
                    outbox_traits::MAX_GROUP_NAME_BYTES
                ));
            }
        }
        if self.group_lease < Duration::from_millis(30) {
            return bad(format!(
                "group_lease of {:?} is too short; members renew every third of it (default 10s)",
                self.group_lease
            ));
        }
        outbox_traits::validate_duration("group_lease", self.group_lease)?;
        check_backoff("backoff", &self.backoff)?;
        check_backoff("store_backoff", &self.store_backoff)?;
        if self.poll_min.is_zero() {
            return bad(
                "poll_min is 0; an idle relay would claim in a tight loop (default 10ms)".into(),
            );
        }
        if self.poll_min > self.poll_max {
            return bad(format!(
                "poll_min ({:?}) is greater than poll_max ({:?})",
                self.poll_min, self.poll_max
            ));
        }
        Ok(())
    }
}

/// Refuse a shard count no relay can run (0, or above [`MAX_CLAIM_SHARDS`]).
fn check_claim_shards(shards: usize) -> Result<(), String> {
    if shards == 0 {
        return Err(
            "claim_shards is 0; at least 1 claim must be able to run (or unset: the store's \
             choice, else 1)"
                .into(),
        );
    }
    if shards > MAX_CLAIM_SHARDS {
        return Err(format!(
            "claim_shards is {shards}; it must be at most {MAX_CLAIM_SHARDS} (more shards than \
             batches in flight cannot claim at once)"
        ));
    }
    Ok(())
}

impl Tuning {
    /// Refuse a store's preference no relay can run (a batch of 0, 0 shards or too many).
    pub(crate) fn validate(&self) -> Result<(), Error> {
        let problem = if self.batch_size == 0 {
            Some("a batch size of 0".to_owned())
        } else if self.claim_shards_chosen == Chosen::Store {
            check_claim_shards(self.claim_shards).err()
        } else {
            None
        };
        match problem {
            Some(problem) => Err(Error::invalid_input(format!(
                "relay config: the store declares {problem}; set batch_size and claim_shards \
                 explicitly, and report this to the store's authors"
            ))),
            None => Ok(()),
        }
    }
}

fn check_backoff(name: &str, b: &Backoff) -> Result<(), Error> {
    let problem = if !(0.0..=1.0).contains(&b.jitter) {
        format!(
            "{name}.jitter is {}; it must be between 0 and 1 (e.g. 0.2)",
            b.jitter
        )
    } else if !b.multiplier.is_finite() || b.multiplier < 1.0 {
        format!(
            "{name}.multiplier is {}; it must be a finite number of at least 1 (e.g. 2)",
            b.multiplier
        )
    } else if b.initial > b.max {
        format!(
            "{name}.initial ({:?}) is greater than {name}.max ({:?})",
            b.initial, b.max
        )
    } else {
        return Ok(());
    };
    Err(Error::invalid_input(format!("relay config: {problem}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message_of(config: RelayConfigBuilder) -> String {
        match config.build() {
            Err(Error::InvalidInput(msg)) => msg,
            other => panic!("expected InvalidInput, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid_and_as_documented() {
        let c = RelayConfig::default();
        assert_eq!(RelayConfig::builder().build().unwrap(), c);
        assert_eq!(c.batch_size, None);
        assert_eq!(c.lease, Duration::from_secs(30));
        assert_eq!(c.max_attempts, 10);
        assert_eq!(c.concurrency, 2);
        assert_eq!(c.claim_shards, None);
        assert_eq!(c.head_policy, HeadPolicy::Block);
        assert_eq!(c.poll_min, Duration::from_millis(10));
        assert_eq!(c.poll_max, Duration::from_millis(100));
        assert_eq!(c.shutdown_deadline, Duration::from_secs(10));
        assert_eq!(c.backoff.initial, Duration::from_secs(1));
        assert_eq!(c.backoff.max, Duration::from_secs(300));
        assert_eq!(c.backoff.multiplier, 2.0);
        assert_eq!(c.backoff.jitter, 0.2);
        assert_eq!(c.store_backoff.initial, Duration::from_millis(100));
        assert_eq!(c.store_backoff.max, Duration::from_secs(30));
    }

    #[test]
    fn each_bad_setting_is_named() {
        let d = RelayConfig::builder;
        let mut cases: Vec<(RelayConfigBuilder, &str)> = vec![
            (d().batch_size(0), "batch_size"),
            (d().lease(Duration::ZERO), "lease"),
            (d().max_attempts(0), "max_attempts"),
            (d().concurrency(0), "concurrency"),
            (d().claim_shards(0), "claim_shards is 0"),
            (
                d().backoff(Backoff {
                    jitter: 1.5,
                    ..Backoff::default()
                }),
                "jitter",
            ),
            (
                d().backoff(Backoff {
                    jitter: -0.1,
                    ..Backoff::default()
                }),
                "jitter",
            ),
            (
                d().backoff(Backoff {
                    jitter: f64::NAN,
                    ..Backoff::default()
                }),
                "jitter",
            ),
            (
                d().backoff(Backoff {
                    multiplier: 0.5,
                    ..Backoff::default()
                }),
                "multiplier",
            ),
            (
                d().backoff(Backoff {
                    initial: Duration::from_secs(600),
                    ..Backoff::default()
                }),
                "backoff.initial",
            ),
            (d().poll_min(Duration::ZERO), "poll_min is 0"),
            (
                d().poll_min(Duration::from_secs(2)),
                "poll_min (2s) is greater than poll_max (100ms)",
            ),
        ];
        cases.push((
            d().claim_shards(MAX_CLAIM_SHARDS + 1),
            "claim_shards is 257; it must be at most 256",
        ));
        for (config, needle) in cases {
            let msg = message_of(config);
            assert!(msg.contains(needle), "{msg:?} should mention {needle:?}");
        }
    }

    #[test]
    fn edge_values_are_accepted() {
        let c = RelayConfig::builder()
            .batch_size(1)
            .max_attempts(1)
            .concurrency(1)
            .claim_shards(1)
            .backoff(Backoff {
                jitter: 1.0,
                multiplier: 1.0,
                ..Backoff::default()
            })
            // As long as poll_max: the edge.
            .poll_min(RelayConfig::default().poll_max);
        c.build().unwrap();
    }

    #[test]
    fn claim_shards_above_concurrency_and_up_to_the_maximum_are_accepted() {
        for claim_shards in [3, MAX_CLAIM_SHARDS] {
            let c = RelayConfig::builder()
                .concurrency(2)
                .claim_shards(claim_shards);
            c.build().unwrap();
        }
    }

    #[test]
    fn getters_return_what_was_set_and_to_builder_keeps_it() {
        let c = RelayConfig::builder()
            .batch_size(7)
            .claim_shards(3)
            .group("billing".to_owned())
            .group_lease(Duration::from_secs(4))
            .head_policy(HeadPolicy::Skip)
            .build()
            .unwrap();
        assert_eq!(c.batch_size(), Some(7));
        assert_eq!(c.claim_shards(), Some(3));
        assert_eq!(c.group(), Some("billing"));
        assert_eq!(c.group_lease(), Duration::from_secs(4));
        assert_eq!(c.head_policy(), HeadPolicy::Skip);
        let derived = c.to_builder().batch_size(None).build().unwrap();
        assert_eq!(derived.batch_size(), None);
        assert_eq!(derived.group(), Some("billing"));
        assert!(RelayConfig::builder().group(String::new()).build().is_err());
    }
}
