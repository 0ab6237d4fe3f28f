//! Private database servers whose clock is days away from the host's, for harnesses that declare
//! [`HarnessCapabilities::skewed_clock`](crate::HarnessCapabilities::skewed_clock), and
//! [`run_suite`] to play the whole suite against one.
//!
//! On one machine the database's `now()` and the relay's `SystemTime::now()` agree, so a store
//! that takes a lease end, a retry time or an age from the relay host's clock instead of the
//! database's passes every test there, and breaks in production as soon as the two clocks
//! differ. A server started under [libfaketime](https://github.com/wolfcw/libfaketime)
//! (`LD_PRELOAD`, `FAKETIME=`[`FAKETIME_OFFSET`]) runs its `now()` [`FAKETIME_OFFSET`] ahead
//! of the host, while the test process (the relay side) keeps the host's clock: such a bug is
//! then off by days.
//!
//! Each server runs on a free loopback port in its own temporary directory, started by the
//! test and stopped (by its own data directory or pid) when dropped; the shared servers are
//! never touched. A missing program (PostgreSQL, MariaDB or libfaketime) skips with a printed
//! reason, or fails under `OUTBOX_REQUIRE_SERVICES=1`.

pub use crate::property::reduced_cases;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use proptest::test_runner::Config;
use tempfile::TempDir;

use crate::checks::Check;
use crate::harness::Harness;
use crate::servers::{
    free_port, installed, missing, run, wait_port, PostgresCluster, PostgresSetup,
};

/// How far ahead of the host the private servers' clocks run, in libfaketime's notation.
pub const FAKETIME_OFFSET: &str = "+3d";

/// Installed libfaketime (`apt-get install libfaketime`), if any.
pub fn libfaketime() -> Option<PathBuf> {
    let lib = std::fs::read_dir("/usr/lib")
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path().join("faketime/libfaketime.so.1"))
        .find(|p| p.is_file());
    lib.or_else(|| {
        let p = PathBuf::from("/usr/lib/faketime/libfaketime.so.1");
        p.is_file().then_some(p)
    })
}

/// The whole suite, one check after the other, then the model and engine properties with
/// `config`, each against a new harness from `harness` (each runs on a runtime of its own, which
/// a harness's lazily made pools must not outlive). For a harness whose store is a private
/// server: start it once, run this from one `#[test]`, stop it. Returns the first failure's
/// report.
pub fn run_suite<H: Harness>(harness: impl Fn() -> H, config: Config) -> Result<(), String> {
    for check in Check::ALL {
        check.run_blocking(&harness())?;
    }
    crate::property::check_model(&harness(), config.clone())?;
    crate::engine::check_engine(&harness(), config)
}

/// A private PostgreSQL ([`PostgresCluster`]) whose clock runs [`FAKETIME_OFFSET`] ahead:
/// trust authentication on 127.0.0.1, user and database `postgres`.
#[derive(Debug)]
pub struct SkewedPostgres {
    cluster: PostgresCluster,
}

impl SkewedPostgres {
    /// initdb, start under libfaketime, wait until it accepts connections (about 2 s).
    pub fn start() -> Result<Option<Self>, String> {
        let Some(faketime) = libfaketime() else {
            return missing("libfaketime (apt-get install libfaketime)");
        };
        let setup = PostgresSetup {
            prefix: "outbox-pg-skewed-",
            conf: "synchronous_commit = off\nmax_connections = 60".into(),
            env: vec![
                format!("LD_PRELOAD={}", faketime.display()),
                format!("FAKETIME={FAKETIME_OFFSET}"),
            ],
            ..PostgresSetup::default()
        };
        Ok(PostgresCluster::start(setup)?.map(|cluster| Self { cluster }))
    }

    /// Its URL (user `postgres`, no password, database `postgres`).
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
            self.cluster.port()
        )
    }
}

/// A private MariaDB (`mariadb-install-db` + `mariadbd --datadir` in a temporary directory)
/// whose clock runs [`FAKETIME_OFFSET`] ahead: user `root` without a password, database `test`.
#[derive(Debug)]
pub struct SkewedMariadb {
    child: Child,
    _dir: TempDir,
    port: u16,
}

impl SkewedMariadb {
    /// Install a data directory, start `mariadbd` under libfaketime, wait until it accepts
    /// connections and create database `test` (about 3 s).
    pub fn start() -> Result<Option<Self>, String> {
        let Some(faketime) = libfaketime() else {
            return missing("libfaketime (apt-get install libfaketime)");
        };
        let mariadbd = ["/usr/sbin/mariadbd", "/usr/sbin/mysqld"]
            .into_iter()
            .find(|p| Path::new(p).is_file());
        let Some(mariadbd) = mariadbd.filter(|_| installed("mariadb-install-db")) else {
            return missing("MariaDB (mariadbd and mariadb-install-db)");
        };
        let dir = tempfile::Builder::new()
            .prefix("outbox-mariadb-skewed-")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        let data = dir.path().join("data");
        run(Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args([
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ]))?;
        let port = free_port()?;
        let socket = dir.path().join("sock");
        let log = dir.path().join("log");
        let file = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        let err_file = file.try_clone().map_err(|e| e.to_string())?;
        let child = Command::new(mariadbd)
            .env("LD_PRELOAD", &faketime)
            .env("FAKETIME", FAKETIME_OFFSET)
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--pid-file={}", dir.path().join("pid").display()))
            .arg(format!("--port={port}"))
            .args([
                "--bind-address=127.0.0.1",
                "--user=root",
                "--skip-name-resolve",
                "--innodb-buffer-pool-size=64M",
                "--innodb-log-file-size=16M",
                "--innodb-flush-log-at-trx-commit=0",
                "--max-connections=200",
            ])
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err_file)
            .spawn()
            .map_err(|e| format!("cannot start {mariadbd}: {e}"))?;
        let mut server = Self {
            child,
            _dir: dir,
            port,
        };
        wait_port(port, Some(&mut server.child), &log)?;
        run(Command::new("mariadb")
            .arg("--no-defaults")
            .arg(format!("--socket={}", socket.display()))
            .args(["-uroot", "-e", "CREATE DATABASE test"]))?;
        Ok(Some(server))
    }

    /// Its URL (user `root`, no password, database `test`).
    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/test", self.port)
    }
}

impl Drop for SkewedMariadb {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
