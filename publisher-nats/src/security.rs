//! TLS and authentication of the NATS connection: what the URL options ask for, applied to the
//! client's connect options, and what to fix when connecting fails.
//!
//! | URL option | what it does |
//! |---|---|
//! | `tls://host:4222` or `tls_required=true` | connect only over TLS (a server whose `tls {}` block requires it is reached over TLS anyway) |
//! | `ca_file=/path/ca.pem` | trust this CA for the server's certificate (the system's CAs are trusted without it) |
//! | `cert_file=/path/client.pem`, `key_file=/path/client.key` | present this client certificate (servers with `verify: true`) |
//! | `nats://user:password@host` or `password_file=/path` (with `user@` in the URL) | user and password |
//! | `nats://token@host` or `token_file=/path` | token (`authorization { token: ... }`) |
//! | `nkey_file=/path/user.nk` | NKey: the file holds the user's seed (`SU...`); the seed signs the server's nonce |
//! | `creds_file=/path/user.creds` | decentralized JWT auth: a `.creds` file (JWT and NKey seed) |
//!
//! Files are read when the URL is parsed, so a missing file is an error before anything connects.
//! Secrets (passwords, tokens, seeds) are kept out of `Debug` output, logs and errors.

use std::fmt;
use std::path::PathBuf;

use outbox_traits::Error;

/// How the publisher authenticates to the NATS server.
#[derive(Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum NatsAuth {
    /// No credentials (or those the server URL carries).
    #[default]
    None,
    /// A token (`authorization { token: ... }`).
    Token(String),
    /// A user name and password.
    UserPassword {
        /// The user name.
        user: String,
        /// The password.
        password: String,
    },
    /// An NKey seed (`SU...`), which signs the server's nonce.
    NkeySeed(String),
    /// A `.creds` file: a user JWT and the NKey seed that signs for it.
    CredsFile(PathBuf),
}

impl fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NatsAuth::None => f.write_str("None"),
            NatsAuth::Token(_) => f.write_str("Token(***)"),
            NatsAuth::UserPassword { user, .. } => f
                .debug_struct("UserPassword")
                .field("user", user)
                .field("password", &"***")
                .finish(),
            NatsAuth::NkeySeed(_) => f.write_str("NkeySeed(***)"),
            NatsAuth::CredsFile(path) => f.debug_tuple("CredsFile").field(path).finish(),
        }
    }
}

/// TLS and authentication settings of the NATS connection (see the module docs for the URL
/// options).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsSecurity {
    /// Connect only over TLS.
    pub tls_required: bool,
    /// CA certificate file (PEM) to trust for the server's certificate.
    pub ca_file: Option<PathBuf>,
    /// Client certificate file (PEM); needs [`NatsSecurity::key_file`].
    pub cert_file: Option<PathBuf>,
    /// Client private key file (PEM); needs [`NatsSecurity::cert_file`].
    pub key_file: Option<PathBuf>,
    /// The credentials.
    pub auth: NatsAuth,
}

impl NatsSecurity {
    /// Check the combination: a client certificate needs its key and the other way round, and
    /// every named file exists.
    pub fn validate(&self) -> Result<(), Error> {
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(Error::invalid_input(
                "NATS options cert_file and key_file go together: give both (the client's \
                 certificate and its private key) or neither",
            ));
        }
        let files = [
            ("ca_file", self.ca_file.as_ref()),
            ("cert_file", self.cert_file.as_ref()),
            ("key_file", self.key_file.as_ref()),
            (
                "creds_file",
                match &self.auth {
                    NatsAuth::CredsFile(path) => Some(path),
                    _ => None,
                },
            ),
        ];
        for (option, path) in files {
            if let Some(path) = path {
                if !path.is_file() {
                    return Err(Error::invalid_input(format!(
                        "NATS option {option}={} names no readable file; give the path of an \
                         existing file",
                        path.display()
                    )));
                }
            }
        }
        Ok(())
    }

    /// `options` with these settings applied (TLS, client certificate, credentials), as the
    /// publisher connects; the NATS consumer of `outbox-consumer` connects the same way.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for an NKey seed or `.creds` file that cannot be used.
    pub async fn apply(
        &self,
        mut options: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions, Error> {
        if self.tls_required {
            options = options.require_tls(true);
        }
        if let Some(ca) = &self.ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&self.cert_file, &self.key_file) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        options = match &self.auth {
            NatsAuth::None => options,
            NatsAuth::Token(token) => options.token(token.clone()),
            NatsAuth::UserPassword { user, password } => {
                options.user_and_password(user.clone(), password.clone())
            }
            NatsAuth::NkeySeed(seed) => {
                // Checked here, not at sign time, so that a bad seed is named as such.
                nkeys::KeyPair::from_seed(seed).map_err(|_| {
                    Error::invalid_input(
                        "the NATS nkey_file does not hold a valid NKey seed (a line starting \
                         with SU); give the user's seed file",
                    )
                })?;
                options.nkey(seed.clone())
            }
            NatsAuth::CredsFile(path) => options.credentials_file(path).await.map_err(|e| {
                Error::invalid_input(format!(
                    "NATS creds_file {} is not a valid .creds file ({}); give the file `nsc` \
                     generated for the user",
                    path.display(),
                    e.kind()
                ))
            })?,
        };
        Ok(options)
    }
}

/// What to change when connecting failed with `text` (the client's message), or `None` when
/// the message says enough (a refused connection). Shared with the NATS consumer of
/// `outbox-consumer`.
pub fn connect_fix(text: &str, kind: async_nats::ConnectErrorKind) -> Option<&'static str> {
    use async_nats::ConnectErrorKind as K;
    let t = text.to_ascii_lowercase();
    let has = |needles: &[&str]| needles.iter().any(|n| t.contains(n));
    Some(match kind {
        K::Authentication | K::AuthorizationViolation => {
            "check the credentials: the user and password (password_file=), token (token_file=), \
             NKey seed (nkey_file=) or .creds file (creds_file=) the server expects"
        }
        _ if has(&["unknownissuer", "unknown issuer", "badsignature"]) => {
            "the server's certificate is not signed by a CA this client trusts: set ca_file= to \
             the file of the CA that signed it"
        }
        _ if has(&["notvalidforname", "not valid for name"]) => {
            "the server's certificate does not name the host in the URL: connect by a name the \
             certificate lists"
        }
        _ if has(&["expired", "notvalidyet"]) => {
            "the server's certificate is expired or not yet valid: renew it, or check this \
             machine's clock"
        }
        _ if has(&[
            "certificaterequired",
            "certificate required",
            "bad certificate",
            "badcertificate",
        ]) =>
        {
            "the server requires a client certificate signed by a CA it trusts: set cert_file= \
             and key_file="
        }
        K::Tls => {
            "the TLS handshake failed: check ca_file=, cert_file= and key_file=, and that the \
             server speaks TLS"
        }
        _ => return None,
    })
}
