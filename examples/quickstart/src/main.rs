//! `cargo run -p outbox-quickstart [-- FILE [ORDERS]]`: write sample orders with their outbox
//! messages into a SQLite file, relay them to stdout (one JSON line each), print a summary.

use std::path::PathBuf;
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(
        args.next()
            .unwrap_or_else(|| "outbox-quickstart.sqlite".into()),
    );
    let orders = match args.next().map(|n| n.parse::<usize>()) {
        None => 20,
        Some(Ok(n)) => n,
        Some(Err(e)) => {
            eprintln!("ORDERS must be a whole number: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Start from an empty file so the summary describes this run only.
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.clone().into_os_string();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }

    eprintln!(
        "writing {orders} orders with their outbox messages into {}",
        path.display()
    );
    match outbox_quickstart::run(&path, orders, std::io::stdout()).await {
        Ok(s) => {
            eprintln!(
                "\nsummary: {} orders committed, {} rolled back; relayed {} messages in {} ms \
                 ({} claimed, {} retried, {} dead); store now: {} published, {} pending, {} dead",
                s.committed,
                s.rolled_back,
                s.stats.published,
                s.relay_millis,
                s.stats.claimed,
                s.stats.retried,
                s.stats.dead,
                s.counts.published,
                s.counts.pending,
                s.counts.dead,
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("quickstart failed: {e}");
            ExitCode::FAILURE
        }
    }
}
