//! TLS and credentials against private TLS-only servers (`outbox_e2e::private`): each store and
//! broker is reached with verification (the right CA, the host name the certificate lists) and
//! the relay migrates, drains and publishes through it; a wrong CA, a wrong host name, a
//! plaintext connection and a bad password each fail with one line that names the server, the
//! cause and the fix, without the secret, and before anything is written.
//!
//! One private server per test (starting one takes seconds); the shared servers are not used.

use std::path::Path;
use std::sync::Arc;

use outbox::memory::{MemoryStore, RecordingPublisher};
use outbox::relay::{Relay, RelayConfig};
use outbox::store::StoreOptions;
use outbox::{Error, NewMessage, OutboxAdmin};
use outbox_e2e::private::{
    nats_operator, secret, NatsServerAuth, Pki, PrivateKafkaTls, PrivateMariadb, PrivateNats,
    PrivatePostgres, PrivateRedis, TLS_HOST, WRONG_HOST,
};
use outbox_e2e::BoxError;

const MESSAGES: usize = 20;

fn messages(tag: &str) -> Vec<NewMessage> {
    (0..MESSAGES)
        .map(|n| {
            NewMessage::new(
                "order",
                format!("order-{n}"),
                "order.placed",
                serde_json::json!({ "n": n, "tag": tag }),
            )
        })
        .collect()
}

/// A failure's text: one line, naming `server` (host:port), containing `fix`, never `secret`.
fn assert_explained(result: Result<(), Error>, server: &str, fix: &str, secret: &str) {
    let err = result.expect_err("must fail");
    let text = err.to_string();
    assert!(!text.contains('\n'), "not one line: {text}");
    assert!(text.contains(server), "does not name {server}: {text}");
    assert!(text.contains(fix), "does not say {fix:?}: {text}");
    assert!(!text.contains(secret), "shows the secret: {text}");
    let debug = format!("{err:?}");
    assert!(!debug.contains(secret), "Debug shows the secret: {debug}");
}

async fn open(url: &str, table: &str) -> Result<(), Error> {
    let options = StoreOptions {
        table: Some(table.to_owned()),
        ..StoreOptions::default()
    };
    outbox::store::open(url, &options).await.map(|_| ())
}

/// Drain the store at `url` (migrated and filled by the caller) into a recording publisher;
/// checks that every message was published and returns how many the relay published.
async fn drain(url: &str) -> Result<u64, BoxError> {
    let opened = outbox::store::open(url, &StoreOptions::default()).await?;
    let publisher = Arc::new(RecordingPublisher::new());
    let relay = Relay::new(
        opened.store.clone(),
        publisher.clone(),
        RelayConfig::default(),
    )?;
    let stats = relay.run_until_idle().await?;
    assert_eq!(publisher.published_ids().len(), MESSAGES);
    assert_eq!(opened.admin.counts().await?.published, MESSAGES as u64);
    Ok(stats.published)
}

/// Relay [`MESSAGES`] messages from a memory store through the broker at `url`; returns how
/// many the relay published.
async fn relay_to(url: &str) -> Result<u64, BoxError> {
    let publisher = outbox::broker::connect(url).await?;
    let store = Arc::new(MemoryStore::new());
    store.enqueue(messages("broker"))?;
    let relay = Relay::new(store, Arc::from(publisher), RelayConfig::default())?;
    Ok(relay.run_until_idle().await?.published)
}

async fn connect(url: &str) -> Result<(), Error> {
    outbox::broker::connect(url).await.map(|_| ())
}

fn write_secret(dir: &Path, name: &str, text: &str) -> Result<String, BoxError> {
    let path = dir.join(name);
    std::fs::write(&path, format!("{text}\n"))?;
    Ok(path.display().to_string())
}

