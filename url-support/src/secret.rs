//! Secrets read from files (`password_file=`, `token_file=`, `nkey_file=` URL options: secrets
//! mounted as files by Kubernetes, Docker or systemd instead of written into the URL), and the
//! one-line form of an error chain that connection errors are reported in. Shared by the
//! database and broker crates so they read the files and word their errors the same way.

use outbox_traits::Error;

/// The secret held by the file at `path`, named by URL option `option` of a `what` URL (e.g.
/// `"Redis"`, `"password_file"`): the file's content without its trailing line break.
///
/// An unreadable or empty file is [`Error::InvalidInput`]; the error names `what`, the option and
/// the path, never the file's content.
///
/// ```
/// let err = outbox_url::read_secret_file("Redis", "password_file", "/nonexistent/pw")
///     .unwrap_err();
/// assert!(err.to_string().contains("Redis option password_file=/nonexistent/pw cannot be read"));
/// ```
pub fn read_secret_file(what: &str, option: &str, path: &str) -> Result<String, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::invalid_input(format!(
            "{what} option {option}={path} cannot be read ({}); give the path of a readable \
             file holding the secret",
            e.kind()
        ))
    })?;
    let secret = text.trim_end_matches(['\r', '\n']);
    if secret.is_empty() {
        return Err(Error::invalid_input(format!(
            "{what} option {option}={path} names an empty file; give the path of a file \
             holding the secret"
        )));
    }
    Ok(secret.to_owned())
}

/// `err`'s message followed by its sources' messages (each only when the text so far does not
/// already hold it), on one line with runs of whitespace collapsed. Redact it (with
/// [`redact_url`](crate::redact_url)) before showing it when it may hold a URL.
pub fn error_chain_line(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_secret_without_its_line_break_and_errors_without_the_content() {
        let dir = std::env::temp_dir().join(format!("outbox-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pw");
        let path = file.to_str().unwrap();
        std::fs::write(&file, "s3cr@t x\r\n").unwrap();
        assert_eq!(
            read_secret_file("NATS", "token_file", path).unwrap(),
            "s3cr@t x"
        );

        std::fs::write(&file, "\n").unwrap();
        let empty = read_secret_file("Kafka", "password_file", path).unwrap_err();
        assert!(matches!(empty, Error::InvalidInput(_)), "{empty:?}");
        assert!(empty.to_string().contains("empty file"), "{empty}");

        let missing = dir.join("missing");
        let missing = missing.to_str().unwrap();
        let err = read_secret_file("postgres", "password_file", missing).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains(&format!("postgres option password_file={missing}")),
            "{text}"
        );
        assert!(text.contains("entity not found"), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_chain_on_one_line_without_repeats() {
        #[derive(Debug)]
        struct Outer(&'static str, std::io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.1)
            }
        }
        let cause = || std::io::Error::other("invalid peer certificate: UnknownIssuer");
        let err = Outer("connect failed\n  while dialing", cause());
        assert_eq!(
            error_chain_line(&err),
            "connect failed while dialing: invalid peer certificate: UnknownIssuer"
        );
        let repeated = Outer("io: invalid peer certificate: UnknownIssuer", cause());
        let text = error_chain_line(&repeated);
        assert_eq!(text, "io: invalid peer certificate: UnknownIssuer");
    }
}
