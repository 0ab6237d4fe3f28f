//! URLs that carry secrets, read from files: `--store-file` / `OUTBOX_STORE_URL_FILE` and
//! `--broker-file` / `OUTBOX_BROKER_URL_FILE`, for secrets mounted as files (Kubernetes,
//! Docker and systemd credentials) instead of passed in the environment or on the command line.
//!
//! The file holds the whole URL (a trailing line break is ignored). Errors name the flag and the
//! path, never the file's content.

use std::path::Path;

use outbox::Error;

/// At one level of the settings (flags and environment, or the configuration file): the URL
/// given directly (`--store` / `--broker`, their variables or keys) or read from the file given by
/// `file_flag`; `None` when neither is given at this level, an error when both are.
pub fn pick(
    direct: Option<String>,
    file: Option<&Path>,
    flag: &str,
    file_flag: &str,
) -> Result<Option<String>, Error> {
    match (direct, file) {
        (Some(url), None) => Ok(Some(url)),
        (None, Some(path)) => read(path, file_flag).map(Some),
        (Some(_), Some(_)) => Err(Error::invalid_input(format!(
            "both {flag} and {file_flag} are given; give one (the URL, or the file holding it)"
        ))),
        (None, None) => Ok(None),
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
        let got = pick(None, Some(&file), "--store", "--store-file").unwrap();
        assert_eq!(got.as_deref(), Some("postgres://app:s3cret@db/app"));
        let direct = pick(
            Some("sqlite://x.db".into()),
            None,
            "--store",
            "--store-file",
        );
        assert_eq!(direct.unwrap().as_deref(), Some("sqlite://x.db"));
        let both = pick(Some("x".into()), Some(&file), "--store", "--store-file").unwrap_err();
        assert!(both.to_string().contains("--store-file"), "{both}");
        assert_eq!(pick(None, None, "--broker", "--broker-file").unwrap(), None);
        std::fs::write(&file, "a://x\nb://y s3cret\n").unwrap();
        let two = pick(None, Some(&file), "--store", "--store-file").unwrap_err();
        assert!(!two.to_string().contains("s3cret"), "{two}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
