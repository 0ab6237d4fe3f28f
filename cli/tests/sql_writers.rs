//! The SQL enqueue contract (README, "Writing from any language (SQL)") as a service in another
//! language meets it: rows written by the databases' own command-line clients (`psql`, the
//! `mariadb` client, the `sqlite3` shell), which no one here wrote, with the minimal INSERT and
//! its variants (explicit key, unordered, headers, ids in upper and mixed case), relayed by `outbox-relay drain` to
//! `stdout://` and read back: ids are UUIDs made by the database, partition keys as documented,
//! headers as written, each key's messages in insert order. Bad values are refused by the
//! database. Each table is first made by the previous release's migration (kept as
//! `fixtures/previous-*.sql`) with rows written the old way, and `outbox-relay migrate`
//! upgrades it in place (twice: it is idempotent) keeping those rows (an old row's upper-case
//! id is lowered, so it is completed). Every row ends `published`: none is left leased to go
//! out again.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;

use outbox_conformance_tests::env::{service_url, services_required};
use outbox_e2e::unique_suffix;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;
use uuid::Uuid;

// Not every shared helper is used here.
#[allow(dead_code)]
mod common;
use common::{json_lines, run, BoxError, GUARD};

type TestResult = Result<(), BoxError>;

/// The previous release's migrations for the default table (`outbox` at commit 177cefe).
const PREVIOUS_POSTGRES: &str = include_str!("fixtures/previous-postgres.sql");
const PREVIOUS_MARIADB: &str = include_str!("fixtures/previous-mariadb.sql");
const PREVIOUS_SQLITE: &str = include_str!("fixtures/previous-sqlite.sql");

/// Ids of the rows written the old way, before the upgrade.
const LEGACY_KEYED: &str = "0b1e5a52-6c0e-4b8e-9d7e-6d1c2a000001";
const LEGACY_UNORDERED: &str = "0b1e5a52-6c0e-4b8e-9d7e-6d1c2a000002";
/// The newest old row, deleted before the upgrade: its seq (3) is never handed out again.
const LEGACY_PURGED: &str = "0b1e5a52-6c0e-4b8e-9d7e-6d1c2a000003";

/// A trace context header, as a service would pass it on.
const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// A database's command-line client: SQL goes to its standard input.
struct Client {
    program: &'static str,
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
}

impl Client {
    /// Whether the program is installed; when it is not, the test skips (fails under
    /// `OUTBOX_REQUIRE_SERVICES=1`).
    async fn installed(program: &str) -> bool {
        let found = Command::new(program)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .await
            .is_ok_and(|out| out.status.success());
        if !found {
            assert!(
                !services_required(),
                "{program} is not installed but OUTBOX_REQUIRE_SERVICES=1"
            );
            eprintln!("skipped: {program} is not installed");
        }
        found
    }

    /// Run `sql`: its standard output when the client succeeded, its standard error as the
    /// `Err` when it failed (the database refused the statement).
    async fn run(&self, sql: &str) -> Result<Result<String, String>, BoxError> {
        let mut child = Command::new(self.program)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let mut stdin = child.stdin.take().ok_or("no stdin")?;
        stdin.write_all(sql.as_bytes()).await?;
        drop(stdin);
        let out = tokio::time::timeout(GUARD, child.wait_with_output()).await??;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        Ok(if out.status.success() {
            Ok(stdout)
        } else {
            Err(stderr)
        })
    }

    /// Run `sql`, which must succeed.
    async fn ok(&self, sql: &str) -> Result<String, BoxError> {
        self.run(sql)
            .await?
            .map_err(|stderr| format!("{} refused {sql:?}: {stderr}", self.program).into())
    }

    /// Run `sql`, which the database must refuse; its error mentions one of `words`.
    async fn refused(&self, sql: &str, words: &[&str]) -> TestResult {
        match self.run(sql).await? {
            Ok(_) => Err(format!("{} accepted {sql:.200}", self.program).into()),
            Err(stderr) if words.iter().any(|w| stderr.contains(w)) => Ok(()),
            Err(stderr) => {
                Err(format!("{sql:.200} refused with {stderr}; expected {words:?}").into())
            }
        }
    }
}

