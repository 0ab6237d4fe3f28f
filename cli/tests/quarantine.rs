//! Rows that cannot become messages (written by plain SQL with an id that is not a UUID,
//! headers that are valid JSON but not an object of strings, a payload that is not text),
//! interleaved with good rows and relayed by `outbox-relay drain` into NATS JetStream: every
//! good row is published, every bad one is dead with a reason naming its column, and under the
//! default head policy (`block`) a good row behind a bad one of its key waits. `dead list`
//! shows the bad rows (ids that are not UUIDs as stored) and `drain`'s summary counts them
//! dead. A requeue of a row that still does not decode is refused alike by id, by seq and in
//! bulk (what is wrong, and the UPDATE that fixes it; nothing requeued), and goes through once
//! the row is fixed; discard takes them by id or by seq.

use outbox::NewMessage;
use outbox_conformance_tests::env::service_url;
use outbox_e2e::{nats, unique_suffix};
use serde_json::json;
use uuid::Uuid;

// Not every shared helper is used here.
#[allow(dead_code)]
mod common;
use common::{json_lines, message, run, BoxError};

type TestResult = Result<(), BoxError>;

/// The key of the bad rows; a good row of it comes after them and must wait (Block).
const POISONED_KEY: &str = "poisoned";

/// The good rows, in three groups the bad rows go between, and the good row behind the bad
/// ones of [`POISONED_KEY`].
fn good_rows() -> (Vec<Vec<NewMessage>>, NewMessage) {
    let groups = (0..3)
        .map(|g| (g * 3..g * 3 + 3).map(|n| message(n, 3)).collect())
        .collect();
    let held = message(100, 3).with_partition_key(POISONED_KEY);
    (groups, held)
}

/// Drain `store_args` into a fresh JetStream stream; the ids it holds, in order.
async fn drain_into_nats(store_args: &[&str], nats_url: &str) -> Result<Vec<String>, BoxError> {
    let suffix = unique_suffix();
    let stream = format!("QUARANTINE_{suffix}");
    let subject = format!("quarantine{suffix}");
    let broker = format!(
        "{nats_url}?subject={subject}.{{event_type}}&stream={stream}&create_stream=true\
         &stream_subjects={subject}.>"
    );
    let out = run(&[store_args, &["drain", "--broker", &broker]].concat()).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "drain failed: {stderr}");
    assert!(
        stderr.contains("does not decode"),
        "each quarantined row is logged: {stderr}"
    );
    // The closing summary counts the rows the store dead-lettered during its claims.
    let summary: serde_json::Value = stderr
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .ok_or_else(|| format!("no summary: {stderr}"))?;
    assert_eq!(summary["dead"], 3, "{summary}");
    let ids = nats::read_stream(nats_url, &stream)
        .await?
        .into_iter()
        .map(|r| r.id)
        .collect();
    nats::delete_stream(nats_url, &stream).await?;
    Ok(ids)
}

