//! What the `outbox-relay` tests share.

use std::ffi::OsStr;
use std::process::Stdio;
use std::time::Duration;

use outbox::NewMessage;
use tokio::process::{Child, Command};

/// Errors of test code: any error is a failure report.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The program under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// Failure guard for a child process or an event a test waits for; a passing test never gets
/// near it.
pub const GUARD: Duration = Duration::from_secs(60);

/// The `n`th message, keyed by one of `keys` customers; its payload has escapes and non-ASCII
/// text, so that a relay that re-encodes it would be caught.
pub fn message(n: usize, keys: usize) -> NewMessage {
    NewMessage::new(
        "order",
        format!("order-{n}"),
        "order.placed",
        serde_json::json!({"n": n, "note": "grüße \"quoted\" \\ back"}),
    )
    .with_partition_key(format!("customer-{}", n % keys))
}

/// Ask a running relay to stop, as a service manager does (SIGTERM).
pub async fn sigterm(relay: &Child) -> Result<(), BoxError> {
    let pid = relay.id().ok_or("the relay already exited")?;
    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill -TERM {pid}: {status}").into())
    }
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