#[tokio::test]
async fn postgres_over_tls_with_verification_and_explained_failures() -> Result<(), BoxError> {
    let pki = Pki::new()?;
    let Some(pg) = PrivatePostgres::start(&pki)? else {
        return Ok(());
    };
    let ca = pki.ca.display();
    let verify_full = format!("sslmode=verify-full&sslrootcert={ca}");
    let good = pg.url(TLS_HOST, &verify_full);

    // verify-full with the right CA: migrate, enqueue, drain.
    let opened = outbox::store::open(&good, &StoreOptions::default()).await?;
    opened.migrate().await?;
    let pool = sqlx::PgPool::connect(&good).await?;
    let config = outbox::postgres::PostgresConfig::default();
    outbox::postgres::enqueue_batch(&pool, &config, &messages("pg")).await?;
    // The password from a file instead of the URL.
    let dir = tempfile::tempdir()?;
    let file = write_secret(dir.path(), "pw", &pg.password)?;
    let from_file = format!(
        "postgres://postgres@{TLS_HOST}:{}/postgres?{verify_full}&password_file={file}",
        pg.port
    );
    assert_eq!(drain(&from_file).await?, MESSAGES as u64);
    // verify-ca checks the CA. (It should accept a host name the certificate does not list,
    // but sqlx 0.8.6 with rustls >= 0.23.24 checks the name too: it matches only the older error
    // variant; sqlx issue 3793, fixed for 0.9.)
    let verify_ca = pg.url(TLS_HOST, &format!("sslmode=verify-ca&sslrootcert={ca}"));
    open(&verify_ca, "outbox").await?;

    // User `app` logs in by client certificate (pg_hba `cert`), without a password.
    let (cert, key) = (pki.client_cert.display(), pki.client_key.display());
    let by_cert = format!(
        "postgres://app@{TLS_HOST}:{}/postgres?{verify_full}&sslcert={cert}&sslkey={key}",
        pg.port
    );
    open(&by_cert, "outbox").await?;
    let no_cert = format!(
        "postgres://app@{TLS_HOST}:{}/postgres?{verify_full}",
        pg.port
    );
    assert_explained(
        open(&no_cert, "never_written").await,
        &format!("{TLS_HOST}:{}", pg.port),
        "sslcert=",
        &pg.password,
    );

    let port = pg.port;
    let other = pki.other_ca.display();
    let pw = &pg.password;
    let cases = [
        // A CA that did not sign the server's certificate.
        (
            pg.url(
                TLS_HOST,
                &format!("sslmode=verify-full&sslrootcert={other}"),
            ),
            format!("{TLS_HOST}:{port}"),
            "sslrootcert=",
        ),
        // A host name the certificate does not list.
        (
            pg.url(WRONG_HOST, &verify_full),
            format!("{WRONG_HOST}:{port}"),
            "does not name the host",
        ),
        // Plaintext to a server with only hostssl lines.
        (
            pg.url(TLS_HOST, "sslmode=disable"),
            format!("{TLS_HOST}:{port}"),
            "sslmode=verify-full",
        ),
        // A wrong password.
        (
            format!("postgres://postgres:wrong-{pw}@{TLS_HOST}:{port}/postgres?{verify_full}"),
            format!("{TLS_HOST}:{port}"),
            "password",
        ),
    ];
    for (url, server, fix) in cases {
        assert_explained(open(&url, "never_written").await, &server, fix, pw);
    }
    // Nothing was written by the refused connections.
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('public.never_written') IS NOT NULL")
        .fetch_one(&pool)
        .await?;
    assert!(!exists);
    pool.close().await;
    Ok(())
}

