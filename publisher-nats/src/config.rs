//! Configuration of the NATS publisher, from code or from a URL.

use std::time::Duration;

use outbox_routing::{Envelope, RoutingTemplate};
use outbox_traits::Error;
use outbox_url::{percent_decode_lossy, redact_url, split_seed_list, UrlOptions};

use crate::security::{NatsAuth, NatsSecurity};
use crate::subject;

/// Default time to wait for a connection, an ack, or a stream API reply.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// Default number of partition keys (lanes) with a message in flight at once.
///
/// Large enough that a relay batch of 500 distinct keys goes out in one wave: on the project's
/// 2-core machine a release build reached about 50,000 msg/s with 500 in flight against about
/// 40,000 with 256 (batches of 500 over 1,000 keys, one publish call at a time).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1024;

/// How the values of [`URL_OPTIONS`] are read, and named in errors.
const OPTIONS: UrlOptions<'static> = UrlOptions::new("NATS");

/// The query options [`NatsConfig::from_url`] understands.
pub const URL_OPTIONS: &[&str] = &[
    "subject",
    "stream",
    "create_stream",
    "stream_subjects",
    "duplicate_window_ms",
    "max_msg_size",
    "stream_replicas",
    "timeout_ms",
    "max_in_flight",
    "tls_required",
    "ca_file",
    "cert_file",
    "key_file",
    "password_file",
    "token_file",
    "nkey_file",
    "creds_file",
];

/// The JetStream stream the publisher writes to: checked (or created) at connect time so that a
/// missing stream is reported at start-up rather than as a failure of every message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSetup {
    /// Stream name, e.g. `OUTBOX`.
    pub name: String,
    /// Create the stream at connect time when it does not exist (an existing stream is used as
    /// it is, never changed).
    pub create: bool,
    /// Subjects the created stream captures. Empty: derived from the subject template (its text
    /// up to the first placeholder, then `>`; e.g. `outbox.>` for `outbox.{aggregate_type}`).
    pub subjects: Vec<String>,
    /// Dedup window of the created stream (server default: 2 minutes). Keep the relay's retry
    /// horizon below it, or a late retry is stored twice (FM-C4).
    pub duplicate_window: Option<Duration>,
    /// Largest message the created stream accepts, in bytes (server default: the server's
    /// `max_payload`).
    pub max_message_size: Option<i32>,
    /// Replicas of the created stream in a JetStream cluster (1 to 5; server default 1). With 3,
    /// the stream keeps every acknowledged message while any one server is down.
    pub replicas: Option<usize>,
}

impl StreamSetup {
    /// Use the existing stream `name`; connecting fails if it is missing.
    pub fn existing(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            create: false,
            subjects: Vec::new(),
            duplicate_window: None,
            max_message_size: None,
            replicas: None,
        }
    }

    /// Use stream `name`, creating it at connect time if it is missing.
    pub fn create(name: impl Into<String>) -> Self {
        Self {
            create: true,
            ..Self::existing(name)
        }
    }
}

/// Everything [`NatsPublisher::connect`](crate::NatsPublisher::connect) needs: built with
/// [`NatsConfig::builder`] or [`NatsConfig::from_url`], both of which check it, and read with
/// getters of the same names.
///
/// ```
/// use std::time::Duration;
/// use outbox_publisher_nats::{NatsConfig, StreamSetup};
/// let config = NatsConfig::builder("nats://127.0.0.1:4222", "outbox.{aggregate_type}")
///     .stream(StreamSetup::create("OUTBOX"))
///     .timeout(Duration::from_secs(2))
///     .build()?;
/// assert_eq!(config.stream().unwrap().subjects, ["outbox.>"]);
/// assert!(NatsConfig::builder("nats://h:4222", "a").max_in_flight(0).build().is_err());
/// # Ok::<(), outbox_traits::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// Server URL, e.g. `nats://127.0.0.1:4222` or `tls://nats.example.com:4222`, or the
    /// servers of a cluster separated by commas (`nats://h1:4222,nats://h2:4222`): the client
    /// connects to any one that answers and moves to another when it fails. Credentials in a URL
    /// given to [`NatsConfig::from_url`] are moved to [`NatsConfig::security`]; they never
    /// appear in errors or logs.
    pub(crate) url: String,
    /// Subject of each message.
    pub(crate) subject: RoutingTemplate,
    /// Connection, ack and API timeout.
    pub(crate) timeout: Duration,
    /// Partition keys of one batch (one `publish` call) with a message in flight at once (each
    /// key has at most one). Batches published concurrently each have their own limit.
    pub(crate) max_in_flight: usize,
    /// Stream to check or create at connect time; `None` checks nothing (then a subject that no
    /// stream captures fails each message as "no stream").
    pub(crate) stream: Option<StreamSetup>,
    /// TLS and credentials.
    pub(crate) security: NatsSecurity,
    /// What each message carries: the standard headers (default) or a CloudEvents event in
    /// binary or structured mode (URL options `envelope=` and `ce_source=`; see
    /// [`outbox_routing::envelope`]). `Nats-Msg-Id` is the message id in every mode.
    pub(crate) envelope: Envelope,
}

