//! URLs that carry secrets, read from files: `--store-file` / `OUTBOX_STORE_URL_FILE` and
//! `--broker-file` / `OUTBOX_BROKER_URL_FILE`, for secrets mounted as files (Kubernetes,
//! Docker and systemd credentials) instead of passed in the environment or on the command line.
//!
//! The file holds the whole URL (a trailing line break is ignored). Errors name the flag and the
//! path, never the file's content.

use std::path::{Path, PathBuf};

use clap::Args;
use outbox::Error;

/// The store URL's file form, flattened into the top-level flags.
#[derive(Debug, Args)]
pub struct StoreFile {
    /// Read the store URL from this file (a mounted secret) instead of --store.
    #[arg(long, env = "OUTBOX_STORE_URL_FILE", value_name = "PATH")]
    pub store_file: Option<PathBuf>,
}

/// The broker URL's file form, flattened into `run` and `drain`.
#[derive(Debug, Args)]
pub struct BrokerFile {
    /// Read the broker URL from this file (a mounted secret) instead of --broker.
    #[arg(long, env = "OUTBOX_BROKER_URL_FILE", value_name = "PATH")]
    pub broker_file: Option<PathBuf>,
}

/// The URL given directly (`--store` / `--broker`, or its environment variable) or read from
/// the file given by `file_flag`; exactly one of them must be given.
pub fn url(
    direct: Option<String>,
    file: Option<&Path>,
    flag: &str,
    file_flag: &str,
) -> Result<String, Error> {
    match (direct, file) {
        (Some(url), None) => Ok(url),
        (None, Some(path)) => read(path, file_flag),
        (Some(_), Some(_)) => Err(Error::invalid_input(format!(
            "both {flag} and {file_flag} are given; give one (the URL, or the file holding it)"
        ))),
        (None, None) => Err(Error::invalid_input(format!(
            "no {flag} given; give the URL with {flag} (or its environment variable), or the \
             file holding it with {file_flag}"
        ))),
    }
}

fn read(path: &Path, file_flag: &str) -> Result<String, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::invalid_input(format!(
            "{file_flag} {} cannot be read ({}); give the path of a readable file holding the URL",
            path.display(),
            e.kind()
        ))
    })?;
    let url = text.trim();
    if url.is_empty() || url.contains('\n') {
        return Err(Error::invalid_input(format!(
            "{file_flag} {} must hold one URL on one line",
            path.display()
        )));
    }
    Ok(url.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_one_form_and_errors_without_the_content() {
        let dir = std::env::temp_dir().join(format!("outbox-cli-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("store-url");
        std::fs::write(&file, "postgres://app:s3cret@db/app\n").unwrap();
        let got = url(None, Some(&file), "--store", "--store-file").unwrap();
        assert_eq!(got, "postgres://app:s3cret@db/app");
        assert_eq!(
            url(
                Some("sqlite://x.db".into()),
                None,
                "--store",
                "--store-file"
            )
            .unwrap(),
            "sqlite://x.db"
        );
        let both = url(Some("x".into()), Some(&file), "--store", "--store-file").unwrap_err();
        assert!(both.to_string().contains("--store-file"), "{both}");
        let none = url(None, None, "--broker", "--broker-file").unwrap_err();
        assert!(none.to_string().contains("--broker-file"), "{none}");
        std::fs::write(&file, "a://x\nb://y s3cret\n").unwrap();
        let two = url(None, Some(&file), "--store", "--store-file").unwrap_err();
        assert!(!two.to_string().contains("s3cret"), "{two}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
