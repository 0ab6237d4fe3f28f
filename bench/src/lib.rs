//! Pieces shared by the benchmark binaries of `outbox-bench`: the benchmark message, CPU time
//! read from `/proc`, the load average and medians, and a publisher's [`throughput`] run.

use std::collections::HashMap;
use std::time::Duration;

use outbox_traits::{Message, NewMessage};

pub mod throughput;

/// The benchmark's message number `n`: about 200 bytes of JSON, partition key
/// `customer-{n % keys}`.
pub fn message(n: usize, keys: usize) -> NewMessage {
    let key = format!("customer-{}", n % keys);
    NewMessage::new(
        "order",
        format!("order-{n}"),
        "order.placed",
        payload(n, &key),
    )
    .with_partition_key(key)
}

/// The payload of message `n` with partition key `key` (the same bytes for this project and for
/// the peers it is measured against).
pub fn payload(n: usize, key: &str) -> serde_json::Value {
    serde_json::json!({ "order": n, "customer": key, "total_cents": 1000 + n, "note": "benchmark payload of about two hundred bytes, as in the raw SQL limits table" })
}

/// Check that `published` (in publication order) holds every partition key's messages in
/// `seq` order.
///
/// # Errors
/// The first key found out of order.
pub fn check_key_order<'a>(published: impl IntoIterator<Item = &'a Message>) -> Result<(), String> {
    let mut last: HashMap<&str, i64> = HashMap::new();
    for m in published {
        if let Some(key) = &m.partition_key {
            let prev = last.insert(key, m.seq).unwrap_or(i64::MIN);
            if prev >= m.seq {
                return Err(format!("key {key} out of order"));
            }
        }
    }
    Ok(())
}

/// Enqueue messages `0..messages` (see [`message`]) into the SQLite outbox at `path`, in
/// transactions of `batch` messages. Blocking: call it from a blocking task.
///
/// # Errors
/// The store's error for a failed transaction.
pub fn sqlite_enqueue(
    path: &std::path::Path,
    config: &outbox_backend_sqlite::SqliteConfig,
    messages: usize,
    keys: usize,
    batch: usize,
) -> Result<(), outbox_traits::Error> {
    let mut conn = outbox_backend_sqlite::open_connection(path, config)?;
    for chunk in (0..messages).collect::<Vec<_>>().chunks(batch.max(1)) {
        let batch: Vec<_> = chunk.iter().map(|&n| message(n, keys)).collect();
        let tx = conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(outbox_backend_sqlite::sqlite_error)?;
        outbox_backend_sqlite::enqueue_batch(&tx, config, &batch)?;
        tx.commit().map_err(outbox_backend_sqlite::sqlite_error)?;
    }
    Ok(())
}

/// Clock ticks per second of `/proc/<pid>/stat` times (`USER_HZ`, 100 on every Linux build this
/// benchmark runs on).
const TICKS_PER_SEC: f64 = 100.0;

/// CPU seconds (user + system, of the process and of the children it reaped) by process name,
/// summed over every process of that name: one reading of `/proc`. This process is also kept
/// under the name `self`.
#[derive(Debug, Clone, Default)]
pub struct CpuReading(HashMap<String, f64>);

impl CpuReading {
    /// Read every process's `/proc/<pid>/stat`. Empty where `/proc` cannot be read.
    pub fn now() -> Self {
        let mut by_name = HashMap::new();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Self(by_name);
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            if let Some((comm, secs)) = std::fs::read_to_string(entry.path().join("stat"))
                .ok()
                .and_then(|stat| parse_stat(&stat))
            {
                *by_name.entry(comm).or_insert(0.0) += secs;
            }
        }
        if let Some((_, secs)) = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| parse_stat(&stat))
        {
            by_name.insert("self".to_owned(), secs);
        }
        Self(by_name)
    }

    /// Whether nothing could be read (no `/proc`).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Seconds used by processes named `name` since `before` (0 when none ran).
    pub fn since(&self, before: &Self, name: &str) -> f64 {
        let at = |r: &Self| r.0.get(name).copied().unwrap_or(0.0);
        (at(self) - at(before)).max(0.0)
    }
}

/// A process's name and CPU seconds (utime + stime + cutime + cstime) from its `stat` line.
pub fn parse_stat(stat: &str) -> Option<(String, f64)> {
    // The name is in parentheses and may hold spaces or parentheses: it ends at the last ')'.
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_owned();
    // After the name: state (field 3), ..., utime (14), stime (15), cutime (16), cstime (17).
    let fields: Vec<&str> = stat.get(close + 2..)?.split(' ').collect();
    let ticks = fields
        .get(11..15)?
        .iter()
        .map(|f| f.parse::<u64>().ok())
        .sum::<Option<u64>>()?;
    Some((comm, ticks as f64 / TICKS_PER_SEC))
}

/// CPU seconds of process `pid` (as [`CpuReading`] counts them), if it is running.
pub fn process_cpu(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&stat).map(|(_, secs)| secs)
}

/// The first process named `comm` whose command line contains `arg` (e.g. the broker that
/// listens on a given port, when several of its kind run).
pub fn find_process(comm: &str, arg: &str) -> Option<u32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let name = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if name.trim_end() != comm {
            continue;
        }
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(arg) {
            return Some(pid);
        }
    }
    None
}

