//! `cargo run -p outbox-quickstart [-- FILE [ORDERS]]`: write sample orders with their outbox
//! messages into a SQLite file, relay them to stdout (one JSON line each), print a summary.

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let (path, orders) = match outbox_quickstart::fresh_file_from_args("outbox-quickstart.sqlite") {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };

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