/// What every backend must show after the drain: the good rows published in key order, the held
/// one pending, and exactly the bad rows dead, each with a reason naming its column and value.
async fn check(
    store_args: &[&str],
    published: Vec<String>,
    good: &[Vec<NewMessage>],
    dead: Vec<(i64, String)>,
    expected: &[(&str, &str)],
    raw_id: Option<&str>,
    fix_headers: impl AsyncFnOnce(i64) -> TestResult,
) -> TestResult {
    // Per-key order: keys may interleave differently (Postgres claims two shards of the keys
    // side by side by default).
    let of_key = |ids: &[String], key: &Option<String>| -> Vec<String> {
        ids.iter()
            .filter(|id| {
                good.iter()
                    .flatten()
                    .any(|m| m.id.to_string() == **id && m.partition_key == *key)
            })
            .cloned()
            .collect()
    };
    let want: Vec<String> = good.iter().flatten().map(|m| m.id.to_string()).collect();
    let mut sorted = published.clone();
    sorted.sort();
    let mut want_sorted = want.clone();
    want_sorted.sort();
    assert_eq!(sorted, want_sorted, "every good row published once");
    for key in good.iter().flatten().map(|m| &m.partition_key) {
        assert_eq!(
            of_key(&published, key),
            of_key(&want, key),
            "key {key:?} in order"
        );
    }
    assert_eq!(dead.len(), expected.len(), "{dead:?}");
    for ((_, reason), (column, value)) in dead.iter().zip(expected) {
        assert!(
            reason.contains(&format!("column {column}")) && reason.contains(value),
            "reason {reason:?} should name column {column} and value {value}"
        );
    }
    let counts = json_lines(&[store_args, &["counts"]].concat()).await?;
    assert_eq!(
        counts,
        [json!({
            "pending": 1, "leased": 0, "published": want.len(), "dead": expected.len()
        })],
        "the good row behind the bad ones of its key waits; nothing else changed"
    );

    // Operators see every quarantined row, ids that are not UUIDs included, and act by seq.
    let listed = json_lines(&[store_args, &["dead", "list", "--json"]].concat()).await?;
    let seqs: Vec<i64> = listed.iter().filter_map(|d| d["seq"].as_i64()).collect();
    assert_eq!(
        seqs,
        dead.iter().map(|(seq, _)| *seq).collect::<Vec<_>>(),
        "{listed:?}"
    );
    for (d, (_, reason)) in listed.iter().zip(&dead) {
        assert_eq!(d["last_error"].as_str(), Some(reason.as_str()));
        assert!(d["id"].as_str().is_some_and(|id| !id.is_empty()), "{d}");
    }
    if let Some(raw_id) = raw_id {
        assert_eq!(listed[0]["id"], raw_id, "the stored id is shown as it is");
    }
    let seq = |n: usize| seqs[n].to_string();
    // Row 1 has a UUID id on every store, and bad headers: requeued by id or by seq, it is
    // refused alike, with what is wrong and how to fix it, and nothing is requeued.
    let id_1 = listed[1]["id"].as_str().ok_or("no id")?.to_owned();
    for how in [vec![id_1.as_str()], vec!["--seq", &seq(1)]] {
        let out = run(&[store_args, &["dead", "requeue"], &how].concat()).await?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "requeue {how:?} of a bad row: {stderr}"
        );
        assert!(
            stderr.contains("invalid input: requeue refused, nothing requeued")
                && stderr.contains(&format!("seq {}: column headers", seq(1)))
                && stderr.contains(&format!("SET headers = ... WHERE seq = {}", seq(1)))
                && !stderr.contains("CONSTRAINT"),
            "requeue {how:?}: {stderr}"
        );
    }
    // In bulk, every row is tried; the ones still bad are left dead and named.
    let out = run(&[store_args, &["dead", "requeue", "--all", "--yes"]].concat()).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("3 dead message(s) still cannot be relayed"),
        "{stderr}"
    );
    assert_eq!(
        String::from_utf8(out.stdout)?.trim(),
        r#"{"refused":3,"requeued":0}"#
    );
    let unchanged = json!({
        "pending": 1, "leased": 0, "published": want.len(), "dead": expected.len()
    });
    let counts = json_lines(&[store_args, &["counts"]].concat()).await?;
    assert_eq!(counts, [unchanged], "a refused requeue changes nothing");

    // Fixed with SQL, the row is requeued by id.
    fix_headers(seqs[1]).await?;
    let requeued = json_lines(&[store_args, &["dead", "requeue", &id_1]].concat()).await?;
    assert_eq!(requeued, [json!({"requeued": 1})]);
    // Discarded by seq and by id alike, fixed or not.
    let id_2 = listed[2]["id"].as_str().ok_or("no id")?;
    let discarded = json_lines(
        &[
            store_args,
            &["dead", "discard", id_2, "--seq", &seq(0), "--seq", &seq(1)],
        ]
        .concat(),
    )
    .await?;
    assert_eq!(
        discarded,
        [json!({"discarded": 2})],
        "the requeued row is no longer dead"
    );
    let counts = json_lines(&[store_args, &["counts"]].concat()).await?;
    assert_eq!(
        counts,
        [json!({"pending": 2, "leased": 0, "published": want.len(), "dead": 0})]
    );
    Ok(())
}

