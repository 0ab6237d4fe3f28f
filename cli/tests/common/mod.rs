//! What the `outbox-relay` tests share.

use std::ffi::OsStr;
use std::process::{Output, Stdio};
use std::time::Duration;

use futures::StreamExt;
use outbox::NewMessage;
use serde_json::Value;
use tokio::process::{Child, Command};

pub mod fleet;
pub mod many;

/// Errors of test code: any error is a failure report.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The program under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// Failure guard for a child process or an event a test waits for; a passing test never gets
/// near it.
pub const GUARD: Duration = Duration::from_secs(60);

/// The `n`th message, keyed by one of `keys` customers; its payload has escapes and non-ASCII
/// text, so that a relay that re-encodes it would be caught.
#[allow(dead_code)]
pub fn message(n: usize, keys: usize) -> NewMessage {
    NewMessage::new(
        "order",
        format!("order-{n}"),
        "order.placed",
        serde_json::json!({"n": n, "note": "grüße \"quoted\" \\ back"}),
    )
    .with_partition_key(format!("customer-{}", n % keys))
}

/// The messages of `committed` as the broker must deliver them: with their key, and their
/// payload as `stored` (by id) holds it.
#[allow(dead_code)]
pub fn expected(
    committed: &[NewMessage],
    stored: &std::collections::HashMap<String, String>,
) -> Vec<outbox_e2e::Expected> {
    committed
        .iter()
        .map(|m| outbox_e2e::Expected {
            id: m.id.to_string(),
            key: m.partition_key.clone(),
            payload: stored
                .get(&m.id.to_string())
                .map(|p| p.as_bytes().to_vec())
                .unwrap_or_default(),
        })
        .collect()
}

/// The ids of the messages a `stdout://` relay printed, in order.
#[allow(dead_code)]
pub fn stdout_ids(stdout: &[u8]) -> Result<Vec<uuid::Uuid>, BoxError> {
    std::str::from_utf8(stdout)?
        .lines()
        .map(|line| {
            let message: Value = serde_json::from_str(line)?;
            Ok(serde_json::from_value(message["id"].clone())?)
        })
        .collect()
}

/// Ask a running relay to stop, as a service manager does (SIGTERM).
// Each test binary compiles this module; not every one uses every helper.
#[allow(dead_code)]
pub async fn sigterm(relay: &Child) -> Result<(), BoxError> {
    signal(relay, "TERM").await
}

/// Send the signal `name` (as `kill` spells it: `TERM`, `INT`, `KILL`...) to a running relay.
#[allow(dead_code)]
pub async fn signal(relay: &Child, name: &str) -> Result<(), BoxError> {
    let pid = relay.id().ok_or("the relay already exited")?;
    let status = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .await?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill -{name} {pid}: {status}").into())
    }
}

/// A core subscription to `subject` on the NATS server at `url`, in place on the server when
/// this returns. `subscribe` returns once the SUB is queued; the flush's PING is answered only
/// after the server has taken it. Without the flush a relay (another connection) can publish
/// its first messages before the server knows the subscription, and a test waits for
/// deliveries that already happened.
// Each test binary compiles this module; not every one uses every helper.
#[allow(dead_code)]
pub async fn nats_subscription(
    url: &str,
    subject: String,
) -> Result<async_nats::Subscriber, BoxError> {
    let client = async_nats::connect(url).await?;
    let sub = client.subscribe(subject).await?;
    client.flush().await?;
    Ok(sub)
}

/// The `Nats-Msg-Id` header values (the outbox message ids) of the next `n` messages on `sub`,
/// in arrival order. Fails on a message without one, when the subscription ends, or when the
/// `n` have not all arrived within [`GUARD`]. A republished copy counts as a message of its own.
// Each test binary compiles this module; not every one uses every helper.
#[allow(dead_code)]
pub async fn nats_msg_ids(
    sub: &mut async_nats::Subscriber,
    n: usize,
) -> Result<Vec<String>, BoxError> {
    let deadline = tokio::time::Instant::now() + GUARD;
    let mut ids = Vec::with_capacity(n);
    while ids.len() < n {
        let next = tokio::time::timeout_at(deadline, sub.next())
            .await
            .map_err(|_| format!("{} of {n} messages arrived within {GUARD:?}", ids.len()))?;
        let msg = next.ok_or("the subscription ended")?;
        let id = msg
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .ok_or_else(|| format!("a message on {} has no Nats-Msg-Id", msg.subject))?;
        ids.push(id.as_str().to_owned());
    }
    Ok(ids)
}

/// A long-running `outbox-relay` with `args`: info logs, both outputs piped, killed if the test
/// drops it.
pub fn relay_process<I, S>(args: I) -> Result<Child, BoxError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    Ok(Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?)
}

/// End every session of MariaDB account `user` with `KILL CONNECTION`, and return their ids
/// once the process list shows none of them. A killed session stays listed while it rolls back,
/// so once it is gone its open transaction is undone and its locks are free; a COMMIT it had
/// already run is done. Polls the process list (a query loop, no clock wait) until [`GUARD`].
// Each test binary compiles this module; not every one uses every helper.
#[allow(dead_code)]
pub async fn end_mysql_sessions(pool: &sqlx::MySqlPool, user: &str) -> Result<Vec<i64>, BoxError> {
    let deadline = tokio::time::Instant::now() + GUARD;
    let mut killed = std::collections::HashSet::new();
    loop {
        let ids: Vec<i64> =
            sqlx::query_scalar("SELECT ID FROM information_schema.PROCESSLIST WHERE USER = ?")
                .bind(user)
                .fetch_all(pool)
                .await?;
        if ids.is_empty() {
            return Ok(killed.into_iter().collect());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!("sessions {ids:?} of {user} still listed after {GUARD:?}").into());
        }
        for id in ids {
            if !killed.insert(id) {
                continue;
            }
            match sqlx::query(&format!("KILL CONNECTION {id}"))
                .execute(pool)
                .await
            {
                Ok(_) => {}
                // It ended between the listing and the kill (ER_NO_SUCH_THREAD).
                Err(sqlx::Error::Database(e))
                    if e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                        .is_some_and(|e| e.number() == 1094) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// `outbox-relay` with `args`, without the store and broker settings of the environment.
#[allow(dead_code)]
pub fn command<I, S>(args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env_remove("OUTBOX_STORE_URL")
        .env_remove("OUTBOX_BROKER_URL")
        .stdin(Stdio::null());
    command
}

/// Run `command` to the end.
#[allow(dead_code)]
pub async fn output(mut command: Command) -> Result<Output, BoxError> {
    Ok(tokio::time::timeout(GUARD, command.output()).await??)
}

/// Run `outbox-relay` with `args` to the end.
#[allow(dead_code)]
pub async fn run(args: &[&str]) -> Result<Output, BoxError> {
    output(command(args)).await
}

/// Run `outbox-relay` with `args`, expect success, return its standard output's JSON lines.
#[allow(dead_code)]
pub async fn json_lines<I, S>(args: I) -> Result<Vec<Value>, BoxError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    json_output(command(args)).await
}

/// Run `command`, expect success, return its standard output's JSON lines.
#[allow(dead_code)]
pub async fn json_output(command: Command) -> Result<Vec<Value>, BoxError> {
    let shown = format!("{:?}", command.as_std());
    let out = output(command).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("{shown} failed ({}): {stderr}", out.status).into());
    }
    let stdout = String::from_utf8(out.stdout)?;
    Ok(stdout
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?)
}