impl NatsConfig {
    /// A builder for the server(s) at `url` publishing to `subject` (a routing template such as
    /// `outbox.{aggregate_type}`), starting from the default timeout and in-flight limit, no
    /// stream check, no TLS or credentials, and the standard headers.
    pub fn builder(url: impl Into<String>, subject: impl Into<String>) -> NatsConfigBuilder {
        NatsConfigBuilder {
            url: url.into(),
            subject: subject.into(),
            timeout: DEFAULT_TIMEOUT,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            stream: None,
            security: NatsSecurity::default(),
            envelope: Envelope::default(),
        }
    }

    /// The server URL, or the servers of a cluster separated by commas (see
    /// [`NatsConfig::servers`]); it holds no credentials from a URL given to
    /// [`NatsConfig::from_url`].
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The subject template of each message.
    pub fn subject(&self) -> &RoutingTemplate {
        &self.subject
    }

    /// Connection, ack and API timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Partition keys of one batch with a message in flight at once (see
    /// [`NatsConfigBuilder::max_in_flight`]).
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    /// The stream checked or created at connect time, if any (see [`NatsConfigBuilder::stream`]).
    pub fn stream(&self) -> Option<&StreamSetup> {
        self.stream.as_ref()
    }

    /// TLS and credentials.
    pub fn security(&self) -> &NatsSecurity {
        &self.security
    }

