//! Private servers for tests that need a server of their own: TLS-only, with passwords, or to be
//! stopped (outage tests). Each one runs on a free loopback port, in a temporary directory,
//! started by the test and stopped (by its own pid or data directory) when dropped; the shared
//! servers are never touched.
//!
//! [`Pki`] makes a CA, a server certificate for [`TLS_HOST`], a client certificate and a second,
//! unrelated CA (for "wrong CA" checks) with `rcgen`.
//!
//! | server | how | TLS | credentials |
//! |---|---|---|---|
//! | [`PrivatePostgres`] | `initdb` + `pg_ctl` under `runuser -u postgres` | `ssl=on`, `hostssl`-only `pg_hba.conf` | `postgres` with a password (scram-sha-256) |
//! | [`PrivateMariadb`] | `mariadb-install-db` + `mariadbd` | `require_secure_transport=ON` | `app` with a password |
//! | [`PrivateRedis`] | `redis-server --port 0 --tls-port N` | TLS only; client certificate optional or required | `requirepass` |
//! | [`PrivateKafkaTls`] | a private Tansu behind a TLS front in the test process (Tansu 0.6 cannot serve TLS) | TLS only, verified by librdkafka | none (Tansu cannot create SASL users in memory storage) |
//! | [`PrivateNats`] | `nats-server -c conf` with JetStream | optional `tls {}` block with `verify: true` | user/password, token, NKey or operator JWTs (`.creds`) |
//! | [`PlainPostgres`] | `initdb` + `pg_ctl`, stopped and resumed by outage tests | no | `trust` |
//! | [`PlainNats`] | `nats-server -js`, killed and resumed by outage tests | no | none |
//! | [`PlainRedis`] | `redis-server --port N`, killed and resumed (empty) by outage tests | no | none |
//! | [`PlainKafka`] | Tansu with memory storage, killed and resumed (empty) by outage tests | no | none |
//!
//! A server whose program is not installed gives `Ok(None)` after printing why the test skips,
//! or fails when `OUTBOX_REQUIRE_SERVICES=1`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tempfile::TempDir;

use crate::BoxError;
/// A free loopback port (free when this returns; the server binds it right after).
pub use outbox_conformance_tests::servers::free_port;
use outbox_conformance_tests::servers::{
    installed, missing, run, wait_port, PostgresCluster, PostgresSetup,
};

/// The host name the server certificates list; it resolves to 127.0.0.1.
pub const TLS_HOST: &str = "localhost";
/// The same server by an address its certificate does not list (for "wrong host name" checks).
pub const WRONG_HOST: &str = "127.0.0.1";

/// Certificates of one test, as PEM files in a temporary directory.
#[derive(Debug)]
pub struct Pki {
    _dir: TempDir,
    /// The CA that signed the server and client certificates.
    pub ca: PathBuf,
    /// A CA that signed nothing here: trusting only it must fail.
    pub other_ca: PathBuf,
    /// The server certificate, for [`TLS_HOST`] only.
    pub server_cert: PathBuf,
    /// The server certificate's key.
    pub server_key: PathBuf,
    /// A client certificate (common name `app`).
    pub client_cert: PathBuf,
    /// The client certificate's key.
    pub client_key: PathBuf,
}

fn ca_params(name: &str) -> Result<CertificateParams, BoxError> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(params)
}

