//! The operator's commands: status, dead letters, purge, and the progress of drain.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::Arc;
use std::time::Duration;

use outbox::{Backlog, DeadMessage, Error, GroupMember, OutboxAdmin, RelayGroupStore, StoreStatus};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::progress::Progress;
use crate::Select;

/// Dead messages read per page (and changed per statement) by the bulk commands.
const PAGE: usize = 500;

/// Print one JSON value on its own line.
pub fn print(value: &Value) {
    println!("{value}");
}

/// A duration in seconds for a table cell (`1h 2m 3s`, or `0.4s` under a second).
pub fn age(seconds: f64) -> String {
    let whole = Duration::from_secs(seconds.max(0.0) as u64);
    if whole.is_zero() {
        format!("{seconds:.1}s")
    } else {
        humantime::format_duration(whole).to_string()
    }
}

/// Shorten `text` to `max` characters for a table cell.
pub fn cell(text: &str, max: usize) -> String {
    let one_line = text.replace(['\n', '\r', '\t'], " ");
    if one_line.chars().count() <= max {
        one_line
    } else {
        let mut cut: String = one_line.chars().take(max.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}

/// Print rows as a table with a header, columns padded to their widest cell.
pub fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut out = String::new();
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                out.push_str(c);
            } else {
                out.push_str(&format!("{c:<w$}  "));
            }
        }
        println!("{}", out.trim_end());
    };
    line(header.iter().map(|h| (*h).to_owned()).collect());
    for row in rows {
        line(row.clone());
    }
}

/// `outbox-relay status`.
///
/// With `group` (`--group NAME` over a store that keeps groups), also the group's members: the
/// shards each holds and its last renewal.
pub async fn status(
    admin: &dyn OutboxAdmin,
    as_json: bool,
    keys: usize,
    group: Option<(&str, std::sync::Arc<dyn RelayGroupStore>)>,
) -> Result<(), Error> {
    let status = admin.status(keys).await?;
    let members = match &group {
        Some((name, store)) => Some(store.group_status(name).await?),
        None => None,
    };
    if as_json {
        let mut value = json!(status);
        value["relay_running"] = json!(status.published_last_minute.map(|n| n > 0));
        if let (Some((name, _)), Some(members)) = (&group, &members) {
            value["group"] = json!({"name": name, "members": members});
        }
        print(&value);
        return Ok(());
    }
    print_status(&status);
    if let (Some((name, _)), Some(members)) = (&group, &members) {
        print_group(name, members);
    }
    Ok(())
}

fn print_group(name: &str, members: &[GroupMember]) {
    println!();
    println!(
        "relay group {name}: {} live member(s)",
        members.iter().filter(|m| m.alive).count()
    );
    let rows: Vec<Vec<String>> = members
        .iter()
        .map(|m| {
            vec![
                m.member_name.clone(),
                m.member.to_string(),
                if m.alive { "live" } else { "gone" }.to_owned(),
                format!("{:?}", m.shards),
                m.renewed_at
                    .to_rfc3339_opts(outbox::chrono::SecondsFormat::Millis, true),
            ]
        })
        .collect();
    table(&["member", "id", "state", "shards", "last renewal"], &rows);
}

fn print_status(s: &StoreStatus) {
    let unknown = || "unknown".to_owned();
    let rows = vec![
        vec!["pending".to_owned(), s.pending.to_string()],
        vec!["leased".to_owned(), s.leased.to_string()],
        vec!["dead".to_owned(), s.dead.to_string()],
        vec![
            "oldest pending age".to_owned(),
            s.oldest_pending_age_seconds
                .map(age)
                .unwrap_or_else(|| "-".to_owned()),
        ],
        vec![
            "blocked keys".to_owned(),
            s.blocked_keys
                .map(|n| n.to_string())
                .unwrap_or_else(unknown),
        ],
        vec![
            "throughput (last minute)".to_owned(),
            match s.published_last_minute {
                Some(0) => "0 msg/s (no relay publishing)".to_owned(),
                Some(n) => format!("{:.1} msg/s ({n} published)", n as f64 / 60.0),
                None => unknown(),
            },
        ],
    ];
    table(&["STATE", "VALUE"], &rows);
    if !s.blocked.is_empty() {
        println!();
        let rows: Vec<Vec<String>> = s
            .blocked
            .iter()
            .map(|b| {
                vec![
                    cell(&b.partition_key, 40),
                    b.head_id.to_string(),
                    b.head_seq.to_string(),
                    b.head_state.clone(),
                    b.attempts.to_string(),
                    cell(b.last_error.as_deref().unwrap_or(""), 60),
                ]
            })
            .collect();
        table(
            &[
                "BLOCKED KEY",
                "HEAD ID",
                "SEQ",
                "STATE",
                "ATTEMPTS",
                "LAST ERROR",
            ],
            &rows,
        );
    }
}

