//! How many statements a claim sends, seen on the wire through a proxy: an idle relay's poll, and
//! any claim over a backlog smaller than its window, runs one claim statement; only a claim that
//! comes back short from a full window runs the second one, which looks past the window.

mod common;

use std::collections::HashMap;
use std::io;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{db, ids, msg, names};
use outbox_backend_postgres::PostgresStore;
use outbox_traits::{Claim, ClaimRequest, HeadPolicy, OutboxStore};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Mirrors `CLAIM_WINDOW` in `src/claim.rs`: a claim of `limit` rows reads at most
/// `limit * CLAIM_WINDOW` unpublished rows before it looks past them.
const CLAIM_WINDOW: usize = 2;

/// A statement the client sent, in the order the proxy forwarded it.
#[derive(Clone, Debug, PartialEq)]
enum Sent {
    /// A simple-protocol `Query` message: its SQL (sqlx's `BEGIN` and `COMMIT`).
    Query(String),
    /// An extended-protocol `Execute` message: the SQL of the prepared statement it ran, found
    /// through the `Bind` that made its portal and the `Parse` that named that statement.
    Execute(String),
}

/// What went through the proxy, client to server.
#[derive(Default)]
struct Wire {
    connections: usize,
    sent: Vec<Sent>,
    /// Anything the parser did not expect; the test asserts there is none.
    errors: Vec<String>,
}