impl Pki {
    /// A fresh CA with a server and a client certificate, and an unrelated CA.
    pub fn new() -> Result<Self, BoxError> {
        let dir = tempfile::Builder::new().prefix("outbox-pki-").tempdir()?;
        let write = |name: &str, text: String| -> Result<PathBuf, BoxError> {
            let path = dir.path().join(name);
            std::fs::write(&path, text)?;
            Ok(path)
        };
        let ca_key = KeyPair::generate()?;
        let params = ca_params("outbox test CA")?;
        let ca_cert = params.self_signed(&ca_key)?;
        let issuer = Issuer::new(params, ca_key);

        let server_key = KeyPair::generate()?;
        let mut server = CertificateParams::new(vec![TLS_HOST.to_owned()])?;
        server.distinguished_name.push(DnType::CommonName, TLS_HOST);
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_cert = server.signed_by(&server_key, &issuer)?;

        let client_key = KeyPair::generate()?;
        let mut client = CertificateParams::new(Vec::<String>::new())?;
        client.distinguished_name.push(DnType::CommonName, "app");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_cert = client.signed_by(&client_key, &issuer)?;

        let other_key = KeyPair::generate()?;
        let other_ca = ca_params("unrelated CA")?.self_signed(&other_key)?;

        Ok(Self {
            ca: write("ca.pem", ca_cert.pem())?,
            other_ca: write("other-ca.pem", other_ca.pem())?,
            server_cert: write("server.pem", server_cert.pem())?,
            server_key: write("server.key", server_key.serialize_pem())?,
            client_cert: write("client.pem", client_cert.pem())?,
            client_key: write("client.key", client_key.serialize_pem())?,
            _dir: dir,
        })
    }
}

/// A random secret for a private server (a password, a token).
pub fn secret() -> String {
    format!("pw-{}", uuid::Uuid::new_v4().simple())
}

/// A private PostgreSQL ([`PostgresCluster`]) that accepts only TLS connections (`hostssl` lines
/// only): user `postgres` with a password, user `app` with [`Pki::client_cert`] (`cert`
/// authentication); database `postgres`.
#[derive(Debug)]
pub struct PrivatePostgres {
    _cluster: PostgresCluster,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// The password of user `postgres`.
    pub password: String,
}

impl PrivatePostgres {
    /// initdb, configure TLS with `pki`'s server certificate (and its CA for client
    /// certificates), start and wait until it accepts connections. Takes about 2 s.
    pub fn start(pki: &Pki) -> Result<Option<Self>, BoxError> {
        let password = secret();
        let setup = PostgresSetup {
            password: Some(password.clone()),
            files: vec![
                ("server.pem", std::fs::read(&pki.server_cert)?),
                ("server.key", std::fs::read(&pki.server_key)?),
                ("ca.pem", std::fs::read(&pki.ca)?),
            ],
            // Relative to the data directory, where `files` are.
            conf: "ssl = on\nssl_cert_file = 'server.pem'\nssl_key_file = 'server.key'\n\
                   ssl_ca_file = 'ca.pem'\nmax_connections = 40"
                .into(),
            // TCP only over TLS: user `app` by client certificate, the others by password; the
            // socket (for set-up) trusts.
            hba: Some(
                "local all all trust\nhostssl all app 127.0.0.1/32 cert\n\
                 hostssl all all 127.0.0.1/32 scram-sha-256\n"
                    .into(),
            ),
            ..PostgresSetup::default()
        };
        let Some(cluster) = PostgresCluster::start(setup)? else {
            return Ok(None);
        };
        cluster.psql("CREATE ROLE app LOGIN SUPERUSER")?;
        Ok(Some(Self {
            port: cluster.port(),
            _cluster: cluster,
            password,
        }))
    }

    /// A URL for `host` with the given query (e.g. `sslmode=verify-full&sslrootcert=...`) and
    /// the password.
    pub fn url(&self, host: &str, query: &str) -> String {
        format!(
            "postgres://postgres:{}@{host}:{}/postgres?{query}",
            self.password, self.port
        )
    }
}

