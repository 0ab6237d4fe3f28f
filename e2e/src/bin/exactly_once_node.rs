//! `exactly-once-node`: one service of the exactly-once example (`relay` or `payments`, see
//! `outbox_example_exactly_once::serve`) as an OS process of its own, for the SIGKILL test
//! `tests/exactly_once.rs`.

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match outbox_example_exactly_once::serve(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "exactly-once-node {}: {e}",
                args.first().map_or("", String::as_str)
            );
            ExitCode::FAILURE
        }
    }
}
