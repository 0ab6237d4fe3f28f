//! Consumer URLs and options: typed errors for bad input before anything connects, and no
//! password in any of them. No server needed.

use std::time::Duration;

use outbox_consumer::kafka::KafkaConsumerConfig;
use outbox_consumer::nats::NatsConsumerConfig;
use outbox_consumer::redis::RedisConsumerConfig;
use outbox_consumer::Error;

fn invalid(result: Result<impl std::fmt::Debug, Error>, url: &str) -> String {
    match result {
        Err(Error::InvalidInput(text)) => {
            assert!(!text.contains("s3cret"), "{url}: password shown: {text}");
            text
        }
        other => panic!("{url}: expected InvalidInput, got {other:?}"),
    }
}

#[test]
fn nats_urls() {
    let c = NatsConsumerConfig::from_url(
        "nats://u:s3cret@127.0.0.1:4222?stream=S&consumer=c&subject=o.>&dead_subject=d.x\
         &dead_stream=&ack_wait_ms=2000&timeout_ms=100&batch=10&concurrency=2&max_attempts=7\
         &backoff_ms=5&max_backoff_ms=50&unavailable_budget_ms=60000",
    )
    .unwrap();
    // The credentials move to `security`, as the publisher keeps them.
    assert_eq!(c.url(), "nats://127.0.0.1:4222");
    assert_eq!(
        c.security().auth,
        outbox_consumer::nats::NatsAuth::UserPassword {
            user: "u".into(),
            password: "s3cret".into()
        }
    );
    assert_eq!(c.subject(), Some("o.>"));
    assert_eq!(c.dead_letter_subject(), "d.x");
    assert_eq!(c.dead_letter_stream(), None);
    assert_eq!(c.ack_wait(), Duration::from_secs(2));
    assert_eq!((c.options().batch, c.options().concurrency), (10, 2));
    assert_eq!(c.options().retry.max_attempts, 7);
    assert_eq!(c.options().retry.max_backoff, Duration::from_millis(50));
    assert_eq!(
        c.options().retry.unavailable_budget,
        Some(Duration::from_secs(60))
    );
    assert!(!format!("{c:?}").contains("s3cret"));
    for url in [
        "nats://u:s3cret@h:4222?stream=S&consumer=c&colour=red",
        "nats://u:s3cret@h:4222?consumer=c",
        "nats://u:s3cret@h:4222?stream=S",
        "nats://u:s3cret@h:4222?stream=S.x&consumer=c",
        "nats://u:s3cret@h:4222?stream=S&consumer=c&ack_wait_ms=1",
        "nats://u:s3cret@h:4222?stream=S&consumer=c&max_attempts=0",
        "nats://u:s3cret@h:4222?stream=S&consumer=c&batch=many",
        "redis://u:s3cret@h:4222?stream=S&consumer=c",
    ] {
        invalid(NatsConsumerConfig::from_url(url), url);
    }
    let text = invalid(
        NatsConsumerConfig::from_url("nats://h?stream=S&consumer=c&colour=red"),
        "",
    );
    assert!(
        text.contains("dead_subject") && text.contains("max_attempts"),
        "{text}"
    );
}

#[test]
fn redis_urls() {
    let c = RedisConsumerConfig::from_url(
        "rediss://:s3cret@h:6380/2?stream=s&group=g&consumer=me&dead_stream=dl&claim_idle_ms=500&block_ms=100",
    )
    .unwrap();
    assert_eq!(c.url(), "rediss://:s3cret@h:6380/2");
    assert_eq!((c.consumer(), c.dead_letter_stream()), ("me", "dl"));
    assert_eq!(c.claim_idle(), Duration::from_millis(500));
    assert!(!format!("{c:?}").contains("s3cret"));
    for url in [
        "redis://:s3cret@h?stream=s",
        "redis://:s3cret@h?group=g",
        "redis://:s3cret@h?stream=s&group=g&dead_stream=s",
        "redis://:s3cret@h?stream=s&group=g&claim_idle_ms=0",
        "redis://:s3cret@h?stream=s&group=g&colour=red",
        "redis://:s3cret@h?stream=s&group=g&concurrency=0",
        "nats://:s3cret@h?stream=s&group=g",
    ] {
        invalid(RedisConsumerConfig::from_url(url), url);
    }
}

#[test]
fn kafka_urls() {
    let c = KafkaConsumerConfig::from_url(
        "kafka://user:s3cret@h1:9092,h2:9093?topic=t&group=g&dead_topic=t-dlq&timeout_ms=500\
         &session.timeout.ms=6000&security.protocol=sasl_plaintext&sasl.mechanism=PLAIN",
    )
    .unwrap();
    assert_eq!(c.brokers(), "h1:9092,h2:9093");
    assert_eq!(c.dead_letter_topic(), "t-dlq");
    assert_eq!(c.properties()["sasl.username"], "user");
    assert_eq!(c.properties()["sasl.password"], "s3cret");
    assert!(!format!("{c:?}").contains("s3cret"));
    for url in [
        "kafka://user:s3cret@h:9092?group=g",
        "kafka://user:s3cret@h:9092?topic=t",
        "kafka://user:s3cret@h?topic=t&group=g",
        "kafka://user:s3cret@h:9092/x?topic=t&group=g",
        "kafka://user:s3cret@h:9092?topic=t&group=g&colour=red",
        "kafka://user:s3cret@h:9092?topic=t&group=g&dead_topic=t",
        "kafka://user:s3cret@h:9092?topic=t&group=g&enable.auto.commit=true",
        "kafka://user:s3cret@h:9092?topic=t&group=g&no.such.property=1",
        "nats://user:s3cret@h:9092?topic=t&group=g",
    ] {
        invalid(KafkaConsumerConfig::from_url(url), url);
    }
}