/// A private PostgreSQL ([`PostgresCluster`]) with `trust` authentication on 127.0.0.1 (user and
/// database `postgres`), for outage tests: [`stop`](Self::stop) shuts it down at once (as a
/// crash would) and [`resume`](Self::resume) starts it again on the same port and data.
/// Stopped when dropped.
#[derive(Debug)]
pub struct PlainPostgres {
    cluster: PostgresCluster,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl PlainPostgres {
    /// initdb, start and wait until it accepts connections. Takes about 2 s.
    pub fn start() -> Result<Option<Self>, BoxError> {
        let setup = PostgresSetup {
            conf: "max_connections = 40".into(),
            ..PostgresSetup::default()
        };
        Ok(PostgresCluster::start(setup)?.map(|cluster| Self {
            port: cluster.port(),
            cluster,
        }))
    }

    /// Shut it down at once (`pg_ctl stop -m immediate`): connections drop as in a crash.
    pub fn stop(&self) -> Result<(), BoxError> {
        Ok(self.cluster.stop()?)
    }

    /// Start it again after [`stop`](Self::stop) and wait until it accepts connections.
    pub fn resume(&self) -> Result<(), BoxError> {
        Ok(self.cluster.resume()?)
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

/// A child process killed (by its pid) and reaped when dropped.
#[derive(Debug)]
struct Owned(Child);

impl Drop for Owned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(command: &mut Command, log: &Path) -> Result<Owned, BoxError> {
    let file = std::fs::File::create(log)?;
    Ok(Owned(
        command
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()?,
    ))
}

/// A private MariaDB with `require_secure_transport=ON`: user `app` with a password, user
/// `certuser` with a client certificate signed by the [`Pki`]'s CA (`REQUIRE X509`); database
/// `test`.
#[derive(Debug)]
pub struct PrivateMariadb {
    child: Owned,
    _dir: TempDir,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// The password of user `app`.
    pub password: String,
}

impl PrivateMariadb {
    /// `mariadb-install-db`, start `mariadbd` with `pki`'s server certificate and wait until it
    /// accepts connections; then create the user over the socket (which needs no TLS).
    pub fn start(pki: &Pki) -> Result<Option<Self>, BoxError> {
        let mariadbd = ["/usr/sbin/mariadbd", "/usr/sbin/mysqld"]
            .into_iter()
            .find(|p| Path::new(p).is_file());
        let Some(mariadbd) = mariadbd.filter(|_| installed("mariadb-install-db")) else {
            return Ok(missing("MariaDB (mariadbd and mariadb-install-db)")?);
        };
        let dir = tempfile::Builder::new()
            .prefix("outbox-mariadb-")
            .tempdir()?;
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
        let child = spawn(
            Command::new(mariadbd)
                .arg("--no-defaults")
                .arg(format!("--datadir={}", data.display()))
                .arg(format!("--socket={}", socket.display()))
                .arg(format!("--pid-file={}", dir.path().join("pid").display()))
                .arg(format!("--port={port}"))
                .args([
                    "--bind-address=127.0.0.1",
                    "--user=root",
                    "--skip-name-resolve",
                ])
                .args(["--innodb-buffer-pool-size=32M", "--innodb-log-file-size=8M"])
                .arg(format!("--ssl-cert={}", pki.server_cert.display()))
                .arg(format!("--ssl-key={}", pki.server_key.display()))
                .arg(format!("--ssl-ca={}", pki.ca.display()))
                .arg("--require-secure-transport=ON"),
            &log,
        )?;
        let mut server = Self {
            child,
            _dir: dir,
            port,
            password: secret(),
        };
        wait_port(port, Some(&mut server.child.0), &log)?;
        run(Command::new("mariadb")
            .arg("--no-defaults")
            .arg(format!("--socket={}", socket.display()))
            .args(["-uroot", "-e"])
            .arg(format!(
                "CREATE USER 'app'@'%' IDENTIFIED BY '{}'; GRANT ALL ON *.* TO 'app'@'%'; \
                 CREATE USER 'certuser'@'%' REQUIRE X509; GRANT ALL ON *.* TO 'certuser'@'%'; \
                 CREATE DATABASE test;",
                server.password
            )))?;
        Ok(Some(server))
    }

    /// A URL for `host` with the given query (e.g. `ssl-mode=VERIFY_IDENTITY&ssl-ca=...`).
    pub fn url(&self, host: &str, query: &str) -> String {
        format!(
            "mysql://app:{}@{host}:{}/test?{query}",
            self.password, self.port
        )
    }
}

/// A private `redis-server` that serves only TLS, with a password for the default user and
/// for the ACL user `app`.
#[derive(Debug)]
pub struct PrivateRedis {
    _child: Owned,
    _dir: TempDir,
    /// Its TLS port on 127.0.0.1.
    pub port: u16,
    /// The `requirepass` password, also user `app`'s.
    pub password: String,
}

impl PrivateRedis {
    /// Start it with `pki`'s server certificate; `client_certs` makes it require client
    /// certificates signed by `pki`'s CA (`tls-auth-clients yes`).
    pub fn start(pki: &Pki, client_certs: bool) -> Result<Option<Self>, BoxError> {
        if !installed("redis-server") {
            return Ok(missing("redis-server")?);
        }
        let dir = tempfile::Builder::new().prefix("outbox-redis-").tempdir()?;
        let port = free_port()?;
        let password = secret();
        let log = dir.path().join("log");
        let mut child = spawn(
            Command::new("redis-server")
                .args(["--port", "0", "--tls-port"])
                .arg(port.to_string())
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(dir.path())
                .arg("--tls-cert-file")
                .arg(&pki.server_cert)
                .arg("--tls-key-file")
                .arg(&pki.server_key)
                .arg("--tls-ca-cert-file")
                .arg(&pki.ca)
                .args([
                    "--tls-auth-clients",
                    if client_certs { "yes" } else { "no" },
                ])
                .arg("--requirepass")
                .arg(&password)
                .args(["--user", "app", "on"])
                .arg(format!(">{password}"))
                .args(["~*", "&*", "+@all"]),
            &log,
        )?;
        wait_port(port, Some(&mut child.0), &log)?;
        Ok(Some(Self {
            _child: child,
            _dir: dir,
            port,
            password,
        }))
    }
}

/// How a [`PrivateNats`] authenticates clients.
#[derive(Debug, Clone)]
pub enum NatsServerAuth {
    /// User `app` with this password.
    UserPassword(String),
    /// This token.
    Token(String),
    /// The NKey user with this public key (`U...`).
    Nkey(String),
    /// Decentralized JWT auth ([`nats_operator`]): the operator's JWT, and the accounts'
    /// public keys and JWTs, preloaded into a memory resolver.
    Operator {
        /// The operator's JWT.
        operator_jwt: String,
        /// The system account's public key (`A...`), which JetStream needs.
        system_account: String,
        /// Each account's public key and JWT.
        accounts: Vec<(String, String)>,
    },
}

/// A signed NATS JWT (`ed25519-nkey`) with `claims`, issued by `issuer`.
fn nats_jwt(issuer: &nkeys::KeyPair, claims: serde_json::Value) -> Result<String, BoxError> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header = b64.encode(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let body = b64.encode(serde_json::to_vec(&claims)?);
    let signed = format!("{header}.{body}");
    let signature = b64.encode(issuer.sign(signed.as_bytes())?);
    Ok(format!("{signed}.{signature}"))
}

/// A fresh operator, account (with JetStream) and user: the server side, and the user's
/// `.creds` file content (JWT and seed), as `nsc` would make them.
pub fn nats_operator() -> Result<(NatsServerAuth, String), BoxError> {
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let system = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let claims = |iss: &nkeys::KeyPair, sub: &nkeys::KeyPair, name: &str, nats| {
        serde_json::json!({
            "jti": uuid::Uuid::new_v4().simple().to_string().to_uppercase(),
            "iat": now,
            "iss": iss.public_key(),
            "name": name,
            "sub": sub.public_key(),
            "nats": nats,
        })
    };
    let operator_jwt = nats_jwt(
        &operator,
        claims(
            &operator,
            &operator,
            "op",
            serde_json::json!({"type": "operator", "version": 2}),
        ),
    )?;
    let unlimited = serde_json::json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1,
        "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
    });
    let account_jwt = nats_jwt(
        &operator,
        claims(
            &operator,
            &account,
            "acc",
            serde_json::json!({"limits": unlimited, "type": "account", "version": 2}),
        ),
    )?;
    let system_jwt = nats_jwt(
        &operator,
        claims(
            &operator,
            &system,
            "SYS",
            serde_json::json!({"type": "account", "version": 2}),
        ),
    )?;
    let user_jwt = nats_jwt(
        &account,
        claims(
            &account,
            &user,
            "app",
            serde_json::json!({
                "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1,
                "type": "user", "version": 2,
            }),
        ),
    )?;
    let creds = format!(
        "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
         -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
        user.seed()?
    );
    Ok((
        NatsServerAuth::Operator {
            operator_jwt,
            system_account: system.public_key(),
            accounts: vec![
                (account.public_key(), account_jwt),
                (system.public_key(), system_jwt),
            ],
        },
        creds,
    ))
}

/// A private `nats-server` with JetStream, optionally TLS-only with client certificates.
#[derive(Debug)]
pub struct PrivateNats {
    _child: Owned,
    _dir: TempDir,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl PrivateNats {
    /// Start it with `auth`; with `tls`, a `tls {}` block with `pki`'s server certificate and
    /// `verify: true` (clients must present a certificate signed by `pki`'s CA).
    pub fn start(pki: Option<&Pki>, auth: &NatsServerAuth) -> Result<Option<Self>, BoxError> {
        let program = ["/usr/sbin/nats-server", "nats-server"]
            .into_iter()
            .find(|p| installed(p));
        let Some(program) = program else {
            return Ok(missing("nats-server")?);
        };
        let dir = tempfile::Builder::new().prefix("outbox-nats-").tempdir()?;
        let port = free_port()?;
        let d = dir.path().display();
        let mut conf =
            format!("listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: \"{d}/js\" }}\n");
        if let Some(pki) = pki {
            conf.push_str(&format!(
                "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: true\n  timeout: 5\n}}\n",
                pki.server_cert.display(),
                pki.server_key.display(),
                pki.ca.display()
            ));
        }
        conf.push_str(&match auth {
            NatsServerAuth::UserPassword(password) => format!(
                "authorization {{ users = [ {{ user: app, password: \"{password}\" }} ] }}\n"
            ),
            NatsServerAuth::Token(token) => format!("authorization {{ token: \"{token}\" }}\n"),
            NatsServerAuth::Nkey(public) => {
                format!("authorization {{ users = [ {{ nkey: {public} }} ] }}\n")
            }
            NatsServerAuth::Operator {
                operator_jwt,
                system_account,
                accounts,
            } => {
                let preload: String = accounts
                    .iter()
                    .map(|(key, jwt)| format!("  {key}: \"{jwt}\"\n"))
                    .collect();
                format!(
                    "operator: \"{operator_jwt}\"\nsystem_account: {system_account}\n\
                     resolver: MEMORY\nresolver_preload: {{\n{preload}}}\n"
                )
            }
        });
        let conf_path = dir.path().join("nats.conf");
        std::fs::write(&conf_path, conf)?;
        let log = dir.path().join("log");
        let mut child = spawn(Command::new(program).arg("-c").arg(&conf_path), &log)?;
        wait_port(port, Some(&mut child.0), &log)?;
        Ok(Some(Self {
            _child: child,
            _dir: dir,
            port,
        }))
    }
}

/// A server process of an outage test: started by [`Restartable::start`], killed (by its pid)
/// by [`Restartable::stop`] and started again on the same port, with the same arguments and
/// directory, by [`Restartable::resume`]. Killed when dropped.
#[derive(Debug)]
struct Restartable {
    child: Option<Owned>,
    program: PathBuf,
    args: Vec<std::ffi::OsString>,
    dir: TempDir,
    port: u16,
}

impl Restartable {
    /// Start `program` with the arguments `args(port, dir)` (a free port, a new temporary
    /// directory named after `prefix`) and wait until it accepts connections on the port.
    fn start(
        program: PathBuf,
        prefix: &str,
        args: impl FnOnce(u16, &Path) -> Vec<std::ffi::OsString>,
    ) -> Result<Self, BoxError> {
        let dir = tempfile::Builder::new().prefix(prefix).tempdir()?;
        let port = free_port()?;
        let mut server = Self {
            child: None,
            program,
            args: args(port, dir.path()),
            dir,
            port,
        };
        server.resume()?;
        Ok(server)
    }