#[tokio::test]
async fn mariadb_over_tls_with_verification_and_explained_failures() -> Result<(), BoxError> {
    let pki = Pki::new()?;
    let Some(db) = PrivateMariadb::start(&pki)? else {
        return Ok(());
    };
    let ca = pki.ca.display();
    let verify = format!("ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}");
    let good = db.url(TLS_HOST, &verify);

    let opened = outbox::store::open(&good, &StoreOptions::default()).await?;
    opened.migrate().await?;
    let pool = sqlx::MySqlPool::connect(&good).await?;
    let config = outbox::mysql::MysqlConfig::default();
    outbox::mysql::enqueue_batch(&pool, &config, &messages("mariadb")).await?;
    let dir = tempfile::tempdir()?;
    let file = write_secret(dir.path(), "pw", &db.password)?;
    let from_file = format!(
        "mariadb://app@{TLS_HOST}:{}/test?{verify}&password_file={file}",
        db.port
    );
    assert_eq!(drain(&from_file).await?, MESSAGES as u64);
    let verify_ca = db.url(TLS_HOST, &format!("ssl-mode=VERIFY_CA&ssl-ca={ca}"));
    open(&verify_ca, "outbox").await?;

    // User `certuser` is REQUIRE X509: it logs in with the client certificate only.
    let (cert, key) = (pki.client_cert.display(), pki.client_key.display());
    let by_cert = format!(
        "mysql://certuser@{TLS_HOST}:{}/test?{verify}&ssl-cert={cert}&ssl-key={key}",
        db.port
    );
    open(&by_cert, "outbox").await?;

    let port = db.port;
    let other = pki.other_ca.display();
    let pw = &db.password;
    let cases = [
        (
            db.url(
                TLS_HOST,
                &format!("ssl-mode=VERIFY_IDENTITY&ssl-ca={other}"),
            ),
            format!("{TLS_HOST}:{port}"),
            "ssl-ca=",
        ),
        (
            db.url(WRONG_HOST, &verify),
            format!("{WRONG_HOST}:{port}"),
            "does not name the host",
        ),
        (
            db.url(TLS_HOST, "ssl-mode=DISABLED"),
            format!("{TLS_HOST}:{port}"),
            "ssl-mode=VERIFY_IDENTITY",
        ),
        (
            format!("mysql://app:wrong-{pw}@{TLS_HOST}:{port}/test?{verify}"),
            format!("{TLS_HOST}:{port}"),
            "password",
        ),
    ];
    for (url, server, fix) in cases {
        assert_explained(open(&url, "never_written").await, &server, fix, pw);
    }
    let exists: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_name = 'never_written'",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!(exists, 0);
    pool.close().await;
    Ok(())
}

#[tokio::test]
async fn redis_over_tls_with_client_certificates_and_explained_failures() -> Result<(), BoxError> {
    let pki = Pki::new()?;
    let Some(redis) = PrivateRedis::start(&pki, true)? else {
        return Ok(());
    };
    let (port, pw) = (redis.port, &redis.password);
    let (ca, cert, key) = (
        pki.ca.display(),
        pki.client_cert.display(),
        pki.client_key.display(),
    );
    let stream = "orders";
    let tls = format!("ca_file={ca}&cert_file={cert}&key_file={key}");
    let dir = tempfile::tempdir()?;
    let file = write_secret(dir.path(), "pw", pw)?;
    let good = format!("rediss://{TLS_HOST}:{port}?stream={stream}&{tls}&password_file={file}");
    assert_eq!(relay_to(&good).await?, MESSAGES as u64);

    // An ACL user with its password from the file.
    let acl = format!("rediss://app@{TLS_HOST}:{port}?stream={stream}&{tls}&password_file={file}");
    connect(&acl).await?;

    // Read back with the client's own TLS connection.
    let client = redis::Client::build_with_tls(
        format!("rediss://:{pw}@{TLS_HOST}:{port}"),
        redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: std::fs::read(&pki.client_cert)?,
                client_key: std::fs::read(&pki.client_key)?,
            }),
            root_cert: Some(std::fs::read(&pki.ca)?),
        },
    )?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let len: u64 = redis::cmd("XLEN")
        .arg(stream)
        .query_async(&mut conn)
        .await?;
    assert_eq!(len, MESSAGES as u64);

    let other = pki.other_ca.display();
    let with_pw =
        |host: &str, query: &str| format!("rediss://:{pw}@{host}:{port}?stream=never&{query}");
    let cases = [
        (
            with_pw(
                TLS_HOST,
                &format!("ca_file={other}&cert_file={cert}&key_file={key}"),
            ),
            format!("{TLS_HOST}:{port}"),
            "ca_file=",
        ),
        (
            with_pw(WRONG_HOST, &tls),
            format!("{WRONG_HOST}:{port}"),
            "does not name the host",
        ),
        (
            format!("redis://:{pw}@{TLS_HOST}:{port}?stream=never&timeout_ms=2000"),
            format!("{TLS_HOST}:{port}"),
            "rediss://",
        ),
        (
            with_pw(TLS_HOST, &format!("ca_file={ca}")),
            format!("{TLS_HOST}:{port}"),
            "cert_file=",
        ),
        (
            format!("rediss://:wrong-{pw}@{TLS_HOST}:{port}?stream=never&{tls}"),
            format!("{TLS_HOST}:{port}"),
            "password",
        ),
    ];
    for (url, server, fix) in cases {
        assert_explained(connect(&url).await, &server, fix, pw);
    }
    let written: u64 = redis::cmd("EXISTS")
        .arg("never")
        .query_async(&mut conn)
        .await?;
    assert_eq!(written, 0);
    Ok(())
}

