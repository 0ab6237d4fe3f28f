//! TLS and credentials of the Redis connection: the client built from the URL and the
//! certificate files, and what to fix when connecting fails.
//!
//! | URL part or option | what it does |
//! |---|---|
//! | `rediss://host:6380` | TLS, checking the server's certificate and host name |
//! | `ca_file=/path/ca.pem` | trust only this CA for the server's certificate (default: the system's CAs) |
//! | `cert_file=/path/client.pem`, `key_file=/path/client.key` | present this client certificate (`tls-auth-clients yes`) |
//! | `redis://:password@host`, `redis://user:password@host` (ACL) | `AUTH` with the password |
//! | `password_file=/path` | the password from a file (trailing line break ignored), with the URL's user name if any |
//!
//! Certificate and password files are read when the URL is parsed, so a missing file is an error
//! before anything connects. The password never appears in errors or `Debug` output.

use std::path::PathBuf;

use outbox_traits::Error;

/// Certificate files of a `rediss://` connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// CA certificate file (PEM) to trust for the server's certificate; `None`: the system's.
    pub ca_file: Option<PathBuf>,
    /// Client certificate file (PEM); needs [`RedisTls::key_file`].
    pub cert_file: Option<PathBuf>,
    /// Client private key file (PEM); needs [`RedisTls::cert_file`].
    pub key_file: Option<PathBuf>,
}

impl RedisTls {
    /// Whether any file is set.
    pub fn is_set(&self) -> bool {
        self.ca_file.is_some() || self.cert_file.is_some() || self.key_file.is_some()
    }

    /// Check the combination: files only with `rediss://`, a certificate with its key, and
    /// every named file readable.
    pub fn validate(&self, url: &str) -> Result<(), Error> {
        if self.is_set() && !url.starts_with("rediss://") {
            return Err(Error::invalid_input(
                "Redis options ca_file, cert_file and key_file need TLS: write the URL as \
                 rediss://host:port",
            ));
        }
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(Error::invalid_input(
                "Redis options cert_file and key_file go together: give both (the client's \
                 certificate and its private key) or neither",
            ));
        }
        for (option, path) in [
            ("ca_file", &self.ca_file),
            ("cert_file", &self.cert_file),
            ("key_file", &self.key_file),
        ] {
            if let Some(path) = path {
                if !path.is_file() {
                    return Err(Error::invalid_input(format!(
                        "Redis option {option}={} names no readable file; give the path of an \
                         existing file",
                        path.display()
                    )));
                }
            }
        }
        Ok(())
    }

    fn read(option: &str, path: &PathBuf) -> Result<Vec<u8>, Error> {
        std::fs::read(path).map_err(|e| {
            Error::invalid_input(format!(
                "Redis option {option}={} cannot be read ({}); give the path of a readable file",
                path.display(),
                e.kind()
            ))
        })
    }

    /// The certificates these files hold.
    fn certificates(&self) -> Result<redis::TlsCertificates, Error> {
        let load = |option: &str, path: &Option<PathBuf>| -> Result<Option<Vec<u8>>, Error> {
            path.as_ref().map(|p| Self::read(option, p)).transpose()
        };
        let root_cert = load("ca_file", &self.ca_file)?;
        let client_tls = match (
            load("cert_file", &self.cert_file)?,
            load("key_file", &self.key_file)?,
        ) {
            (Some(client_cert), Some(client_key)) => Some(redis::ClientTlsConfig {
                client_cert,
                client_key,
            }),
            _ => None,
        };
        Ok(redis::TlsCertificates {
            client_tls,
            root_cert,
        })
    }

    /// The client for `url` with these files.
    pub(crate) fn client(&self, url: &str) -> Result<redis::Client, Error> {
        let client = if self.is_set() {
            redis::Client::build_with_tls(url, self.certificates()?)
        } else {
            redis::Client::open(url)
        };
        client.map_err(|e| unusable(url, &e))
    }

    /// The Redis Cluster client for seed `url` (with the credentials) and the other `seeds`
    /// (`host:port`), with these files and `config`'s timeout.
    pub(crate) fn cluster_client(
        &self,
        url: &str,
        seeds: &[String],
        config: &crate::RedisConfig,
    ) -> Result<redis::cluster::ClusterClient, Error> {
        let first = url::Url::parse(url).map_err(|e| unusable(url, &e))?;
        let mut nodes = vec![url.to_owned()];
        for seed in seeds {
            // The seed's URL is the first one's with its host and port: same credentials, TLS
            // and protocol, as the cluster client requires of every seed.
            let (host, port) = seed.rsplit_once(':').unwrap_or((seed, "6379"));
            let mut node = first.clone();
            let port = port.parse().ok();
            if node.set_host(Some(host)).is_err() || node.set_port(port).is_err() {
                return Err(Error::invalid_input(format!(
                    "Redis seed {seed:?} is not host:port"
                )));
            }
            nodes.push(node.to_string());
        }
        let mut builder = redis::cluster::ClusterClientBuilder::new(nodes)
            .connection_timeout(config.timeout)
            .response_timeout(config.timeout);
        if self.is_set() {
            builder = builder.certs(self.certificates()?);
        }
        builder.build().map_err(|e| unusable(url, &e))
    }
}

fn unusable(url: &str, e: &(dyn std::error::Error + 'static)) -> Error {
    let detail = outbox_url::redact_url(&outbox_url::error_chain_line(e));
    Error::invalid_input(format!(
        "Redis URL {:?} is not usable: {detail}",
        outbox_url::redact_url(url)
    ))
}

/// What to change when connecting failed with `text` (the client's message, redacted), or
/// `None` when the message says enough (a refused connection).
pub(crate) fn fix(text: &str, tls: bool) -> Option<&'static str> {
    let t = text.to_ascii_lowercase();
    let has = |needles: &[&str]| needles.iter().any(|n| t.contains(n));
    Some(
        if has(&[
            "wrongpass",
            "invalid password",
            "noauth",
            "invalid username-password",
            "authentication failed",
            "authenticationfailed",
        ]) {
            "check the user name and the password (in the URL, or in a file with password_file=)"
        } else if has(&["unknownissuer", "unknown issuer", "badsignature"]) {
            "the server's certificate is not signed by a CA this client trusts: set ca_file= to the \
         file of the CA that signed it"
        } else if has(&["notvalidforname", "not valid for name"]) {
            "the server's certificate does not name the host in the URL: connect by a name the \
         certificate lists"
        } else if has(&["expired", "notvalidyet"]) {
            "the server's certificate is expired or not yet valid: renew it, or check this \
         machine's clock"
        } else if has(&[
            "certificaterequired",
            "certificate required",
            "bad certificate",
            "badcertificate",
        ]) {
            "the server requires a client certificate signed by a CA it trusts: set cert_file= and \
         key_file="
        } else if tls
            && has(&[
                "corrupt",
                "wrong version",
                "invalidcontenttype",
                "received corrupt message",
                "handshake",
            ])
        {
            "the TLS handshake failed: check that the port serves TLS (rediss://) and the ca_file=, \
         cert_file= and key_file= options"
        } else if !tls
            && has(&[
                "connection reset",
                "broken pipe",
                "unexpected end",
                "connection closed",
                "eof",
                "timed out",
            ])
        {
            "the server closed the connection: if it serves only TLS, use rediss:// (with ca_file=)"
        } else {
            return None;
        },
    )
}
