//! Helpers to run private servers in tests: a free port, waiting for a server to listen, the
//! newest installed PostgreSQL, running set-up commands, and the skip-or-fail rule for a program
//! that is not installed. Used by [`crate::skewed`] and by the end-to-end tests' private
//! servers.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::env::services_required;

/// How long a server may take to accept connections before its start counts as failed.
pub const START_GUARD: Duration = Duration::from_secs(60);

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// Wait until `port` accepts connections, or fail with the server's log once `child` exits or
/// the start guard passes.
pub fn wait_port(port: u16, mut child: Option<&mut Child>, log: &Path) -> Result<(), String> {
    let start = Instant::now();
    loop {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        let exited = match child.as_mut() {
            Some(c) => c.try_wait().map_err(|e| e.to_string())?.is_some(),
            None => false,
        };
        if exited || start.elapsed() > START_GUARD {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            return Err(format!("server on port {port} did not start:\n{text}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `Ok(None)` after printing why, or an error when `OUTBOX_REQUIRE_SERVICES=1`.
pub fn missing<T>(what: &str) -> Result<Option<T>, String> {
    if services_required() {
        return Err(format!(
            "{what} is not installed but OUTBOX_REQUIRE_SERVICES=1"
        ));
    }
    eprintln!("skipped: {what} is not installed");
    Ok(None)
}

/// Run `command` to its end; an error with its output when it fails.
pub fn run(command: &mut Command) -> Result<(), String> {
    let output = command.output().map_err(|e| format!("{command:?}: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "{command:?} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(())
}

/// Whether `program --version` runs.
pub fn installed(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// The newest installed PostgreSQL's `bin` directory.
pub fn postgres_bin() -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}