/// One database under test.
struct Db {
    client: Client,
    /// The table as the SQL names it.
    table: String,
    /// `--store ...` (and `--schema`/`--table`) for `outbox-relay`.
    store_args: Vec<String>,
    /// The version of the UUIDs the database makes for `id`.
    uuid_version: usize,
    /// The words of the database's refusals.
    refusal: &'static [&'static str],
    /// An INSERT of a payload over the 1 MiB limit, when the database checks the size.
    too_large: Option<String>,
}

impl Db {
    fn args<'a>(&'a self, more: &[&'a str]) -> Vec<&'a str> {
        self.store_args
            .iter()
            .map(String::as_str)
            .chain(more.iter().copied())
            .collect()
    }

    /// `outbox-relay migrate`, which must succeed.
    async fn migrate(&self) -> TestResult {
        let out = run(&self.args(&["migrate"])).await?;
        assert!(
            out.status.success(),
            "migrate: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }
}

/// The rows a service writes with plain SQL, in this order: `(n, INSERT)`. The payload of row
/// `n` is `{"n": n}`.
fn writes(t: &str) -> Vec<(u32, String)> {
    let cols = "(aggregatetype, aggregateid, type, payload";
    vec![
        // The minimal statement: the key is the aggregate id.
        (
            1,
            format!("INSERT INTO {t} {cols}) VALUES ('order', 'order-1', 'order.placed', '{{\"n\": 1}}');"),
        ),
        (
            2,
            format!("INSERT INTO {t} {cols}) VALUES ('order', 'order-1', 'order.paid', '{{\"n\": 2}}');"),
        ),
        // An explicit key.
        (
            3,
            format!(
                "INSERT INTO {t} {cols}, partition_key) \
                 VALUES ('order', 'order-2', 'order.placed', '{{\"n\": 3}}', 'customer-7');"
            ),
        ),
        // Unordered: the empty key.
        (
            4,
            format!(
                "INSERT INTO {t} {cols}, partition_key) \
                 VALUES ('order', 'order-3', 'order.placed', '{{\"n\": 4}}', '');"
            ),
        ),
        // Headers, and an id the writer made.
        (
            5,
            format!(
                "INSERT INTO {t} {cols}, headers) VALUES ('order', 'order-1', 'order.shipped', \
                 '{{\"n\": 5}}', '{{\"tenant\": \"acme\", \"traceparent\": \"{TRACEPARENT}\"}}');"
            ),
        ),
        // Ids the writer made, in upper and in mixed case: each published once, and completed.
        (
            6,
            format!(
                "INSERT INTO {t} (id, {}) VALUES ('{UPPER_ID}', 'order', 'order-4', 'order.placed', \
                 '{{\"n\": 6}}');",
                &cols[1..]
            ),
        ),
        (
            7,
            format!(
                "INSERT INTO {t} (id, {}) VALUES ('{MIXED_ID}', 'order', 'order-4', 'order.paid', \
                 '{{\"n\": 7}}');",
                &cols[1..]
            ),
        ),
    ]
}

/// Ids a writer made in upper and in mixed case (rows 6 and 7).
const UPPER_ID: &str = "BF3D6C4D-09A7-46F2-9F2F-5F7372B91D29";
const MIXED_ID: &str = "bf3d6c4d-09A7-46f2-9F2F-5f7372b91d2a";

/// Values the contract says the database refuses.
fn bad_writes(t: &str) -> Vec<String> {
    let cols = "aggregatetype, aggregateid, type, payload";
    vec![
        format!(
            "INSERT INTO {t} ({cols}, headers) VALUES ('o', 'o', 't', '{{}}', '{{\"n\": 1}}');"
        ),
        format!("INSERT INTO {t} ({cols}, headers) VALUES ('o', 'o', 't', '{{}}', '[\"a\"]');"),
        format!("INSERT INTO {t} ({cols}) VALUES ('o', 'o', 't', 'not json');"),
        format!("INSERT INTO {t} (id, {cols}) VALUES ('not-a-uuid', 'o', 'o', 't', '{{}}');"),
    ]
}

/// Write the legacy rows the old way (the previous release had no id default, and NULL meant
/// unordered), upgrade, write the contract's rows and the refused ones, drain, check.
async fn exercise(db: &Db, legacy: Option<String>) -> TestResult {
    let t = &db.table;
    let mut expected_legacy = 0;
    if let Some(legacy) = legacy {
        db.client.ok(&legacy).await?;
        expected_legacy = 2;
        db.migrate().await?;
        db.migrate().await?;
    }
    for (_, insert) in writes(t) {
        db.client.ok(&insert).await?;
    }
    for insert in bad_writes(t) {
        db.client.refused(&insert, db.refusal).await?;
    }
    if let Some(insert) = &db.too_large {
        db.client.refused(insert, db.refusal).await?;
    }

    let lines = json_lines(db.args(&["drain", "--broker", "stdout://"])).await?;
    assert_eq!(
        lines.len(),
        expected_legacy + writes(t).len(),
        "every written row is relayed once and no refused one: {lines:?}"
    );
    let by_n: BTreeMap<u64, (usize, &Value)> = lines
        .iter()
        .enumerate()
        .filter_map(|(pos, line)| Some((line["payload"]["n"].as_u64()?, (pos, line))))
        .collect();
    assert_eq!(by_n.len(), writes(t).len(), "{lines:?}");
    for (n, (_, line)) in &by_n {
        let id = line["id"].as_str().ok_or("no id")?;
        match n {
            6 => assert_eq!(id, UPPER_ID.to_lowercase(), "row {n}"),
            7 => assert_eq!(id, MIXED_ID.to_lowercase(), "row {n}"),
            _ => assert_eq!(
                Uuid::parse_str(id)?.get_version_num(),
                db.uuid_version,
                "row {n}: the database's UUID {id}"
            ),
        }
        let key = match n {
            1 | 2 | 5 => json!("order-1"),
            3 => json!("customer-7"),
            6 | 7 => json!("order-4"),
            _ => Value::Null,
        };
        assert_eq!(line["partition_key"], key, "row {n}: {line}");
        let headers = if *n == 5 {
            json!({"tenant": "acme", "traceparent": TRACEPARENT})
        } else {
            json!({})
        };
        assert_eq!(line["headers"], headers, "row {n}: {line}");
    }
    let ids: Vec<&str> = by_n
        .values()
        .filter_map(|(_, l)| l["id"].as_str())
        .collect();
    let distinct: std::collections::HashSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len(), "every id is new: {ids:?}");
    // seq follows insert order; one key's messages are published in that order.
    let seqs: Vec<i64> = by_n
        .values()
        .filter_map(|(_, l)| l["seq"].as_i64())
        .collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    if expected_legacy > 0 {
        assert!(
            seqs[0] > 3,
            "the purged old row's seq is not reused: {seqs:?}"
        );
    }
    let order_1: Vec<usize> = [1, 2, 5].iter().map(|n| by_n[n].0).collect();
    assert!(order_1.windows(2).all(|w| w[0] < w[1]), "{lines:?}");

    if expected_legacy > 0 {
        let legacy: BTreeMap<&str, &Value> = lines
            .iter()
            .filter_map(|l| Some((l["id"].as_str()?, &l["partition_key"])))
            .filter(|(id, _)| [LEGACY_KEYED, LEGACY_UNORDERED].contains(id))
            .collect();
        assert_eq!(
            legacy,
            BTreeMap::from([
                (LEGACY_KEYED, &json!("legacy")),
                (LEGACY_UNORDERED, &Value::Null)
            ]),
            "rows of the old table are kept as they were: {lines:?}"
        );
    }
    let counts = json_lines(db.args(&["counts"])).await?;
    assert_eq!(
        counts,
        [json!({"pending": 0, "leased": 0, "published": lines.len(), "dead": 0})]
    );
    Ok(())
}

/// The rows written the old way into `t` (seqs 1 to 3): an explicit id each, one with a key,
/// one unordered (NULL), and one deleted again; `times` adds explicit times where the old
/// defaults do not work.
fn legacy_rows(t: &str, times: Option<&str>) -> String {
    let (cols, vals) = match times {
        Some(now) => (", available_at, created_at", format!(", {now}, {now}")),
        None => ("", String::new()),
    };
    let insert = |id: &str, n: u32, key: &str| {
        format!(
            "INSERT INTO {t} (id, aggregatetype, aggregateid, type, payload, partition_key{cols}) \
             VALUES ('{id}', 'order', 'legacy-{n}', 'order.placed', '{{\"old\": {n}}}', \
                     {key}{vals});\n"
        )
    };
    [
        // In upper case: `migrate` lowers it (Postgres' uuid type already does).
        insert(&LEGACY_KEYED.to_uppercase(), 1, "'legacy'"),
        insert(LEGACY_UNORDERED, 2, "NULL"),
        insert(LEGACY_PURGED, 3, "'legacy'"),
        format!("DELETE FROM {t} WHERE id = '{LEGACY_PURGED}';\n"),
    ]
    .concat()
}

/// A fresh schema of the Postgres server, and `psql` on it; `None` (skip) without the server
/// or the program.
async fn postgres_db() -> Option<(Db, String)> {
    let url = service_url("OUTBOX_TEST_POSTGRES_URL")?;
    if !Client::installed("psql").await {
        return None;
    }
    let schema = format!("sqlw_{}", unique_suffix());
    let db = Db {
        client: Client {
            program: "psql",
            args: ["-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-d", &url]
                .map(String::from)
                .to_vec(),
            env: vec![],
        },
        table: format!("\"{schema}\".\"outbox\""),
        store_args: vec![
            "--store".into(),
            url.clone(),
            "--schema".into(),
            schema.clone(),
        ],
        uuid_version: 4,
        refusal: &[
            "violates check constraint",
            "invalid input syntax for type json",
            "invalid input syntax for type uuid",
        ],
        // jsonb keeps no text to measure: see the README's columns table.
        too_large: None,
    };
    Some((db, schema))
}

#[tokio::test]
async fn psql_writes_with_the_minimal_insert_into_a_new_table() -> TestResult {
    let Some((db, schema)) = postgres_db().await else {
        return Ok(());
    };
    db.migrate().await?;
    let result = exercise(&db, None).await;
    db.client
        .ok(&format!("DROP SCHEMA \"{schema}\" CASCADE;"))
        .await?;
    result
}

#[tokio::test]
async fn psql_writes_with_the_minimal_insert_into_an_upgraded_table() -> TestResult {
    let Some((db, schema)) = postgres_db().await else {
        return Ok(());
    };
    let previous = PREVIOUS_POSTGRES
        .replace("\"public\"", &format!("\"{schema}\""))
        .replace("'public'", &format!("'{schema}'"));
    db.client.ok(&previous).await?;
    let result = exercise(&db, Some(legacy_rows(&db.table, None))).await;
    db.client
        .ok(&format!("DROP SCHEMA \"{schema}\" CASCADE;"))
        .await?;
    result
}

/// A fresh table name on the MariaDB server, and the `mariadb` client; `None` (skip) without
/// the server or the program.
async fn mariadb_db() -> Result<Option<Db>, BoxError> {
    let Some(url) = service_url("OUTBOX_TEST_MYSQL_URL") else {
        return Ok(None);
    };
    if !Client::installed("mariadb").await {
        return Ok(None);
    }
    let parsed = url::Url::parse(&url)?;
    let table = format!("sqlw_{}", unique_suffix());
    let args = vec![
        "--batch".to_owned(),
        "--skip-column-names".to_owned(),
        "--protocol=TCP".to_owned(),
        format!("--host={}", parsed.host_str().unwrap_or("127.0.0.1")),
        format!("--port={}", parsed.port().unwrap_or(3306)),
        format!("--user={}", parsed.username()),
        parsed.path().trim_start_matches('/').to_owned(),
    ];
    Ok(Some(Db {
        client: Client {
            program: "mariadb",
            args,
            // The password, if any, stays out of the process list.
            env: parsed
                .password()
                .map(|p| ("MYSQL_PWD", p.to_owned()))
                .into_iter()
                .collect(),
        },
        table: format!("`{table}`"),
        store_args: vec![
            "--store".into(),
            url.clone(),
            "--table".into(),
            table.clone(),
        ],
        uuid_version: 7,
        refusal: &["CONSTRAINT"],
        too_large: Some(format!(
            "INSERT INTO `{table}` (aggregatetype, aggregateid, type, payload) \
             VALUES ('o', 'o', 't', CONCAT('\"', REPEAT('a', 1048576), '\"'));"
        )),
    }))
}

#[tokio::test]
async fn mariadb_client_writes_with_the_minimal_insert_into_a_new_table() -> TestResult {
    let Some(db) = mariadb_db().await? else {
        return Ok(());
    };
    db.migrate().await?;
    let result = exercise(&db, None).await;
    db.client.ok(&format!("DROP TABLE {};", db.table)).await?;
    result
}

#[tokio::test]
async fn mariadb_client_writes_with_the_minimal_insert_into_an_upgraded_table() -> TestResult {
    let Some(mut db) = mariadb_db().await? else {
        return Ok(());
    };
    // Not added to older tables: see the README's columns table.
    db.too_large = None;
    db.client
        .ok(&PREVIOUS_MARIADB.replace("`outbox`", &db.table))
        .await?;
    let result = exercise(&db, Some(legacy_rows(&db.table, None))).await;
    db.client.ok(&format!("DROP TABLE {};", db.table)).await?;
    result
}

/// A SQLite database file's client: the `sqlite3` shell.
fn sqlite_db(path: &Path) -> Db {
    Db {
        client: Client {
            program: "sqlite3",
            args: vec!["-bail".into(), path.display().to_string()],
            env: vec![],
        },
        table: "outbox".into(),
        store_args: vec!["--store".into(), format!("sqlite://{}", path.display())],
        // The table's default id is time-ordered, like the Rust enqueue's.
        uuid_version: 7,
        refusal: &["CHECK constraint failed"],
        too_large: Some(
            "INSERT INTO outbox (aggregatetype, aggregateid, type, payload) \
             VALUES ('o', 'o', 't', '\"' || hex(zeroblob(524288)) || '\"');"
                .into(),
        ),
    }
}

#[tokio::test]
async fn sqlite3_shell_writes_with_the_minimal_insert_into_an_upgraded_table() -> TestResult {
    if !Client::installed("sqlite3").await {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let db = sqlite_db(&dir.path().join("outbox.sqlite"));
    db.client.ok(PREVIOUS_SQLITE).await?;
    // The old defaults need SQLite 3.42 (`unixepoch('now', 'subsec')`): old writers gave times.
    let now = "CAST(strftime('%s', 'now') AS INTEGER) * 1000";
    exercise(&db, Some(legacy_rows("outbox", Some(now)))).await
}

#[tokio::test]
async fn sqlite3_shell_creates_the_table_and_writes_with_the_minimal_insert() -> TestResult {
    if !Client::installed("sqlite3").await {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let db = sqlite_db(&dir.path().join("outbox.sqlite"));
    // The migration as the shell runs it (the machine's is older than the bundled SQLite).
    let version = db.client.ok("SELECT sqlite_version();").await?;
    eprintln!("sqlite3 shell: SQLite {}", version.trim());
    let ddl = outbox::sqlite::SqliteConfig::default().migration_sql();
    db.client.ok(&ddl).await?;
    exercise(&db, None).await?;
    // The relay's own migration finds nothing to change.
    db.migrate().await?;
    Ok(())
}
