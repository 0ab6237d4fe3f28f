//! The consumers over TLS with secrets from files, against private servers that require TLS, a
//! client certificate and a password: the URL options are the publishers'. A message published
//! over TLS is consumed and acknowledged; a wrong password and a missing CA fail with a message
//! that says what to fix; no error or `Debug` output shows a secret.

mod common;

use common::*;
use outbox_consumer::nats::{NatsConsumer, NatsConsumerConfig};
use outbox_consumer::redis::{RedisConsumer, RedisConsumerConfig};
use outbox_e2e::private::{secret, NatsServerAuth, Pki, PrivateNats, PrivateRedis, TLS_HOST};
use outbox_publisher_nats::{NatsConfig, NatsPublisher};
use outbox_publisher_redis::{RedisConfig, RedisPublisher};
use outbox_traits::{PublishOutcome, Publisher};

#[tokio::test]
async fn nats_consumer_over_tls_with_a_client_certificate_and_a_password_file() {
    let pki = Pki::new().unwrap();
    let password = secret();
    let Some(nats) =
        PrivateNats::start(Some(&pki), &NatsServerAuth::UserPassword(password.clone())).unwrap()
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let password_file = dir.path().join("nats-password");
    std::fs::write(&password_file, format!("{password}\n")).unwrap();
    let wrong_file = dir.path().join("wrong-password");
    std::fs::write(&wrong_file, "not-the-password").unwrap();
    let tls = |password_file: &std::path::Path| {
        format!(
            "tls://app@{TLS_HOST}:{}?ca_file={}&cert_file={}&key_file={}&password_file={}",
            nats.port,
            pki.ca.display(),
            pki.client_cert.display(),
            pki.client_key.display(),
            password_file.display()
        )
    };
    let publisher = NatsPublisher::connect(
        NatsConfig::from_url(&format!(
            "{}&subject=orders.{{partition_key}}&stream=ORDERS&create_stream=true",
            tls(&password_file)
        ))
        .unwrap(),
    )
    .await
    .unwrap();
    let msg = message(Some("k"), 1, serde_json::json!({"n": 1}));
    let outcomes = publisher.publish(std::slice::from_ref(&msg)).await;
    assert_eq!(outcomes, [PublishOutcome::Acked]);

    let url = format!("{}&stream=ORDERS&consumer=payments", tls(&password_file));
    let config = NatsConsumerConfig::from_url(&url).unwrap();
    assert!(config.security().tls_required);
    let shown = format!("{config:?}");
    assert!(
        !shown.contains(&password),
        "Debug shows the password: {shown}"
    );
    let (handler, mut calls) = Scripted::new();
    let consumer = NatsConsumer::connect(config).await.unwrap();
    let task = tokio::spawn(consumer.run(handler));
    let seen = calls_until(&mut calls, |c| !of(c, msg.id).is_empty()).await;
    assert_decoded(of(&seen, msg.id)[0], &msg);
    task.abort();
    // Its dead letters, read with the same URL (TLS, client certificate, password file).
    let dead = outbox_consumer::dead_letters(&url, 5).await.unwrap();
    assert_eq!((dead.count, dead.destination.as_str()), (0, "ORDERS_DEAD"));

    // A wrong password: refused, said so, no secret shown.
    let wrong_url = format!("{}&stream=ORDERS&consumer=payments", tls(&wrong_file));
    let err = outbox_consumer::dead_letters(&wrong_url, 5)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("check the credentials"), "{err}");
    assert!(
        !err.contains("not-the-password") && !err.contains(&password),
        "{err}"
    );
    let wrong = NatsConsumerConfig::from_url(&wrong_url).unwrap();
    let err = NatsConsumer::connect(wrong).await.unwrap_err().to_string();
    assert!(err.contains("check the credentials"), "{err}");
    assert!(
        !err.contains("not-the-password") && !err.contains(&password),
        "{err}"
    );

    // No CA for the server's certificate: the TLS handshake fails, and the error says to set
    // ca_file=.
    let no_ca = format!(
        "tls://app@{TLS_HOST}:{}?cert_file={}&key_file={}&password_file={}&stream=ORDERS\
         &consumer=payments&timeout_ms=2000",
        nats.port,
        pki.client_cert.display(),
        pki.client_key.display(),
        password_file.display()
    );
    let err = NatsConsumer::connect(NatsConsumerConfig::from_url(&no_ca).unwrap())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("ca_file="), "{err}");
    assert!(!err.contains(&password), "{err}");

    // Files are read when the URL is parsed: a missing one is an error before connecting.
    let missing = format!(
        "nats://app@{TLS_HOST}:{}?stream=ORDERS&consumer=payments&password_file=/nonexistent/pw",
        nats.port
    );
    let err = NatsConsumerConfig::from_url(&missing)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("password_file=/nonexistent/pw cannot be read"),
        "{err}"
    );
}

