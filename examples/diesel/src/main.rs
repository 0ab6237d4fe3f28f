//! `cargo run -p outbox-example-diesel`: orders written with diesel-async into the Postgres at
//! `OUTBOX_POSTGRES_URL` (default: the local test server), schema `outbox_example_diesel`
//! (dropped first, so the summary describes this run), relayed to standard output.

use outbox::postgres::PostgresConfig;
use outbox_example_diesel::{run, BoxError};

const SCHEMA: &str = "outbox_example_diesel";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("OUTBOX_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = outbox::postgres::sqlx::PgPool::connect(&url).await?;
    outbox::postgres::sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{SCHEMA}\" CASCADE"))
        .execute(&pool)
        .await?;
    pool.close().await;

    let config = PostgresConfig::builder().schema(SCHEMA).build()?;
    let summary = run(&url, config, 10, std::io::stdout()).await?;
    eprintln!(
        "{} orders committed with their message, {} rolled back with theirs; relayed {} messages",
        summary.committed.len(),
        summary.rolled_back.len(),
        summary.stats.published
    );
    Ok(())
}