#[tokio::test]
async fn an_unknown_scheme_is_refused_before_connecting() {
    for url in [
        "amqp://u:s3cret@h:5672/x",
        "no-scheme",
        "kafka://h:9092?group=g",
    ] {
        invalid(outbox_consumer::Consumer::connect(url).await, url);
    }
}

/// Secrets from files, as the publishers take them: read when the URL is parsed, never shown.
#[test]
fn credential_files() {
    let dir = tempfile::tempdir().unwrap();
    let password = dir.path().join("pw");
    std::fs::write(&password, "s3cret\n").unwrap();
    let pw = password.display();

    let kafka = KafkaConsumerConfig::from_url(&format!(
        "kafka://app@h:9093?topic=t&group=g&security.protocol=SASL_SSL\
         &sasl.mechanism=SCRAM-SHA-256&password_file={pw}"
    ))
    .unwrap();
    assert_eq!(kafka.properties()["sasl.username"], "app");
    assert_eq!(kafka.properties()["sasl.password"], "s3cret");
    assert!(!format!("{kafka:?}").contains("s3cret"));
    let both = format!("kafka://app:pw@h:9093?topic=t&group=g&password_file={pw}");
    assert!(invalid(KafkaConsumerConfig::from_url(&both), &both).contains("give one"));

    let redis = RedisConsumerConfig::from_url(&format!(
        "redis://h:6379?stream=s&group=g&password_file={pw}"
    ))
    .unwrap();
    assert!(!format!("{redis:?}").contains("s3cret"));
    let both = format!("redis://:pw@h:6379?stream=s&group=g&password_file={pw}");
    assert!(invalid(RedisConsumerConfig::from_url(&both), &both).contains("give one"));

    let nats = NatsConsumerConfig::from_url(&format!(
        "nats://app@h:4222?stream=S&consumer=c&password_file={pw}"
    ))
    .unwrap();
    assert!(!format!("{nats:?}").contains("s3cret"));
    assert!(
        !nats.url().contains("app"),
        "the credentials leave the URL: {}",
        nats.url()
    );
    let two = format!("nats://h:4222?stream=S&consumer=c&token_file={pw}&nkey_file={pw}");
    assert!(invalid(NatsConsumerConfig::from_url(&two), &two).contains("more than one kind"));
    let no_key = format!("tls://h:4222?stream=S&consumer=c&cert_file={pw}");
    assert!(invalid(NatsConsumerConfig::from_url(&no_key), &no_key).contains("key_file"));

    for url in [
        "kafka://app@h:9093?topic=t&group=g&password_file=/nonexistent/pw",
        "redis://h:6379?stream=s&group=g&password_file=/nonexistent/pw",
        "nats://app@h:4222?stream=S&consumer=c&password_file=/nonexistent/pw",
    ] {
        let err = match url.split(':').next() {
            Some("kafka") => invalid(KafkaConsumerConfig::from_url(url), url),
            Some("redis") => invalid(RedisConsumerConfig::from_url(url), url),
            _ => invalid(NatsConsumerConfig::from_url(url), url),
        };
        assert!(err.contains("/nonexistent/pw cannot be read"), "{err}");
    }
}

/// The NATS builder runs the same checks as `from_url`, with the same messages, and its `Debug`
/// shows no password either.
#[test]
fn nats_builder_checks_every_setting() {
    let nats = || NatsConsumerConfig::builder("nats://u:s3cret@h:4222", "S", "c");
    let built = nats().subject("o.>").build().unwrap();
    assert_eq!((built.stream(), built.consumer()), ("S", "c"));
    assert_eq!(built.subject(), Some("o.>"));
    assert_eq!(built.dead_letter_stream(), Some("S_DEAD"));
    assert!(!format!("{:?}", nats()).contains("s3cret"));
    let text = invalid(
        nats().ack_wait(Duration::from_millis(5)).build(),
        "nats ack_wait",
    );
    assert!(text.contains("ack_wait"), "{text}");
    let text = invalid(
        NatsConsumerConfig::builder("nats://h", "S", "a.b").build(),
        "nats consumer",
    );
    assert!(text.contains("may not contain"), "{text}");
}

/// As `nats_builder_checks_every_setting`, for Redis.
#[test]
fn redis_builder_checks_every_setting() {
    let redis = || RedisConsumerConfig::builder("redis://:s3cret@h:6379", "s", "g");
    let built = redis().consumer("me").build().unwrap();
    assert_eq!((built.group(), built.consumer()), ("g", "me"));
    assert!(!format!("{:?}", redis()).contains("s3cret"));
    invalid(redis().dead_letter_stream("s").build(), "redis dead stream");
    invalid(
        redis().claim_idle(Duration::ZERO).build(),
        "redis claim_idle",
    );
    invalid(redis().consumer("").build(), "redis consumer");
}

/// As `nats_builder_checks_every_setting`, for Kafka.
#[test]
fn kafka_builder_checks_every_setting() {
    let kafka = || KafkaConsumerConfig::builder("h:9092", "t", "g");
    let built = kafka().property("sasl.password", "s3cret").build().unwrap();
    assert_eq!(built.properties()["sasl.password"], "s3cret");
    assert!(!format!("{built:?}").contains("s3cret"));
    invalid(kafka().dead_letter_topic("t").build(), "kafka dead topic");
    invalid(kafka().timeout(Duration::ZERO).build(), "kafka timeout");
    invalid(
        kafka().property("group.id", "x").build(),
        "kafka own property",
    );
}