fn matches(dead: &DeadMessage, key: Option<&str>, event_type: Option<&str>) -> bool {
    key.is_none_or(|k| dead.message.partition_key.as_deref() == Some(k))
        && event_type.is_none_or(|t| dead.message.event_type == t)
}

/// Dead messages after `after` matching the filters, at most `limit`, a page at a time.
async fn find_dead(
    admin: &dyn OutboxAdmin,
    mut after: Option<i64>,
    limit: usize,
    key: Option<&str>,
    event_type: Option<&str>,
) -> Result<Vec<DeadMessage>, Error> {
    let mut found = Vec::new();
    while found.len() < limit {
        let page = admin.list_dead(after, PAGE).await?;
        let Some(last) = page.last() else { break };
        after = Some(last.message.seq);
        let full = page.len() == PAGE;
        found.extend(
            page.into_iter()
                .filter(|d| matches(d, key, event_type))
                .take(limit - found.len()),
        );
        if !full {
            break;
        }
    }
    Ok(found)
}

fn dead_json(dead: &DeadMessage) -> Value {
    let mut line = json!(dead.message);
    // The payload is JSON text: print it as JSON, not as a quoted string.
    if let Ok(payload) = serde_json::from_str::<Value>(&dead.message.payload) {
        line["payload"] = payload;
    }
    line["last_error"] = json!(dead.last_error);
    if let Some(raw) = &dead.raw_id {
        // A quarantined row whose id is not a UUID: show what is stored.
        line["id"] = json!(raw);
    }
    line
}

/// `outbox-relay dead list`.
pub async fn dead_list(
    admin: &dyn OutboxAdmin,
    after: Option<i64>,
    limit: usize,
    key: Option<String>,
    event_type: Option<String>,
    as_json: bool,
) -> Result<(), Error> {
    let dead = find_dead(admin, after, limit, key.as_deref(), event_type.as_deref()).await?;
    if as_json {
        for d in &dead {
            print(&dead_json(d));
        }
        return Ok(());
    }
    let rows: Vec<Vec<String>> = dead
        .iter()
        .map(|d| {
            let m = &d.message;
            vec![
                m.seq.to_string(),
                match &d.raw_id {
                    Some(raw) => cell(raw, 36),
                    None => m.id.to_string(),
                },
                cell(m.partition_key.as_deref().unwrap_or("-"), 30),
                cell(&m.event_type, 30),
                m.attempts.to_string(),
                cell(&d.last_error, 60),
            ]
        })
        .collect();
    table(
        &["SEQ", "ID", "KEY", "EVENT TYPE", "ATTEMPTS", "LAST ERROR"],
        &rows,
    );
    Ok(())
}

/// What a bulk dead-letter command does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bulk {
    /// Make them pending again.
    Requeue,
    /// Delete them.
    Discard,
}

impl Bulk {
    fn verb(self) -> &'static str {
        match self {
            Bulk::Requeue => "requeue",
            Bulk::Discard => "discard",
        }
    }

    fn done(self) -> &'static str {
        match self {
            Bulk::Requeue => "requeued",
            Bulk::Discard => "discarded",
        }
    }

    async fn apply(self, admin: &dyn OutboxAdmin, ids: &[Uuid]) -> Result<u64, Error> {
        match self {
            Bulk::Requeue => admin.requeue(ids).await,
            Bulk::Discard => admin.discard(ids).await,
        }
    }

    async fn apply_seqs(self, admin: &dyn OutboxAdmin, seqs: &[i64]) -> Result<u64, Error> {
        match self {
            Bulk::Requeue => admin.requeue_seqs(seqs).await,
            Bulk::Discard => admin.discard_seqs(seqs).await,
        }
    }
}

