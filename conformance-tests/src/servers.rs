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

/// A free TCP port on 127.0.0.1, never one this process was given before.
///
/// The port is free when it is picked, but the listener that found it closes at once, so the
/// next pick may find the same port before the server meant for the first one binds it. A test
/// that starts a cluster picks a dozen ports in a row, and two such tests may start side by
/// side: a repeated port makes one node fail to bind, and the cluster never forms. So each port
/// is handed out once per process. (Another process may still take it: the server's start then
/// fails with its log, see [`wait_port`].)
pub fn free_port() -> Result<u16, String> {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    for _ in 0..100 {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| format!("no free port: {e}"))?;
        if given.insert(port) {
            return Ok(port);
        }
    }
    Err("no free port: 100 picks in a row returned ports this process was already given".into())
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

/// How [`PostgresCluster::start`] sets a private PostgreSQL up; the default is a cluster with
/// `trust` authentication and nothing else.
#[derive(Debug, Clone, Default)]
pub struct PostgresSetup {
    /// Prefix of the temporary directory's name (`outbox-pg-` when empty).
    pub prefix: &'static str,
    /// The password of user `postgres`, given to `initdb` (then `--auth-local=trust
    /// --auth-host=scram-sha-256`); `None`: `--auth=trust`.
    pub password: Option<String>,
    /// Files written into the data directory after `initdb` (name, content), owned by user
    /// `postgres`, mode 600, e.g. TLS certificates that the `conf` lines name relatively.
    pub files: Vec<(&'static str, Vec<u8>)>,
    /// Lines added to `postgresql.conf`, after the port, `listen_addresses = '127.0.0.1'`, the
    /// socket directory and `fsync = off`.
    pub conf: String,
    /// The whole `pg_hba.conf`, replacing `initdb`'s.
    pub hba: Option<String>,
    /// `NAME=value` pairs in the server's environment (e.g. `LD_PRELOAD` and `FAKETIME`).
    pub env: Vec<String>,
}

/// A private PostgreSQL cluster (`initdb` + `pg_ctl` under `runuser -u postgres`) in a temporary
/// directory, on a free port of 127.0.0.1, with user and database `postgres`: the one bootstrap
/// of the suite's skewed-clock server and the end-to-end tests' TLS and outage servers. Stopped
/// (`pg_ctl stop -m immediate`) when dropped.
#[derive(Debug)]
pub struct PostgresCluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    env: Vec<String>,
}

impl PostgresCluster {
    /// `initdb` as `setup` says, start, and wait until it accepts connections (about 2 s).
    /// `Ok(None)` (printed) when PostgreSQL is not installed, unless `OUTBOX_REQUIRE_SERVICES=1`.
    pub fn start(setup: PostgresSetup) -> Result<Option<Self>, String> {
        let Some(bin) = postgres_bin() else {
            return missing("PostgreSQL (/usr/lib/postgresql/*/bin/initdb)");
        };
        let prefix = if setup.prefix.is_empty() {
            "outbox-pg-"
        } else {
            setup.prefix
        };
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        let data = dir.path().join("data");
        let mut initdb = Command::new("runuser");
        initdb
            .args(["-u", "postgres", "--"])
            .arg(bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-E", "UTF8", "--no-sync"]);
        match &setup.password {
            Some(password) => {
                let pwfile = dir.path().join("pw");
                std::fs::write(&pwfile, password).map_err(|e| format!("password file: {e}"))?;
                initdb
                    .args(["--auth-local=trust", "--auth-host=scram-sha-256"])
                    .arg(format!("--pwfile={}", pwfile.display()));
            }
            None => {
                initdb.arg("--auth=trust");
            }
        }
        run(Command::new("chown")
            .arg("-R")
            .arg("postgres:")
            .arg(dir.path()))?;
        run(&mut initdb)?;
        let io = |what: &str, e: std::io::Error| format!("{what}: {e}");
        for (name, content) in &setup.files {
            let path = data.join(name);
            std::fs::write(&path, content).map_err(|e| io(name, e))?;
            run(Command::new("chown").arg("postgres:").arg(&path))?;
            run(Command::new("chmod").arg("600").arg(&path))?;
        }
        let port = free_port()?;
        let conf_path = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf_path).map_err(|e| io("postgresql.conf", e))?;
        text.push_str(&format!(
            "\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             fsync = off\n{}\n",
            dir.path().display(),
            setup.conf
        ));
        std::fs::write(&conf_path, text).map_err(|e| io("postgresql.conf", e))?;
        if let Some(hba) = &setup.hba {
            std::fs::write(data.join("pg_hba.conf"), hba).map_err(|e| io("pg_hba.conf", e))?;
        }
        let cluster = Self {
            dir,
            bin,
            port,
            env: setup.env,
        };
        cluster.resume()?;
        Ok(Some(cluster))
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Shut it down at once (`pg_ctl stop -m immediate`): connections drop as in a crash.
    pub fn stop(&self) -> Result<(), String> {
        self.pg_ctl("stop")
    }

    /// Start it (again, after [`stop`](Self::stop)) and wait until it accepts connections.
    pub fn resume(&self) -> Result<(), String> {
        self.pg_ctl("start")?;
        wait_port(self.port, None, &self.dir.path().join("log"))
    }

    /// Run `sql` as user `postgres` in database `postgres`, over the local socket (which
    /// trusts), e.g. to create a role.
    pub fn psql(&self, sql: &str) -> Result<(), String> {
        run(Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.bin.join("psql"))
            .arg("-h")
            .arg(self.dir.path())
            .args(["-p", &self.port.to_string(), "-U", "postgres"])
            .args(["-d", "postgres", "-q", "-c", sql]))
    }

    /// `pg_ctl start` (waiting up to 60 s, with the set-up's environment) or `pg_ctl stop -m
    /// immediate`, as user `postgres`, logging to the directory's `log`.
    fn pg_ctl(&self, action: &str) -> Result<(), String> {
        let mut command = Command::new("runuser");
        // `env` inside runuser: runuser resets the environment; the postmaster and every
        // backend it forks inherit these.
        command
            .args(["-u", "postgres", "--", "env"])
            .args(&self.env)
            .arg(self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .arg("-l")
            .arg(self.dir.path().join("log"))
            .args(["-w", "-t", "60"]);
        if action == "stop" {
            command.args(["-m", "immediate"]);
        }
        run(command.arg(action))
    }
}

impl Drop for PostgresCluster {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