    fn stop(&mut self) {
        self.child = None;
    }

    fn resume(&mut self) -> Result<(), BoxError> {
        let log = self.dir.path().join("log");
        let mut child = spawn(Command::new(&self.program).args(&self.args), &log)?;
        wait_port(self.port, Some(&mut child.0), &log)?;
        self.child = Some(child);
        Ok(())
    }
}

/// The first of `candidates` that is installed.
fn program(candidates: [&str; 2]) -> Option<PathBuf> {
    candidates
        .into_iter()
        .find(|p| installed(p))
        .map(PathBuf::from)
}

/// Arguments as `Command` takes them.
fn os_args<const N: usize>(args: [&str; N]) -> Vec<std::ffi::OsString> {
    args.into_iter().map(Into::into).collect()
}

/// A private `nats-server` with JetStream and no authentication, for outage tests:
/// [`stop`](Self::stop) kills it (by its pid) and [`resume`](Self::resume) starts it again on the
/// same port with the same JetStream directory, so streams and their messages survive.
/// Killed when dropped.
#[derive(Debug)]
pub struct PlainNats {
    server: Restartable,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl PlainNats {
    /// Start it and wait until it accepts connections.
    pub fn start() -> Result<Option<Self>, BoxError> {
        let Some(program) = program(["/usr/sbin/nats-server", "nats-server"]) else {
            return Ok(missing("nats-server")?);
        };
        let server = Restartable::start(program, "outbox-nats-", |port, dir| {
            let mut args = os_args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"]);
            args.push(dir.join("js").into());
            args
        })?;
        Ok(Some(Self {
            port: server.port,
            server,
        }))
    }

    /// Kill it; its JetStream directory stays.
    pub fn stop(&mut self) {
        self.server.stop();
    }

    /// Start it (again) on its port and wait until it accepts connections.
    pub fn resume(&mut self) -> Result<(), BoxError> {
        self.server.resume()
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

/// A private `redis-server` on a plain TCP port that keeps nothing on disk, for outage tests:
/// [`stop`](Self::stop) kills it (by its pid) and [`resume`](Self::resume) starts it again on
/// the same port, empty (its streams are gone, as on a replaced server). Killed when dropped.
#[derive(Debug)]
pub struct PlainRedis {
    server: Restartable,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl PlainRedis {
    /// Start it and wait until it accepts connections.
    pub fn start() -> Result<Option<Self>, BoxError> {
        let Some(program) = program(["/usr/bin/redis-server", "redis-server"]) else {
            return Ok(missing("redis-server")?);
        };
        let server = Restartable::start(program, "outbox-redis-", |port, _| {
            os_args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .into_iter()
                .chain(os_args(["--save", "", "--appendonly", "no"]))
                .collect()
        })?;
        Ok(Some(Self {
            port: server.port,
            server,
        }))
    }

    /// Kill it.
    pub fn stop(&mut self) {
        self.server.stop();
    }

    /// Start it (again, empty) on its port and wait until it accepts connections.
    pub fn resume(&mut self) -> Result<(), BoxError> {
        self.server.resume()
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

/// The Tansu binary that `scripts/tansu install` puts in `$OUTBOX_TANSU_HOME/bin` (default
/// `~/.local/share/outbox/bin`), if it is there.
fn tansu_program() -> Option<PathBuf> {
    let home = std::env::var_os("OUTBOX_TANSU_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share/outbox")))
        .unwrap_or_default();
    let tansu = home.join("bin/tansu");
    tansu.is_file().then_some(tansu)
}

/// A private Tansu (Kafka API) in plaintext with memory storage, for outage tests:
/// [`stop`](Self::stop) kills it (by its pid) and [`resume`](Self::resume) starts it again on
/// the same port, empty: its topics and records are gone, like a broker replaced by an empty
/// one. Killed when dropped.
#[derive(Debug)]
pub struct PlainKafka {
    server: Restartable,
    /// Its port on 127.0.0.1 (also the advertised listener).
    pub port: u16,
}

impl PlainKafka {
    /// Start it and wait until it accepts connections.
    pub fn start() -> Result<Option<Self>, BoxError> {
        let Some(program) = tansu_program() else {
            return Ok(missing("tansu (scripts/tansu install)")?);
        };
        let server = Restartable::start(program, "outbox-kafka-", |port, _| {
            let listener = format!("tcp://127.0.0.1:{port}");
            os_args([
                "broker",
                "--listener-url",
                &listener,
                "--advertised-listener-url",
                &listener,
                "--storage-engine",
                "memory://tansu/",
            ])
        })?;
        Ok(Some(Self {
            port: server.port,
            server,
        }))
    }

    /// Kill it.
    pub fn stop(&mut self) {
        self.server.stop();
    }

    /// Start it (again, empty) on its port and wait until it accepts connections.
    pub fn resume(&mut self) -> Result<(), BoxError> {
        self.server.resume()
    }

    /// `127.0.0.1:PORT`, the bootstrap list of a `kafka://` URL.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

/// A private Tansu (Kafka) reachable only over TLS: Tansu listens in plaintext on a hidden
/// port and advertises the TLS port, where a TLS front in this process (tokio-rustls, `pki`'s
/// server certificate for [`TLS_HOST`]) forwards each connection to it. So librdkafka's TLS,
/// certificate and host name checks run against a real broker.
#[derive(Debug)]
pub struct PrivateKafkaTls {
    _tansu: Owned,
    _dir: TempDir,
    front: Option<tokio::runtime::Runtime>,
    /// The TLS port on 127.0.0.1 (advertised as `TLS_HOST:port`).
    pub port: u16,
}

impl PrivateKafkaTls {
    /// Start Tansu (the binary `scripts/tansu install` puts in
    /// `$OUTBOX_TANSU_HOME/bin`, default `~/.local/share/outbox/bin`) and the TLS front.
    pub fn start(pki: &Pki) -> Result<Option<Self>, BoxError> {
        let Some(tansu) = tansu_program() else {
            return Ok(missing("tansu (scripts/tansu install)")?);
        };
        let dir = tempfile::Builder::new().prefix("outbox-kafka-").tempdir()?;
        let (inner, port) = (free_port()?, free_port()?);
        let log = dir.path().join("log");
        let mut child = spawn(
            Command::new(&tansu)
                .arg("broker")
                .arg("--listener-url")
                .arg(format!("tcp://127.0.0.1:{inner}"))
                .arg("--advertised-listener-url")
                .arg(format!("tcp://{TLS_HOST}:{port}"))
                .args(["--storage-engine", "memory://tansu/"]),
            &log,
        )?;
        wait_port(inner, Some(&mut child.0), &log)?;
        let front = tls_front(pki, port, inner, false)?;
        wait_port(port, None, &log)?;
        Ok(Some(Self {
            _tansu: child,
            _dir: dir,
            front: Some(front),
            port,
        }))
    }
}

impl Drop for PrivateKafkaTls {
    fn drop(&mut self) {
        if let Some(front) = self.front.take() {
            front.shutdown_background();
        }
    }
}

/// A runtime serving TLS on `port` with `pki`'s server certificate, forwarding each connection
/// to `inner` in plaintext; with `verify_clients`, only clients presenting a certificate signed
/// by `pki`'s CA get through. Drop the runtime (or shut it down) to stop it.
pub fn tls_front(
    pki: &Pki,
    port: u16,
    inner: u16,
    verify_clients: bool,
) -> Result<tokio::runtime::Runtime, BoxError> {
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use tokio_rustls::rustls::server::WebPkiClientVerifier;
    use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = CertificateDer::pem_file_iter(&pki.server_cert)?.collect::<Result<Vec<_>, _>>()?;
    let key = PrivateKeyDer::from_pem_file(&pki.server_key)?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = if verify_clients {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&pki.ca)? {
            roots.add(cert?)?;
        }
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build()?;
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let config = builder.with_single_cert(certs, key)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    // Bound here (not with the runtime's block_on, which may not run inside a test's runtime).
    let listener = TcpListener::bind(("127.0.0.1", port))?;
    listener.set_nonblocking(true)?;
    runtime.spawn(async move {
        let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
            return;
        };
        while let Ok((socket, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A client that fails the handshake (wrong CA, plaintext) just goes away.
                let Ok(mut tls) = acceptor.accept(socket).await else {
                    return;
                };
                if let Ok(mut upstream) = tokio::net::TcpStream::connect(("127.0.0.1", inner)).await
                {
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut upstream).await;
                }
            });
        }
    });
    Ok(runtime)
}