/// Ask on the terminal; off a terminal, refuse (a script must say `--yes`).
fn confirm(question: &str) -> Result<bool, Error> {
    if !std::io::stdin().is_terminal() {
        return Err(Error::invalid_input(format!(
            "{question}: refusing to ask off a terminal; add --yes to go ahead"
        )));
    }
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut answer)
        .map_err(|e| Error::invalid_input(format!("cannot read the answer: {e}")))?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes"))
}

/// `outbox-relay dead requeue|discard`.
pub async fn dead_bulk(admin: &dyn OutboxAdmin, select: &Select, bulk: Bulk) -> Result<(), Error> {
    let filtered = select.key.is_some() || select.event_type.is_some();
    let bulk_wanted = filtered || select.all;
    let listed = !select.ids.is_empty() || !select.seqs.is_empty();
    if !listed && !bulk_wanted {
        return Err(Error::invalid_input(format!(
            "nothing to {}: give message ids, --seq SEQ, --key KEY, --event-type TYPE or --all",
            bulk.verb()
        )));
    }
    if listed && bulk_wanted {
        return Err(Error::invalid_input(
            "give either message ids/--seq or --key/--event-type/--all, not both",
        ));
    }
    if select.all && filtered {
        return Err(Error::invalid_input(
            "--all takes every dead message; drop it to filter by --key or --event-type",
        ));
    }
    if !bulk_wanted {
        let mut n = bulk.apply(admin, &select.ids).await?;
        n += bulk.apply_seqs(admin, &select.seqs).await?;
        print(&json!({ bulk.done(): n }));
        return Ok(());
    }
    let found = find_dead(
        admin,
        None,
        usize::MAX,
        select.key.as_deref(),
        select.event_type.as_deref(),
    )
    .await?;
    // By seq: quarantined rows, whose id is not a UUID, are taken too.
    let seqs: Vec<i64> = found.iter().map(|d| d.message.seq).collect();
    if !seqs.is_empty() && !select.yes {
        let question = format!("{} {} dead message(s)?", bulk.verb(), seqs.len());
        if !confirm(&question)? {
            return Err(Error::invalid_input(format!("{} cancelled", bulk.verb())));
        }
    }
    let mut progress = Progress::new(bulk.done(), Some(seqs.len() as u64));
    let mut n = 0;
    // A requeue refuses its whole call (nothing requeued) when one of its rows still cannot
    // be relayed (a quarantined row not fixed since): that chunk is then taken a row at a
    // time, so every other row is requeued and each refusal is told.
    let mut refused = Vec::new();
    for chunk in seqs.chunks(PAGE) {
        match bulk.apply_seqs(admin, chunk).await {
            Ok(k) => n += k,
            Err(Error::InvalidInput(_)) if bulk == Bulk::Requeue => {
                for seq in chunk {
                    match bulk.apply_seqs(admin, std::slice::from_ref(seq)).await {
                        Ok(k) => n += k,
                        Err(Error::InvalidInput(why)) => refused.push(why),
                        Err(e) => return Err(e),
                    }
                }
            }
            Err(e) => return Err(e),
        }
        progress.set(n);
    }
    progress.finish();
    if refused.is_empty() {
        print(&json!({ bulk.done(): n }));
        return Ok(());
    }
    print(&json!({ bulk.done(): n, "refused": refused.len() }));
    Err(Error::invalid_input(format!(
        "{} dead message(s) still cannot be relayed and were left dead: {}",
        refused.len(),
        refused.join(" | ")
    )))
}

/// Delete published messages older than `age`, `batch` per statement, until none is left.
pub async fn purge_all(
    admin: &dyn OutboxAdmin,
    age: Duration,
    batch: usize,
    mut progress: Option<&mut Progress>,
) -> Result<u64, Error> {
    let mut purged = 0;
    loop {
        let n = admin.purge_published(age, batch).await?;
        purged += n;
        if let Some(p) = progress.as_deref_mut() {
            p.set(purged);
        }
        if n < u64::try_from(batch).unwrap_or(u64::MAX) {
            return Ok(purged);
        }
    }
}