    /// What each message carries (see [`NatsConfigBuilder::envelope`]).
    pub fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    /// Parse `nats://[user:pass@]host:port?subject=...&stream=...`.
    ///
    /// A cluster is given by its seed servers: `nats://[user:pass@]h1:4222,h2:4222,h3:4222?...`
    /// (each seed may carry its own `nats://` or `tls://`, as in `nats://h1:4222,nats://h2:4222`).
    /// The client starts with any seed that answers, so a relay starts while some of them are
    /// down, learns the cluster's other servers from the one it reaches, and moves to another
    /// server when its server fails. Credentials and options are given once and apply to every
    /// server.
    ///
    /// Options ([`URL_OPTIONS`]):
    /// - `subject` (required): routing template, e.g. `outbox.{aggregate_type}.{event_type}`;
    /// - `stream`: stream name, checked at connect; `create_stream=true` creates it if missing,
    ///   capturing `stream_subjects` (comma-separated; default derived from the template), with
    ///   `duplicate_window_ms`, `max_msg_size` and `stream_replicas` (in a cluster, e.g. 3);
    /// - `timeout_ms` (default 5000) and `max_in_flight` (default 1024);
    /// - TLS and credentials: `tls_required`, `ca_file`, `cert_file`, `key_file`,
    ///   `password_file`, `token_file`, `nkey_file`, `creds_file` (see [`NatsSecurity`]); a
    ///   `user:password@` or `token@` in the URL is taken as credentials too;
    /// - `envelope=outbox|cloudevents|cloudevents-structured` and `ce_source=` (see
    ///   [`NatsConfig::envelope`]).
    ///
    /// An unknown option, a bad value or a missing `subject` gives [`Error::InvalidInput`] naming
    /// the valid options.
    ///
    /// ```
    /// use outbox_publisher_nats::NatsConfig;
    /// let c = NatsConfig::from_url(
    ///     "nats://127.0.0.1:4222?subject=outbox.{aggregate_type}&stream=OUTBOX&create_stream=true&timeout_ms=2000",
    /// ).unwrap();
    /// assert_eq!(c.url(), "nats://127.0.0.1:4222");
    /// assert_eq!(c.stream().unwrap().subjects, vec!["outbox.>".to_string()]);
    /// assert!(NatsConfig::from_url("nats://h:4222?subject=a&colour=red").is_err());
    /// let c = NatsConfig::from_url("nats://h1:4222,h2:4222,nats://h3:4222?subject=a").unwrap();
    /// assert_eq!(c.servers(), ["nats://h1:4222", "nats://h2:4222", "nats://h3:4222"]);
    /// ```
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let shown = redact_url(url);
        let seeds = split_seed_list(url)?;
        let parsed = url::Url::parse(&seeds.first)
            .map_err(|e| Error::invalid_input(format!("NATS URL {shown:?} is not a URL: {e}")))?;
        if !matches!(parsed.scheme(), "nats" | "tls" | "ws" | "wss") {
            return Err(Error::invalid_input(format!(
                "NATS URL {shown:?} has scheme {:?}; use nats:// (or tls://, ws://, wss://)",
                parsed.scheme()
            )));
        }
        let mut subject = None;
        let mut stream_name = None;
        let mut create = false;
        let mut subjects = Vec::new();
        let mut duplicate_window = None;
        let mut max_message_size = None;
        let mut replicas = None;
        let mut timeout = DEFAULT_TIMEOUT;
        let mut max_in_flight = DEFAULT_MAX_IN_FLIGHT;
        let mut security = NatsSecurity {
            tls_required: parsed.scheme() == "tls",
            ..NatsSecurity::default()
        };
        let mut password_file = None;
        let mut auths = Vec::new();
        let mut envelope = Envelope::default();
        for (key, value) in parsed.query_pairs() {
            let value = value.into_owned();
            // envelope=, ce_source= (outbox_routing::ENVELOPE_URL_OPTIONS).
            if envelope.set_url_option(&key, &value)? {
                continue;
            }
            match key.as_ref() {
                "subject" => subject = Some(value),
                "stream" => stream_name = Some(value),
                "create_stream" => create = OPTIONS.boolean(&key, &value)?,
                "stream_subjects" => {
                    subjects = value
                        .split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(String::from)
                        .collect()
                }
                "duplicate_window_ms" => duplicate_window = Some(OPTIONS.millis(&key, &value)?),
                "max_msg_size" => {
                    let size: u64 = OPTIONS.number(&key, &value)?;
                    max_message_size = Some(i32::try_from(size).map_err(|_| {
                        Error::invalid_input(format!(
                            "NATS option max_msg_size={value} is too large (at most {})",
                            i32::MAX
                        ))
                    })?);
                }
                "stream_replicas" => {
                    let n: usize = OPTIONS.number(&key, &value)?;
                    replicas = Some(n);
                }
                "timeout_ms" => timeout = OPTIONS.millis(&key, &value)?,
                "max_in_flight" => max_in_flight = OPTIONS.number(&key, &value)?,
                "tls_required" => security.tls_required = OPTIONS.boolean(&key, &value)?,
                "ca_file" => security.ca_file = Some(value.into()),
                "cert_file" => security.cert_file = Some(value.into()),
                "key_file" => security.key_file = Some(value.into()),
                "password_file" => password_file = Some(OPTIONS.secret_file(&key, &value)?),
                "token_file" => auths.push(NatsAuth::Token(OPTIONS.secret_file(&key, &value)?)),
                "nkey_file" => auths.push(NatsAuth::NkeySeed(OPTIONS.secret_file(&key, &value)?)),
                "creds_file" => auths.push(NatsAuth::CredsFile(value.into())),
                other => {
                    return Err(OPTIONS.unknown(
                        other,
                        &shown,
                        &[URL_OPTIONS, outbox_routing::ENVELOPE_URL_OPTIONS].concat(),
                    ))
                }
            }
        }
        let Some(subject) = subject else {
            return Err(Error::invalid_input(format!(
                "NATS URL {shown:?} has no subject option; add e.g. \
                 ?subject=outbox.{{aggregate_type}}.{{event_type}} (valid options: {})",
                URL_OPTIONS.join(", ")
            )));
        };
        let has_stream_options = create
            || !subjects.is_empty()
            || duplicate_window.is_some()
            || max_message_size.is_some()
            || replicas.is_some();
        if stream_name.is_none() && has_stream_options {
            return Err(Error::invalid_input(
                "NATS options create_stream, stream_subjects, duplicate_window_ms, max_msg_size \
                 and stream_replicas need stream=NAME",
            ));
        }
        let user = percent_decode_lossy(parsed.username());
        let password = parsed
            .password()
            .map(percent_decode_lossy)
            .or(password_file);
        match (user.is_empty(), password) {
            (true, None) => {}
            (false, None) => auths.push(NatsAuth::Token(user)),
            (false, Some(password)) => auths.push(NatsAuth::UserPassword { user, password }),
            (true, Some(_)) => {
                return Err(Error::invalid_input(format!(
                    "NATS URL {shown:?} has a password but no user name; write \
                     nats://USER@host:4222?password_file=... (or USER:PASSWORD@)"
                )))
            }
        }
        if auths.len() > 1 {
            return Err(Error::invalid_input(format!(
                "NATS URL {shown:?} gives more than one kind of credentials; use one of: \
                 user:password@ (or user@ with password_file=), token@ (or token_file=), \
                 nkey_file=, creds_file="
            )));
        }
        security.auth = auths.pop().unwrap_or_default();
        let mut server = parsed.clone();
        // The credentials are in `security`; the URL keeps none, so it can be shown.
        let _ = server.set_username("");
        let _ = server.set_password(None);
        server.set_query(None);
        server.set_fragment(None);
        let mut server = server.to_string();
        // `Url` writes an empty path as "/", which the NATS client does not expect.
        if matches!(parsed.path(), "" | "/") {
            server = server.trim_end_matches('/').to_owned();
        }
        let mut servers = vec![server];
        for seed in &seeds.others {
            servers.push(seed_server(seed, parsed.scheme(), &shown)?);
        }
        let stream = stream_name.map(|name| StreamSetup {
            name,
            create,
            subjects,
            duplicate_window,
            max_message_size,
            replicas,
        });
        NatsConfig::builder(servers.join(","), subject)
            .timeout(timeout)
            .max_in_flight(max_in_flight)
            .stream(stream)
            .security(security)
            .envelope(envelope)
            .build()
    }

    /// The servers to connect to: [`NatsConfig::url`] split at its commas.
    pub fn servers(&self) -> Vec<&str> {
        self.url.split(',').map(str::trim).collect()
    }

    /// Check the values: positive timeout and in-flight limit, a subject template whose literal
    /// text is valid in a NATS subject, a valid stream name and stream subjects.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        self.envelope.validate()?;
        if self.timeout.is_zero() {
            return Err(Error::invalid_input(
                "NATS timeout must be positive (timeout_ms=5000, for example)",
            ));
        }
        if self.max_in_flight == 0 {
            return Err(Error::invalid_input(
                "NATS max_in_flight must be at least 1",
            ));
        }
        if self.servers().iter().any(|s| s.is_empty()) {
            return Err(Error::invalid_input(format!(
                "NATS URL {:?} has an empty server in its list; write nats://h1:4222,h2:4222",
                redact_url(&self.url)
            )));
        }
        self.security.validate()?;
        subject::check_template(&self.subject)?;
        if let Some(stream) = &self.stream {
            subject::check_stream_name(&stream.name)?;
            if stream.create && stream.subjects.is_empty() {
                return Err(Error::invalid_input(format!(
                    "stream {:?} is to be created but has no subjects; set stream_subjects \
                     (e.g. outbox.>)",
                    stream.name
                )));
            }
            for s in &stream.subjects {
                subject::check_filter(s)?;
            }
            if stream.max_message_size.is_some_and(|n| n <= 0) {
                return Err(Error::invalid_input("NATS max_msg_size must be positive"));
            }
            if stream.replicas.is_some_and(|n| !(1..=5).contains(&n)) {
                return Err(Error::invalid_input(
                    "NATS stream_replicas must be 1 to 5 (JetStream's limit); 3 keeps a stream \
                     available while one server of a cluster is down",
                ));
            }
        }
        Ok(())
    }
}