/// The Postgres server's own background processes (WAL writer, checkpointer, background
/// writer, autovacuum): every `postgres` process that serves no client connection. Their work
/// follows from every client's writes, so a drain's share of it is only approximate on a shared
/// server.
pub fn postgres_background() -> Vec<u32> {
    const KINDS: [&str; 5] = [
        "walwriter",
        "checkpointer",
        "background writer",
        "autovacuum",
        "walsender",
    ];
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_string_lossy().parse::<u32>().ok()?;
            let comm = std::fs::read_to_string(entry.path().join("comm")).ok()?;
            if comm.trim_end() != "postgres" {
                return None;
            }
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline);
            KINDS.iter().any(|k| cmdline.contains(k)).then_some(pid)
        })
        .collect()
}

/// The machine's cores, as the share of cores used is counted.
pub fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1, |n| n.get()) as f64
}

/// Share of the machine's cores that `cpu_secs` of CPU time fill over `wall`.
pub fn core_share(cpu_secs: f64, wall: Duration) -> f64 {
    cpu_secs / (wall.as_secs_f64() * cores())
}

/// The 1-minute load average from `/proc/loadavg`, if it can be read.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The median of `values` (the mean of the middle two for an even count); `None` when empty.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len().is_multiple_of(2) {
        (v[mid - 1] + v[mid]) / 2.0
    } else {
        v[mid]
    })
}

/// `n` with thousands separators (`12,345`), as BENCHMARKS.md writes rates.
pub fn thousands(n: f64) -> String {
    let digits = format!("{:.0}", n.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// An [`OutboxStore`](outbox_traits::OutboxStore) that forwards every call to another and
/// counts the relay's claims (empty ones too) and the wall time of its claims and completions,
/// so a drain can print where its store time went.
pub struct TimedStore {
    inner: std::sync::Arc<dyn outbox_traits::OutboxStore>,
    claims: std::sync::atomic::AtomicU64,
    empty_claims: std::sync::atomic::AtomicU64,
    claim_us: std::sync::atomic::AtomicU64,
    completes: std::sync::atomic::AtomicU64,
    complete_us: std::sync::atomic::AtomicU64,
}

impl TimedStore {
    /// Wrap `inner`.
    pub fn new(inner: std::sync::Arc<dyn outbox_traits::OutboxStore>) -> Self {
        Self {
            inner,
            claims: Default::default(),
            empty_claims: Default::default(),
            claim_us: Default::default(),
            completes: Default::default(),
            complete_us: Default::default(),
        }
    }

    /// One line: claims (of them empty), mean claim and completion wall time.
    pub fn summary(&self) -> String {
        use std::sync::atomic::Ordering::Relaxed;
        let claims = self.claims.load(Relaxed);
        let completes = self.completes.load(Relaxed);
        format!(
            "{claims} claims ({} empty), {:.2} ms each; {completes} completions, {:.2} ms each",
            self.empty_claims.load(Relaxed),
            self.claim_us.load(Relaxed) as f64 / claims.max(1) as f64 / 1000.0,
            self.complete_us.load(Relaxed) as f64 / completes.max(1) as f64 / 1000.0,
        )
    }
}

fn micros_since(start: std::time::Instant) -> u64 {
    u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX)
}

#[outbox_traits::async_trait]
impl outbox_traits::OutboxStore for TimedStore {
    async fn claim(
        &self,
        req: &outbox_traits::ClaimRequest,
    ) -> Result<outbox_traits::Claim, outbox_traits::Error> {
        use std::sync::atomic::Ordering::Relaxed;
        let start = std::time::Instant::now();
        let claim = self.inner.claim(req).await;
        self.claim_us.fetch_add(micros_since(start), Relaxed);
        self.claims.fetch_add(1, Relaxed);
        if matches!(&claim, Ok(c) if c.messages.is_empty()) {
            self.empty_claims.fetch_add(1, Relaxed);
        }
        claim
    }

    async fn complete(
        &self,
        token: outbox_traits::LeaseToken,
        ids: &[outbox_traits::uuid::Uuid],
    ) -> Result<(), outbox_traits::Error> {
        use std::sync::atomic::Ordering::Relaxed;
        let start = std::time::Instant::now();
        let done = self.inner.complete(token, ids).await;
        self.complete_us.fetch_add(micros_since(start), Relaxed);
        self.completes.fetch_add(1, Relaxed);
        done
    }

    async fn fail(
        &self,
        token: outbox_traits::LeaseToken,
        failures: &[outbox_traits::Failure],
    ) -> Result<(), outbox_traits::Error> {
        self.inner.fail(token, failures).await
    }

    async fn extend(
        &self,
        token: outbox_traits::LeaseToken,
        lease: Duration,
    ) -> Result<outbox_traits::chrono::DateTime<outbox_traits::chrono::Utc>, outbox_traits::Error>
    {
        self.inner.extend(token, lease).await
    }

    async fn release(
        &self,
        token: outbox_traits::LeaseToken,
        ids: &[outbox_traits::uuid::Uuid],
    ) -> Result<(), outbox_traits::Error> {
        self.inner.release(token, ids).await
    }

    fn capabilities(&self) -> outbox_traits::Capabilities {
        self.inner.capabilities()
    }

    async fn wakeups(
        &self,
    ) -> Result<Option<Box<dyn outbox_traits::WakeSource>>, outbox_traits::Error> {
        self.inner.wakeups().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_stat_reads_name_and_ticks() -> Result<(), Box<dyn std::error::Error>> {
        let line = "42 (post gres) S 1 2 3 4 5 6 7 8 9 10 150 50 25 25 20 0";
        let (name, secs) = parse_stat(line).ok_or("unparsed")?;
        assert_eq!(name, "post gres");
        assert!((secs - 2.5).abs() < 1e-9);
        Ok(())
    }

    #[test]
    fn median_and_thousands() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        assert_eq!(thousands(1234567.4), "1,234,567");
        assert_eq!(thousands(999.0), "999");
    }
}