/// Count in `stats.dead` the rows the store dead-lettered during the run without the relay:
/// a claim dead-letters a row that does not decode (see `outbox_sql_support::quarantine`) and
/// hands out the rest, so the relay never counts it. `start` is the store's backlog read before the relay
/// started; `dead` becomes the larger of the relay's own count and the growth of the store's
/// dead count (which also moves with other relays' dead letters and operators' requeues and
/// discards meanwhile). Best effort: if the backlog cannot be read, the relay's count stays.
pub async fn count_quarantined(
    admin: &dyn OutboxAdmin,
    start: &Backlog,
    stats: &mut outbox::relay::RelayStats,
) {
    if let Ok(end) = admin.backlog().await {
        stats.dead = stats.dead.max(end.dead.saturating_sub(start.dead));
    }
}

/// The progress of `drain`: how much of the backlog `total` (read before the relay started, so a
/// fast drain cannot empty it first) is gone, read from the store's backlog query
/// ([`OutboxAdmin::backlog`], cheaper than its status) until `finished`.
pub async fn drain_progress(
    admin: Arc<dyn OutboxAdmin>,
    total: u64,
    mut finished: tokio::sync::oneshot::Receiver<()>,
) {
    let mut progress = Progress::new("drained", Some(total));
    // Each update is a backlog query: once a second for a bar, once per summary line otherwise.
    // The first one is an interval after the start, not at once: `total` was just read, and the
    // query counts every unfinished row (on SQLite it also holds the store's one connection, so
    // the relay's first claims would wait for it; issue 31).
    let every = progress.update_every();
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = &mut finished => break,
            _ = tick.tick() => {}
        }
        if let Ok(now) = admin.backlog().await {
            progress.set(total.saturating_sub(now.unfinished));
        }
    }
    if let Ok(now) = admin.backlog().await {
        progress.set(total.saturating_sub(now.unfinished));
    }
    progress.finish();
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use outbox::Counts;

    use super::*;

    /// An admin over an empty outbox that counts its status and backlog queries.
    #[derive(Default)]
    struct CountingAdmin {
        statuses: AtomicUsize,
        backlogs: AtomicUsize,
    }

    #[outbox::async_trait]
    impl OutboxAdmin for CountingAdmin {
        async fn list_dead(&self, _: Option<i64>, _: usize) -> Result<Vec<DeadMessage>, Error> {
            Ok(vec![])
        }
        async fn requeue(&self, _: &[Uuid]) -> Result<u64, Error> {
            Ok(0)
        }
        async fn discard(&self, _: &[Uuid]) -> Result<u64, Error> {
            Ok(0)
        }
        async fn purge_published(&self, _: Duration, _: usize) -> Result<u64, Error> {
            Ok(0)
        }
        async fn counts(&self) -> Result<Counts, Error> {
            Ok(Counts::default())
        }
        async fn status(&self, _: usize) -> Result<StoreStatus, Error> {
            self.statuses.fetch_add(1, Ordering::SeqCst);
            Ok(StoreStatus::default())
        }
        async fn backlog(&self) -> Result<Backlog, Error> {
            self.backlogs.fetch_add(1, Ordering::SeqCst);
            Ok(Backlog::default())
        }
    }

    /// The drain's progress does not query the backlog again as it starts (it was just read;
    /// on SQLite the query would hold the relay's connection over its first claims): a drain
    /// that ends before the first update reads the backlog once, for the closing line, and
    /// never the whole status.
    #[tokio::test(flavor = "current_thread")]
    async fn drain_progress_reads_no_backlog_at_start() {
        let admin = Arc::new(CountingAdmin::default());
        let (done, finished) = tokio::sync::oneshot::channel();
        let watch = tokio::spawn(drain_progress(admin.clone(), 10, finished));
        // Let the progress task start and its timer fire anything due at once; far below the
        // first update's interval (5 s off a terminal).
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(admin.backlogs.load(Ordering::SeqCst), 0);
        let _ = done.send(());
        watch.await.expect("progress task");
        assert_eq!(admin.backlogs.load(Ordering::SeqCst), 1);
        assert_eq!(admin.statuses.load(Ordering::SeqCst), 0);
    }
}