/// Builder of [`NatsConfig`] ([`NatsConfig::builder`]); [`NatsConfigBuilder::build`] checks
/// every setting.
#[derive(Debug, Clone)]
pub struct NatsConfigBuilder {
    url: String,
    subject: String,
    timeout: Duration,
    max_in_flight: usize,
    stream: Option<StreamSetup>,
    security: NatsSecurity,
    envelope: Envelope,
}

impl NatsConfigBuilder {
    /// Connection, ack and API timeout. Default: 5 s ([`DEFAULT_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Partition keys of one batch (one `publish` call) with a message in flight at once (each
    /// key has at most one). Batches published concurrently each have their own limit. Default: 1024
    /// ([`DEFAULT_MAX_IN_FLIGHT`]).
    pub fn max_in_flight(mut self, max_in_flight: usize) -> Self {
        self.max_in_flight = max_in_flight;
        self
    }

    /// Stream to check or create at connect time; `None` checks nothing (then a subject that no
    /// stream captures fails each message as "no stream"). Default: `None`.
    /// A stream to create that is given no subjects captures the subject template's text up to
    /// its first placeholder, then `>` (e.g. `outbox.>`), as with [`NatsConfig::from_url`].
    pub fn stream(mut self, stream: impl Into<Option<StreamSetup>>) -> Self {
        self.stream = stream.into();
        self
    }

