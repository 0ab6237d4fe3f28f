//! A full `outbox-relay` run over TLS with secrets from files: a private TLS-only Postgres (URL
//! in `OUTBOX_STORE_URL_FILE`) relayed into a private NATS that requires TLS, a client
//! certificate and a password (URL in `--broker-file`, password in `password_file=`), with
//! debug logs; then nothing the run printed contains a secret it used. A wrong password fails
//! with one line that says so, and `--help` never shows the URLs' values.

use outbox::store::StoreOptions;
use outbox_e2e::private::{secret, NatsServerAuth, Pki, PrivateNats, PrivatePostgres, TLS_HOST};

#[allow(dead_code)]
mod common;
use common::{command, message, BoxError, GUARD};

const MESSAGES: usize = 25;

#[tokio::test]
async fn relays_over_tls_with_secrets_from_files_and_never_prints_them() -> Result<(), BoxError> {
    let pki = Pki::new()?;
    let Some(pg) = PrivatePostgres::start(&pki)? else {
        return Ok(());
    };
    let nats_password = secret();
    let Some(nats) = PrivateNats::start(
        Some(&pki),
        &NatsServerAuth::UserPassword(nats_password.clone()),
    )?
    else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let ca = pki.ca.display();
    let store_url = pg.url(TLS_HOST, &format!("sslmode=verify-full&sslrootcert={ca}"));
    let store_file = dir.path().join("store-url");
    std::fs::write(&store_file, format!("{store_url}\n"))?;
    let password_file = dir.path().join("nats-password");
    std::fs::write(&password_file, format!("{nats_password}\n"))?;
    let broker_url = format!(
        "tls://app@{TLS_HOST}:{}?subject=orders.{{event_type}}&stream=ORDERS&create_stream=true\
         &ca_file={ca}&cert_file={}&key_file={}&password_file={}",
        nats.port,
        pki.client_cert.display(),
        pki.client_key.display(),
        password_file.display()
    );
    let broker_file = dir.path().join("broker-url");
    std::fs::write(&broker_file, &broker_url)?;

    // The service's side: the table and committed messages, over the same TLS URL.
    let opened = outbox::store::open(&store_url, &StoreOptions::default()).await?;
    opened.migrate().await?;
    let pool = sqlx::PgPool::connect(&store_url).await?;
    let messages: Vec<_> = (0..MESSAGES).map(|n| message(n, 4)).collect();
    let config = outbox::postgres::PostgresConfig::default();
    outbox::postgres::enqueue_batch(&pool, &config, &messages).await?;

    let mut relay = command(["drain", "--migrate"]);
    relay
        .arg("--broker-file")
        .arg(&broker_file)
        .env("OUTBOX_STORE_URL_FILE", &store_file)
        .env("RUST_LOG", "debug");
    let out = tokio::time::timeout(GUARD, relay.output()).await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(r#""published":{MESSAGES}"#)),
        "{stderr}"
    );
    assert_eq!(opened.admin.counts().await?.published, MESSAGES as u64);

    // Read back through the broker's own TLS connection.
    let client = async_nats::ConnectOptions::new()
        .add_root_certificates(pki.ca.clone())
        .add_client_certificate(pki.client_cert.clone(), pki.client_key.clone())
        .user_and_password("app".into(), nats_password.clone())
        .connect(format!("tls://{TLS_HOST}:{}", nats.port))
        .await?;
    let js = async_nats::jetstream::new(client);
    let stored = js.get_stream("ORDERS").await?.info().await?.state.messages;
    assert_eq!(stored, MESSAGES as u64);

    // No secret in anything the run printed: passwords, nor a line of the client's key.
    let key = std::fs::read_to_string(&pki.client_key)?;
    let key_line = key.lines().nth(1).ok_or("empty key file")?;
    for secret in [pg.password.as_str(), nats_password.as_str(), key_line] {
        assert!(!stdout.contains(secret), "stdout shows a secret");
        assert!(!stderr.contains(secret), "the log shows a secret");
    }

    // A wrong password: one line naming the server and the fix, without the password.
    let wrong = dir.path().join("wrong-store-url");
    let wrong_password = format!("wrong-{}", pg.password);
    std::fs::write(&wrong, store_url.replace(&pg.password, &wrong_password))?;
    let mut failing = command([
        "--store-file".as_ref(),
        wrong.as_os_str(),
        "counts".as_ref(),
    ]);
    let out = tokio::time::timeout(GUARD, failing.output()).await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("outbox-relay:"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains(&format!("{TLS_HOST}:{}", pg.port)),
        "{stderr}"
    );
    assert!(lines[0].contains("password_file="), "{stderr}");
    assert!(!stderr.contains(&wrong_password), "{stderr}");

    // --help names the file forms and never shows the URLs' values.
    let mut help = command(["--help"]);
    help.env("OUTBOX_STORE_URL", &store_url);
    let out = help.output().await?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("--store-file"), "{text}");
    assert!(!text.contains(&pg.password), "{text}");
    pool.close().await;
    Ok(())
}