/// A TCP proxy on loopback in front of Postgres that forwards bytes unchanged both ways and
/// records the statements of the client's messages (Parse, Bind, Describe, Sync and the like
/// are not statements: a statement's first run adds a Parse, Describe and Sync, and the pool's
/// check of an idle connection adds a Sync, none of which runs anything).
struct Proxy {
    port: u16,
    wire: Arc<Mutex<Wire>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: (String, u16)) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let wire = Arc::new(Mutex::new(Wire::default()));
        let shared = wire.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                shared.lock().unwrap().connections += 1;
                let server = TcpStream::connect((upstream.0.as_str(), upstream.1))
                    .await
                    .unwrap();
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let wire = shared.clone();
                tokio::spawn(async move {
                    let recorded = client_to_server(client_read, server_write, &wire).await;
                    if let Err(e) = recorded {
                        wire.lock()
                            .unwrap()
                            .errors
                            .push(format!("client side: {e}"));
                    }
                });
                tokio::spawn(server_to_client(server_read, client_write));
            }
        });
        Self { port, wire, accept }
    }

    /// How many statements went through so far.
    fn mark(&self) -> usize {
        self.wire.lock().unwrap().sent.len()
    }

    fn since(&self, mark: usize) -> Vec<Sent> {
        self.wire.lock().unwrap().sent[mark..].to_vec()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn server_to_client(mut from: OwnedReadHalf, mut to: OwnedWriteHalf) {
    let _ = tokio::io::copy(&mut from, &mut to).await;
    let _ = to.shutdown().await;
}

/// Forward the client's bytes, recording each message before forwarding it: the server cannot
/// answer a statement, so the client cannot see it finish, before it is recorded. That makes a
/// count taken after a call returns exact, with nothing to wait for.
async fn client_to_server(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    wire: &Mutex<Wire>,
) -> io::Result<()> {
    let mut parser = Parser::default();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let n = from.read(&mut chunk).await?;
        if n == 0 {
            return to.shutdown().await;
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut whole = 0;
        while let Some(len) = parser.next_len(&buf[whole..]) {
            parser.record(&buf[whole..whole + len], wire);
            whole += len;
        }
        to.write_all(&buf[..whole]).await?;
        buf.drain(..whole);
    }
}

/// The client side of one connection, message by message.
#[derive(Default)]
struct Parser {
    /// Past the untyped StartupMessage (int32 length including itself, then its payload).
    started: bool,
    /// Prepared statement name to its SQL, from Parse messages.
    statements: HashMap<String, String>,
    /// Portal name to the SQL of the statement bound to it, from Bind messages.
    portals: HashMap<String, String>,
}

impl Parser {
    /// The length of the whole message at the start of `buf`, once all of it has arrived:
    /// a typed message is one type byte and an int32 length that counts itself, not the type.
    fn next_len(&self, buf: &[u8]) -> Option<usize> {
        let header = usize::from(self.started);
        let length = buf.get(header..header + 4)?;
        let length = u32::from_be_bytes(length.try_into().unwrap()) as usize;
        let total = header + length;
        (buf.len() >= total).then_some(total)
    }

    fn record(&mut self, message: &[u8], wire: &Mutex<Wire>) {
        let mut wire = wire.lock().unwrap();
        if !self.started {
            self.started = true;
            // Protocol 3.0; an SSLRequest here would mean the stream is not plain.
            let code = u32::from_be_bytes(message[4..8].try_into().unwrap());
            if code != 196_608 {
                wire.errors
                    .push(format!("first message is not a StartupMessage: {code}"));
            }
            return;
        }
        let body = &message[5..];
        match message[0] {
            b'Q' => wire.sent.push(Sent::Query(cstr(body).0)),
            b'P' => {
                let (name, rest) = cstr(body);
                self.statements.insert(name, cstr(rest).0);
            }
            b'B' => {
                let (portal, rest) = cstr(body);
                let statement = cstr(rest).0;
                match self.statements.get(&statement) {
                    Some(sql) => {
                        self.portals.insert(portal, sql.clone());
                    }
                    None => wire.errors.push(format!("Bind of unknown {statement:?}")),
                }
            }
            b'E' => {
                let portal = cstr(body).0;
                match self.portals.get(&portal) {
                    Some(sql) => wire.sent.push(Sent::Execute(sql.clone())),
                    None => wire.errors.push(format!("Execute of unknown {portal:?}")),
                }
            }
            _ => {}
        }
    }
}

/// A NUL-terminated string at the start of `buf`, and what follows it.
fn cstr(buf: &[u8]) -> (String, &[u8]) {
    let end = buf.iter().position(|&b| b == 0).unwrap();
    (
        String::from_utf8(buf[..end].to_vec()).unwrap(),
        &buf[end + 1..],
    )
}

/// The SQL of each Execute among `sent`.
fn executed(sent: &[Sent]) -> Vec<&str> {
    sent.iter()
        .filter_map(|s| match s {
            Sent::Execute(sql) => Some(sql.as_str()),
            Sent::Query(_) => None,
        })
        .collect()
}

/// The SQL of each simple Query among `sent`.
fn queried(sent: &[Sent]) -> Vec<&str> {
    sent.iter()
        .filter_map(|s| match s {
            Sent::Query(sql) => Some(sql.as_str()),
            Sent::Execute(_) => None,
        })
        .collect()
}

/// The claim's transaction is two simple Queries: `BEGIN` with the plan settings in one round
/// trip, and `COMMIT`.
fn assert_one_transaction(sent: &[Sent], wire: &str) {
    let q = queried(sent);
    assert_eq!(q.len(), 2, "{wire}");
    assert!(
        q[0].starts_with("BEGIN; SELECT set_config('enable_bitmapscan', 'off', true)"),
        "{wire}"
    );
    assert_eq!(q[1], "COMMIT", "{wire}");
}

/// `sent` one line per statement (`Q` a simple Query, `E` an Execute), each cut to its first 60
/// characters, for failure messages.
fn summary(sent: &[Sent]) -> String {
    let line = |kind: &str, sql: &str| {
        let short: String = sql.split_whitespace().collect::<Vec<_>>().join(" ");
        format!("\n  {kind} {}", short.chars().take(60).collect::<String>())
    };
    sent.iter()
        .map(|s| match s {
            Sent::Query(sql) => line("Q", sql),
            Sent::Execute(sql) => line("E", sql),
        })
        .collect()
}

/// A store that claims through a proxy that records what it sends, on a pool of exactly one
/// connection (no LISTEN: wakeups() is never called), over plain TCP. The test sets up and
/// inspects through its own pool.
async fn proxied_store(db: &common::Db) -> (Proxy, PostgresStore) {
    let direct = PgConnectOptions::from_str(&db.url).unwrap();
    let proxy = Proxy::start((direct.get_host().to_owned(), direct.get_port())).await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            direct
                .clone()
                .host("127.0.0.1")
                .port(proxy.port)
                .ssl_mode(PgSslMode::Disable),
        )
        .await
        .unwrap();
    let store = PostgresStore::new(pool, db.config.clone());
    (proxy, store)
}

/// One claim through the proxy, and the statements it sent (the pool's only connection is
/// idle before and after, so nothing else is on the wire meanwhile).
async fn claim(store: &PostgresStore, proxy: &Proxy, limit: usize) -> (Claim, Vec<Sent>) {
    let mark = proxy.mark();
    let claim = store
        .claim(&ClaimRequest {
            limit,
            lease: Duration::from_secs(30),
            head_policy: HeadPolicy::Block,
            shard: None,
        })
        .await
        .unwrap();
    (claim, proxy.since(mark))
}