    /// TLS and credentials. Default: no TLS, no credentials.
    pub fn security(mut self, security: NatsSecurity) -> Self {
        self.security = security;
        self
    }

    /// What each message carries: the standard headers (default) or a CloudEvents event in
    /// binary or structured mode (URL options `envelope=` and `ce_source=`; see
    /// [`outbox_routing::envelope`]). `Nats-Msg-Id` is the message id in every mode.
    pub fn envelope(mut self, envelope: Envelope) -> Self {
        self.envelope = envelope;
        self
    }

    /// Parse the subject template, give a stream to create its default subjects, and check
    /// every setting; [`Error::InvalidInput`] says which one to fix.
    pub fn build(self) -> Result<NatsConfig, Error> {
        let subject = RoutingTemplate::parse(&self.subject)?;
        let mut stream = self.stream;
        if let Some(setup) = stream.as_mut() {
            if setup.create && setup.subjects.is_empty() {
                setup.subjects = vec![subject::default_stream_subject(&subject)?];
            }
        }
        let config = NatsConfig {
            url: self.url,
            subject,
            timeout: self.timeout,
            max_in_flight: self.max_in_flight,
            stream,
            security: self.security,
            envelope: self.envelope,
        };
        config.validate()?;
        Ok(config)
    }
}

/// One seed after the first of a server list (`host:port` or `scheme://host:port`), as a URL
/// the client takes.
fn seed_server(seed: &str, scheme: &str, shown: &str) -> Result<String, Error> {
    let text = if seed.contains("://") {
        seed.to_owned()
    } else {
        format!("{scheme}://{seed}")
    };
    let bad = |why: &str| {
        Error::invalid_input(format!(
            "NATS URL {shown:?} lists server {seed:?}, which {why}; write the servers as \
             nats://h1:4222,h2:4222,h3:4222?subject=..."
        ))
    };
    let parsed = url::Url::parse(&text).map_err(|e| bad(&format!("is not host:port ({e})")))?;
    if !matches!(parsed.scheme(), "nats" | "tls" | "ws" | "wss") {
        return Err(bad(
            "has a scheme other than nats://, tls://, ws:// or wss://",
        ));
    }
    if parsed.host_str().is_none_or(str::is_empty) || !matches!(parsed.path(), "" | "/") {
        return Err(bad("is not host:port"));
    }
    Ok(parsed.to_string().trim_end_matches('/').to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_option() {
        let c = NatsConfig::from_url(
            "nats://u:p@127.0.0.1:4222?subject=o.{aggregate_type}.{event_type}&stream=S\
             &create_stream=true&stream_subjects=o.>,p.>&duplicate_window_ms=5000\
             &max_msg_size=1000&timeout_ms=1500&max_in_flight=8",
        )
        .unwrap();
        assert_eq!(c.url, "nats://127.0.0.1:4222");
        assert_eq!(
            c.security.auth,
            NatsAuth::UserPassword {
                user: "u".into(),
                password: "p".into()
            }
        );
        assert_eq!(c.subject.as_str(), "o.{aggregate_type}.{event_type}");
        assert_eq!(c.timeout, Duration::from_millis(1500));
        assert_eq!(c.max_in_flight, 8);
        let s = c.stream.unwrap();
        assert_eq!(s.name, "S");
        assert!(s.create);
        assert_eq!(s.subjects, ["o.>", "p.>"]);
        assert_eq!(s.duplicate_window, Some(Duration::from_secs(5)));
        assert_eq!(s.max_message_size, Some(1000));
    }

    #[test]
    fn refuses_bad_options_naming_the_valid_ones() {
        let cases = [
            "nats://h:4222?subject=a&colour=red",
            "nats://h:4222?subject=a&timeout_ms=soon",
            "nats://h:4222?subject=a&timeout_ms=0",
            "nats://h:4222?subject=a&max_in_flight=0",
            "nats://h:4222?subject=a.{tenant}",
            "nats://h:4222?subject=a b.{id}",
            "nats://h:4222?subject=a.*",
            "nats://h:4222?stream=S",
            "nats://h:4222?subject=a&create_stream=true",
            "nats://h:4222?subject=a&stream=bad.name",
            "nats://h:4222?subject={aggregate_type}&stream=S&create_stream=true",
            "nats://h:4222?subject=a&stream=S&create_stream=maybe",
            "http://h:4222?subject=a",
        ];
        for url in cases {
            let err = NatsConfig::from_url(url).unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{url}: {err}");
        }
        let err = NatsConfig::from_url("nats://h:4222?subject=a&colour=red").unwrap_err();
        assert!(err.to_string().contains("timeout_ms"), "{err}");
    }

    #[test]
    fn errors_never_show_the_password() {
        let err = NatsConfig::from_url("nats://app:s3cret@h:4222?subject=a&bogus=1").unwrap_err();
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }

    #[test]
    fn tls_and_credentials_options() {
        let dir = std::env::temp_dir().join(format!("outbox-nats-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let token = dir.join("token");
        std::fs::write(&token, "t0ken\n").unwrap();
        let c = NatsConfig::from_url(&format!(
            "tls://h:4222?subject=a&token_file={}",
            token.display()
        ))
        .unwrap();
        assert!(c.security.tls_required);
        assert_eq!(c.security.auth, NatsAuth::Token("t0ken".into()));
        assert!(!format!("{c:?}").contains("t0ken"));

        let c =
            NatsConfig::from_url("nats://app:p%40ss@h:4222?subject=a&tls_required=true").unwrap();
        assert_eq!(c.url, "nats://h:4222");
        assert!(c.security.tls_required);
        assert!(
            matches!(c.security.auth, NatsAuth::UserPassword { ref password, .. } if password == "p@ss")
        );

        for bad in [
            format!("nats://h:4222?subject=a&cert_file={}", token.display()),
            "nats://h:4222?subject=a&ca_file=/nonexistent/ca.pem".to_owned(),
            "nats://h:4222?subject=a&token_file=/nonexistent/token".to_owned(),
            format!("nats://u:p@h:4222?subject=a&token_file={}", token.display()),
        ] {
            let err = NatsConfig::from_url(&bad).unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{bad}: {err}");
            assert!(!err.to_string().contains("t0ken"), "{err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_cluster_is_given_by_its_seeds_with_credentials_and_options_once() {
        let c = NatsConfig::from_url(
            "nats://app:s3cret@10.0.0.1:4222,10.0.0.2:4222, tls://10.0.0.3:4223/?subject=a\
             &stream=S&create_stream=true&stream_replicas=3",
        )
        .unwrap();
        assert_eq!(
            c.servers(),
            [
                "nats://10.0.0.1:4222",
                "nats://10.0.0.2:4222",
                "tls://10.0.0.3:4223"
            ]
        );
        assert!(!c.url.contains("s3cret"));
        assert!(
            matches!(c.security.auth, NatsAuth::UserPassword { ref user, .. } if user == "app")
        );
        assert_eq!(c.stream.unwrap().replicas, Some(3));

        for bad in [
            "nats://app:s3cret@h1:4222,,h2:4222?subject=a",
            "nats://app:s3cret@h1:4222,app:s3cret@h2:4222?subject=a",
            "nats://app:s3cret@h1:4222,http://h2:4222?subject=a",
            "nats://app:s3cret@h1:4222,h2:port?subject=a",
            "nats://h1:4222?subject=a&stream=S&create_stream=true&stream_replicas=0",
            "nats://h1:4222?subject=a&stream=S&create_stream=true&stream_replicas=6",
            "nats://h1:4222?subject=a&stream_replicas=3",
        ] {
            let err = NatsConfig::from_url(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{bad}: {err}");
            assert!(!err.to_string().contains("s3cret"), "{err}");
        }
    }

    #[test]
    fn static_subject_is_its_own_stream_subject() {
        let c =
            NatsConfig::from_url("nats://h:4222?subject=events&stream=S&create_stream=1").unwrap();
        assert_eq!(c.stream.unwrap().subjects, ["events"]);
    }
}