#[tokio::test]
async fn nats_over_tls_with_client_certificates_and_explained_failures() -> Result<(), BoxError> {
    let pki = Pki::new()?;
    let password = secret();
    let Some(nats) =
        PrivateNats::start(Some(&pki), &NatsServerAuth::UserPassword(password.clone()))?
    else {
        return Ok(());
    };
    let port = nats.port;
    let (ca, cert, key) = (
        pki.ca.display(),
        pki.client_cert.display(),
        pki.client_key.display(),
    );
    let tls = format!("ca_file={ca}&cert_file={cert}&key_file={key}");
    let dir = tempfile::tempdir()?;
    let file = write_secret(dir.path(), "pw", &password)?;
    let stream = "&stream=ORDERS&create_stream=true";
    let good = format!(
        "tls://app@{TLS_HOST}:{port}?subject=orders.{{event_type}}{stream}&{tls}&password_file={file}"
    );
    assert_eq!(relay_to(&good).await?, MESSAGES as u64);
    // nats:// with tls_required=true is the same.
    let required = format!(
        "nats://app:{password}@{TLS_HOST}:{port}?subject=orders.{{event_type}}&stream=ORDERS&tls_required=true&{tls}"
    );
    connect(&required).await?;

    // Read back with the client's own TLS connection.
    let client = async_nats::ConnectOptions::new()
        .add_root_certificates(pki.ca.clone())
        .add_client_certificate(pki.client_cert.clone(), pki.client_key.clone())
        .user_and_password("app".into(), password.clone())
        .connect(format!("tls://{TLS_HOST}:{port}"))
        .await?;
    let js = async_nats::jetstream::new(client);
    let info = js.get_stream("ORDERS").await?.info().await?.state.messages;
    assert_eq!(info, MESSAGES as u64);

    let other = pki.other_ca.display();
    let base = |host: &str, query: &str| {
        format!("tls://app:{password}@{host}:{port}?subject=never&stream=NEVER&create_stream=true&{query}")
    };
    let cases = [
        (
            base(TLS_HOST, &format!("ca_file={other}&cert_file={cert}&key_file={key}")),
            format!("{TLS_HOST}:{port}"),
            "ca_file=",
        ),
        (
            base(WRONG_HOST, &tls),
            format!("{WRONG_HOST}:{port}"),
            "does not name the host",
        ),
        // Plaintext asked for, but the server requires TLS: the client must not fall back to
        // trusting it, so without a CA the certificate is refused.
        (
            format!("nats://app:{password}@{TLS_HOST}:{port}?subject=never&stream=NEVER&create_stream=true"),
            format!("{TLS_HOST}:{port}"),
            "ca_file=",
        ),
        (
            base(TLS_HOST, &format!("ca_file={ca}")),
            format!("{TLS_HOST}:{port}"),
            "cert_file=",
        ),
        (
            format!("tls://app:wrong-{password}@{TLS_HOST}:{port}?subject=never&stream=NEVER&create_stream=true&{tls}"),
            format!("{TLS_HOST}:{port}"),
            "password",
        ),
    ];
    for (url, server, fix) in cases {
        assert_explained(connect(&url).await, &server, fix, &password);
    }
    assert!(
        js.get_stream("NEVER").await.is_err(),
        "a refused connection created a stream"
    );
    Ok(())
}