#[tokio::test]
async fn a_claim_runs_its_second_statement_only_when_short_from_a_full_window() {
    let Some(db) = db().await else { return };
    let (proxy, store) = proxied_store(&db).await;
    // A store checks the table's shape (plain or partitioned) once, before its first claim: one
    // catalog query. Done here, so that what follows shows the claims alone.
    let (_, first) = claim(&store, &proxy, 10).await;
    assert_eq!(
        executed(&first).len(),
        2,
        "the first claim:{}",
        summary(&first)
    );

    // Every claim is one transaction: a simple-protocol BEGIN that also sets the plan settings,
    // the Executes, a simple COMMIT. The one Execute is the claim statement.
    let (idle, sent) = claim(&store, &proxy, 10).await;
    let wire = summary(&sent);
    assert!(idle.messages.is_empty());
    assert_one_transaction(&sent, &wire);
    let one = executed(&sent);
    assert_eq!(one.len(), 1, "an idle poll:{wire}");

    // A backlog smaller than the window (3 rows; limit 10 reads up to 20) comes back short,
    // but its window held every unpublished row: nothing past it, the same one statement.
    db.enqueue(&[msg("a", "a1"), msg("b", "b1"), msg("c", "c1")])
        .await;
    let (small, sent) = claim(&store, &proxy, 10).await;
    let wire = summary(&sent);
    assert_eq!(names(&small), ["a1", "b1", "c1"]);
    assert_one_transaction(&sent, &wire);
    assert_eq!(executed(&sent).len(), 1, "a small backlog:{wire}");
    assert!(executed(&sent) == one, "a small backlog:{wire}");
    db.store.complete(small.token, &ids(&small)).await.unwrap();

    // Fill a limit-2 claim's window (4 rows) with key w, then one row of key p past it.
    let limit = 2;
    let window = limit * CLAIM_WINDOW;
    let mut messages: Vec<_> = (1..=window).map(|i| msg("w", &format!("w{i}"))).collect();
    messages.push(msg("p", "p1"));
    db.enqueue(&messages).await;
    // An earlier claim leases w's head. It is full (1 of 1), so it too runs one statement.
    let (head, sent) = claim(&store, &proxy, 1).await;
    let wire = summary(&sent);
    assert_eq!(names(&head), ["w1"]);
    assert_eq!(executed(&sent).len(), 1, "a full claim:{wire}");
    assert!(executed(&sent) == one, "a full claim:{wire}");

    // Now the window is w1 (leased) and w2..w4 (behind a leased head): nothing in it is
    // claimable, the claim comes back short from a full window, and the second statement finds
    // p1, the claimable head past it. Two Executes: the same one, then that one.
    let (past, sent) = claim(&store, &proxy, limit).await;
    let wire = summary(&sent);
    assert_eq!(names(&past), ["p1"], "{wire}");
    assert_one_transaction(&sent, &wire);
    let two = executed(&sent);
    assert_eq!(two.len(), 2, "short from a full window:{wire}");
    assert!(two[..1] == one, "short from a full window:{wire}");
    assert!(!one.contains(&two[1]), "short from a full window:{wire}");

    {
        let wire = proxy.wire.lock().unwrap();
        assert_eq!(wire.connections, 1, "the pool reconnected");
        assert!(wire.errors.is_empty(), "{:?}", wire.errors);
    }
    store.pool().close().await;
    db.drop().await;
}

/// A key whose head another relay holds keeps its backlog in every window. The store sizes a
/// shard's next window from its last one, counting the rows that waited behind that head too,
/// so a backlog shorter than the limit costs no look past the window on every other claim:
/// each claim after the first runs its one statement and fills its batch.
#[tokio::test]
async fn a_backlog_behind_a_held_head_is_counted_when_the_next_window_is_sized() {
    let Some(db) = db().await else { return };
    let (proxy, store) = proxied_store(&db).await;
    // Key w's five messages, then forty messages of forty keys.
    let mut messages: Vec<_> = (1..=5).map(|i| msg("w", &format!("w{i}"))).collect();
    messages.extend((1..=40).map(|i| msg(&format!("o{i:02}"), &format!("o{i:02}"))));
    db.enqueue(&messages).await;
    // Another relay (the test's own store) leases w's head.
    let head = db.claim(1, HeadPolicy::Block).await;
    assert_eq!(names(&head), ["w1"]);
    // The first claim reads the largest window; each later one reads the limit, the five rows
    // of w the last one found held or behind a held row, and an eighth of the limit: enough.
    let limit = 8;
    for round in 0..4 {
        let (got, sent) = claim(&store, &proxy, limit).await;
        let wire = summary(&sent);
        let expected: Vec<String> = (round * limit + 1..=round * limit + limit)
            .map(|i| format!("o{i:02}"))
            .collect();
        assert_eq!(names(&got), expected, "round {round}:{wire}");
        // The first round also runs the store's one-time check of the table.
        let statements = if round == 0 { 2 } else { 1 };
        assert_eq!(executed(&sent).len(), statements, "round {round}:{wire}");
        store.complete(got.token, &ids(&got)).await.unwrap();
    }
    store.pool().close().await;
    db.drop().await;
}