#[tokio::test]
async fn redis_consumer_over_tls_with_a_client_certificate_and_a_password_file() {
    let pki = Pki::new().unwrap();
    let Some(redis) = PrivateRedis::start(&pki, true).unwrap() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let password_file = dir.path().join("redis-password");
    std::fs::write(&password_file, format!("{}\n", redis.password)).unwrap();
    let wrong_file = dir.path().join("wrong-password");
    std::fs::write(&wrong_file, "not-the-password").unwrap();
    let tls = |password_file: &std::path::Path| {
        format!(
            "rediss://app@{TLS_HOST}:{}?ca_file={}&cert_file={}&key_file={}&password_file={}",
            redis.port,
            pki.ca.display(),
            pki.client_cert.display(),
            pki.client_key.display(),
            password_file.display()
        )
    };
    let publisher = RedisPublisher::connect(
        RedisConfig::from_url(&format!("{}&stream=orders", tls(&password_file))).unwrap(),
    )
    .await
    .unwrap();
    let msg = message(Some("k"), 1, serde_json::json!({"n": 1}));
    let outcomes = publisher.publish(std::slice::from_ref(&msg)).await;
    assert_eq!(outcomes, [PublishOutcome::Acked]);

    let url = format!("{}&stream=orders&group=payments", tls(&password_file));
    let config = RedisConsumerConfig::from_url(&url).unwrap();
    let shown = format!("{config:?}");
    assert!(
        !shown.contains(&redis.password),
        "Debug shows the password: {shown}"
    );
    let (handler, mut calls) = Scripted::new();
    let consumer = RedisConsumer::connect(config).await.unwrap();
    let task = tokio::spawn(consumer.run(handler));
    let seen = calls_until(&mut calls, |c| !of(c, msg.id).is_empty()).await;
    assert_decoded(of(&seen, msg.id)[0], &msg);
    task.abort();
    // Its dead letters, read with the same URL (TLS, client certificate, password file).
    let dead = outbox_consumer::dead_letters(&url, 5).await.unwrap();
    assert_eq!((dead.count, dead.destination.as_str()), (0, "orders:dead"));

    // A wrong password: refused with advice, no secret shown.
    let wrong_url = format!("{}&stream=orders&group=payments", tls(&wrong_file));
    let err = outbox_consumer::dead_letters(&wrong_url, 5)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("password"), "{err}");
    assert!(
        !err.contains("not-the-password") && !err.contains(&redis.password),
        "{err}"
    );
    let wrong = RedisConsumerConfig::from_url(&wrong_url).unwrap();
    let err = RedisConsumer::connect(wrong).await.unwrap_err().to_string();
    assert!(err.contains("password"), "{err}");
    assert!(
        !err.contains("not-the-password") && !err.contains(&redis.password),
        "{err}"
    );

    // No client certificate for a server that requires one: refused, no secret shown.
    let no_cert = format!(
        "rediss://app@{TLS_HOST}:{}?ca_file={}&password_file={}&stream=orders&group=payments\
         &timeout_ms=2000",
        redis.port,
        pki.ca.display(),
        password_file.display()
    );
    let err = RedisConsumer::connect(RedisConsumerConfig::from_url(&no_cert).unwrap())
        .await
        .unwrap_err()
        .to_string();
    assert!(!err.contains(&redis.password), "{err}");

    // Certificate files need rediss://.
    let plain = format!(
        "redis://{TLS_HOST}:{}?ca_file={}&stream=orders&group=payments",
        redis.port,
        pki.ca.display()
    );
    let err = RedisConsumerConfig::from_url(&plain)
        .unwrap_err()
        .to_string();
    assert!(err.contains("rediss://"), "{err}");
}