#[tokio::test]
async fn nats_token_and_nkey_authentication() -> Result<(), BoxError> {
    let dir = tempfile::tempdir()?;
    let token = secret();
    let Some(server) = PrivateNats::start(None, &NatsServerAuth::Token(token.clone()))? else {
        return Ok(());
    };
    let port = server.port;
    let file = write_secret(dir.path(), "token", &token)?;
    let url = format!(
        "nats://127.0.0.1:{port}?subject=orders&stream=ORDERS&create_stream=true&token_file={file}"
    );
    assert_eq!(relay_to(&url).await?, MESSAGES as u64);
    let wrong = write_secret(dir.path(), "wrong-token", "not-the-token")?;
    let bad = format!("nats://127.0.0.1:{port}?subject=orders&token_file={wrong}");
    assert_explained(
        connect(&bad).await,
        &format!("127.0.0.1:{port}"),
        "token_file=",
        &token,
    );

    let user = nkeys::KeyPair::new_user();
    let seed = user.seed()?;
    let Some(server) = PrivateNats::start(None, &NatsServerAuth::Nkey(user.public_key()))? else {
        return Ok(());
    };
    let port = server.port;
    let file = write_secret(dir.path(), "user.nk", &seed)?;
    let url = format!(
        "nats://127.0.0.1:{port}?subject=orders&stream=ORDERS&create_stream=true&nkey_file={file}"
    );
    assert_eq!(relay_to(&url).await?, MESSAGES as u64);
    let stranger = nkeys::KeyPair::new_user().seed()?;
    let file = write_secret(dir.path(), "stranger.nk", &stranger)?;
    let bad = format!("nats://127.0.0.1:{port}?subject=orders&nkey_file={file}");
    assert_explained(
        connect(&bad).await,
        &format!("127.0.0.1:{port}"),
        "nkey_file=",
        &seed,
    );
    assert_explained(
        connect(&bad).await,
        &format!("127.0.0.1:{port}"),
        "nkey_file=",
        &stranger,
    );
    Ok(())
}

#[tokio::test]
async fn nats_creds_file_authentication() -> Result<(), BoxError> {
    let dir = tempfile::tempdir()?;
    let (auth, creds) = nats_operator()?;
    let Some(server) = PrivateNats::start(None, &auth)? else {
        return Ok(());
    };
    let port = server.port;
    let file = write_secret(dir.path(), "user.creds", &creds)?;
    let url = format!(
        "nats://127.0.0.1:{port}?subject=orders&stream=ORDERS&create_stream=true&creds_file={file}"
    );
    assert_eq!(relay_to(&url).await?, MESSAGES as u64);
    // Another operator's user is refused, with the fix named and no seed shown.
    let (_, stranger) = nats_operator()?;
    let seed = stranger
        .lines()
        .find(|l| l.starts_with("SU"))
        .ok_or("no seed")?
        .to_owned();
    let file = write_secret(dir.path(), "stranger.creds", &stranger)?;
    let bad = format!("nats://127.0.0.1:{port}?subject=orders&creds_file={file}");
    assert_explained(
        connect(&bad).await,
        &format!("127.0.0.1:{port}"),
        "creds_file=",
        &seed,
    );
    Ok(())
}

/// Kafka over TLS: librdkafka (OpenSSL) checks the CA and the host name of a real broker (a
/// private Tansu behind a TLS front, as Tansu 0.6 cannot serve TLS itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_over_tls_verified_by_librdkafka() -> Result<(), BoxError> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::ClientConfig;

    let pki = Pki::new()?;
    let Some(kafka) = PrivateKafkaTls::start(&pki)? else {
        return Ok(());
    };
    let brokers = format!("{TLS_HOST}:{}", kafka.port);
    let ca = pki.ca.display().to_string();
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("security.protocol", "SSL")
        .set("ssl.ca.location", &ca)
        .create()?;
    let options = AdminOptions::new().operation_timeout(Some(std::time::Duration::from_secs(10)));
    for r in admin
        .create_topics(
            &[NewTopic::new("orders", 1, TopicReplication::Fixed(1))],
            &options,
        )
        .await?
    {
        r.map_err(|(t, e)| format!("creating topic {t}: {e}"))?;
    }
    let good = format!("kafka://{brokers}?topic=orders&security.protocol=SSL&ssl.ca.location={ca}");
    assert_eq!(relay_to(&good).await?, MESSAGES as u64);

    // A CA that did not sign the certificate, and a host name it does not list: no connection.
    let other = pki.other_ca.display();
    for url in [
        format!("kafka://{brokers}?topic=orders&security.protocol=SSL&ssl.ca.location={other}"),
        format!(
            "kafka://{WRONG_HOST}:{}?topic=orders&security.protocol=SSL&ssl.ca.location={ca}",
            kafka.port
        ),
    ] {
        let publisher = outbox::kafka::KafkaPublisher::from_url(&url)?;
        let checked = publisher
            .check_connection(std::time::Duration::from_secs(2))
            .await;
        assert!(checked.is_err(), "{url} connected");
    }
    Ok(())
}