#[tokio::test]
async fn postgres_quarantines_rows_with_bad_headers() -> TestResult {
    let (Some(pg_url), Some(nats_url)) = (
        service_url("OUTBOX_TEST_POSTGRES_URL"),
        service_url("OUTBOX_TEST_NATS_URL"),
    ) else {
        return Ok(());
    };
    let schema = format!("quarantine_{}", unique_suffix());
    let store_args = ["--store", pg_url.as_str(), "--schema", schema.as_str()];
    let migrated = run(&[&store_args[..], &["migrate"]].concat()).await?;
    assert!(migrated.status.success(), "{migrated:?}");
    let config = outbox::postgres::PostgresConfig::builder()
        .schema(schema.clone())
        .build()?;
    let table = config.qualified_table().to_owned();
    let pool = sqlx::PgPool::connect(&pg_url).await?;
    // The id column is a uuid and state has a CHECK: headers are what plain SQL can get wrong.
    let bad = [r#"{"n": 1}"#, "[1]", r#""text""#];
    let insert_bad = format!(
        "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload, headers, \
         partition_key) VALUES (gen_random_uuid(), 'order', 'o', 'order.placed', '{{}}', \
         $1::jsonb, $2)"
    );
    // A new table refuses such headers...
    for headers in bad {
        let refused = sqlx::query(&insert_bad)
            .bind(headers)
            .bind(POISONED_KEY)
            .execute(&pool)
            .await
            .expect_err("a new table refuses headers that are not an object of strings");
        assert!(refused.to_string().contains("headers_check"), "{refused}");
    }
    // ...a table made before the check does not: drop it to stand for one.
    let constraint: String = sqlx::query_scalar(&format!(
        "SELECT conname::text FROM pg_constraint WHERE conrelid = '{table}'::regclass \
         AND conname::text LIKE '%headers_check%'"
    ))
    .fetch_one(&pool)
    .await?;
    sqlx::query(&format!(
        "ALTER TABLE {table} DROP CONSTRAINT \"{constraint}\""
    ))
    .execute(&pool)
    .await?;
    let (good, held) = good_rows();
    for (group, headers) in good.iter().zip(bad) {
        let mut tx = pool.begin().await?;
        outbox::postgres::enqueue_batch(&mut *tx, &config, group).await?;
        tx.commit().await?;
        sqlx::query(&insert_bad)
            .bind(headers)
            .bind(POISONED_KEY)
            .execute(&pool)
            .await?;
    }
    outbox::postgres::enqueue_batch(&pool, &config, std::slice::from_ref(&held)).await?;

    let published = drain_into_nats(&store_args, &nats_url).await?;
    let dead: Vec<(i64, String)> = sqlx::query_as(&format!(
        "SELECT seq, last_error FROM {table} WHERE state = 'dead' ORDER BY seq"
    ))
    .fetch_all(&pool)
    .await?;
    let expected = [
        ("headers", r#"{\"n\": 1}"#),
        ("headers", "[1]"),
        ("headers", r#"\"text\""#),
    ];
    let fix = async |seq: i64| -> TestResult {
        sqlx::query(&format!(
            "UPDATE {table} SET headers = '{{}}' WHERE seq = $1"
        ))
        .bind(seq)
        .execute(&pool)
        .await?;
        Ok(())
    };
    check(&store_args, published, &good, dead, &expected, None, fix).await?;
    sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .execute(&pool)
        .await?;
    Ok(())
}

#[tokio::test]
async fn mariadb_quarantines_rows_with_bad_ids_and_headers() -> TestResult {
    let (Some(my_url), Some(nats_url)) = (
        service_url("OUTBOX_TEST_MYSQL_URL"),
        service_url("OUTBOX_TEST_NATS_URL"),
    ) else {
        return Ok(());
    };
    let table = format!("quarantine_{}", unique_suffix());
    let store_args = ["--store", my_url.as_str(), "--table", table.as_str()];
    let migrated = run(&[&store_args[..], &["migrate"]].concat()).await?;
    assert!(migrated.status.success(), "{migrated:?}");
    let config = outbox::mysql::MysqlConfig::builder()
        .table(table.clone())
        .build()?;
    let pool = sqlx::MySqlPool::connect(&my_url).await?;
    let bad = [
        ("not-a-uuid", "{}"),
        (&*Uuid::new_v4().to_string(), r#"{"n": 1}"#),
        (&*Uuid::new_v4().to_string(), "[1]"),
    ];
    let insert = "INSERT INTO `{table}` (id, aggregatetype, aggregateid, type, payload, headers, \
                  partition_key) VALUES (?, 'order', 'o', 'order.placed', '{}', ?, ?)"
        .replace("{table}", &table);
    // A new table refuses such ids and headers that are not objects of strings...
    for (id, headers) in bad {
        let refused = sqlx::query(&insert)
            .bind(id)
            .bind(headers)
            .bind(POISONED_KEY)
            .execute(&pool)
            .await
            .expect_err(
                "a new table refuses ids that are not UUIDs and headers not objects of strings",
            );
        assert!(refused.to_string().contains("CONSTRAINT"), "{refused}");
    }
    // ...a table made before the checks does not: skip them to stand for one.
    let (good, held) = good_rows();
    for (group, (id, headers)) in good.iter().zip(bad) {
        let mut tx = pool.begin().await?;
        outbox::mysql::enqueue_batch(&mut *tx, &config, group).await?;
        tx.commit().await?;
        sqlx::query(&format!(
            "SET STATEMENT check_constraint_checks = 0 FOR {insert}"
        ))
        .bind(id)
        .bind(headers)
        .bind(POISONED_KEY)
        .execute(&pool)
        .await?;
    }
    outbox::mysql::enqueue_batch(&pool, &config, std::slice::from_ref(&held)).await?;

    let published = drain_into_nats(&store_args, &nats_url).await?;
    let dead: Vec<(i64, String)> = sqlx::query_as(&format!(
        "SELECT seq, CAST(last_error AS CHAR) FROM `{table}` WHERE state = 'dead' ORDER BY seq"
    ))
    .fetch_all(&pool)
    .await?;
    let expected = [
        ("id", "not-a-uuid"),
        ("headers", r#"{\"n\": 1}"#),
        ("headers", "[1]"),
    ];
    let fix = async |seq: i64| -> TestResult {
        sqlx::query(&format!(
            "UPDATE `{table}` SET headers = '{{}}' WHERE seq = ?"
        ))
        .bind(seq)
        .execute(&pool)
        .await?;
        Ok(())
    };
    check(
        &store_args,
        published,
        &good,
        dead,
        &expected,
        Some("not-a-uuid"),
        fix,
    )
    .await?;
    sqlx::query(&format!("DROP TABLE `{table}`"))
        .execute(&pool)
        .await?;
    Ok(())
}

#[tokio::test]
async fn sqlite_quarantines_rows_with_bad_ids_headers_and_payloads() -> TestResult {
    let Some(nats_url) = service_url("OUTBOX_TEST_NATS_URL") else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("outbox.sqlite");
    let store = format!("sqlite://{}", path.display());
    let store_args = ["--store", store.as_str()];
    let config = outbox::sqlite::SqliteConfig::default();
    let mut conn = outbox::sqlite::open_connection(&path, &config)?;
    outbox::sqlite::migrate(&conn, &config)?;
    // SQLite takes anything: an integer id, headers that are not JSON, a BLOB payload.
    let bad = [
        "42, 'order', 'o', 'order.placed', '{}', '{}'",
        "'b1d6c1e0-0000-4000-8000-000000000001', 'order', 'o', 'order.placed', '{}', 'not json'",
        "'b1d6c1e0-0000-4000-8000-000000000002', 'order', 'o', 'order.placed', X'FF00', '{}'",
    ];
    let insert = |values: &str| {
        format!(
            "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers, \
             partition_key) VALUES ({values}, '{POISONED_KEY}')"
        )
    };
    // A new table refuses such rows...
    for values in bad {
        let refused = conn
            .execute(&insert(values), [])
            .expect_err("a new table refuses what the relay cannot read");
        assert!(refused.to_string().contains("CHECK"), "{refused}");
    }
    // ...a table made before the checks does not: skip them to stand for one.
    conn.execute_batch("PRAGMA ignore_check_constraints = ON")?;
    let (good, held) = good_rows();
    for (group, values) in good.iter().zip(bad) {
        let tx = conn.transaction()?;
        outbox::sqlite::enqueue_batch(&tx, &config, group)?;
        tx.commit()?;
        conn.execute(&insert(values), [])?;
    }
    let tx = conn.transaction()?;
    outbox::sqlite::enqueue_batch(&tx, &config, std::slice::from_ref(&held))?;
    tx.commit()?;

    let published = drain_into_nats(&store_args, &nats_url).await?;
    let dead: Vec<(i64, String)> = conn
        .prepare("SELECT seq, last_error FROM outbox WHERE state = 'dead' ORDER BY seq")?
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
        .collect::<Result<_, _>>()?;
    let expected = [
        ("id", "42"),
        ("headers", "not json"),
        ("payload", "payload"),
    ];
    let fix = async |seq: i64| -> TestResult {
        conn.execute("UPDATE outbox SET headers = '{}' WHERE seq = ?1", [seq])?;
        Ok(())
    };
    check(
        &store_args,
        published,
        &good,
        dead,
        &expected,
        Some("42"),
        fix,
    )
    .await?;
    Ok(())
}
