//! The query options of a connection URL (`?timeout_ms=5000&cluster=true`), parsed with the
//! same rules and error texts by every publisher: whole numbers, booleans, milliseconds, secrets
//! read from files, and the error for an option the URL's owner does not know.

use std::time::Duration;

use outbox_traits::Error;

use crate::read_secret_file;

/// Parses the values of the query options of one kind of URL, naming it (`"NATS"`, `"Redis"`)
/// in its errors, which are all [`Error::InvalidInput`] and say what to write instead.
///
/// ```
/// use std::time::Duration;
/// use outbox_url::UrlOptions;
/// let nats = UrlOptions::new("NATS");
/// assert_eq!(nats.number::<usize>("max_in_flight", "8").unwrap(), 8);
/// assert_eq!(nats.millis("timeout_ms", "1500").unwrap(), Duration::from_millis(1500));
/// assert!(nats.boolean("create_stream", "yes").unwrap());
/// let err = nats.number::<u64>("timeout_ms", "soon").unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "invalid input: NATS option timeout_ms=\"soon\" is not a non-negative whole number"
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UrlOptions<'a> {
    what: &'a str,
}

impl<'a> UrlOptions<'a> {
    /// The options of a `what` URL (`what` starts each error: `"NATS option timeout_ms=..."`).
    pub const fn new(what: &'a str) -> Self {
        Self { what }
    }

    /// A whole number (`max_in_flight=8`): anything `T` parses from decimal digits; a sign,
    /// letters or a value out of `T`'s range are refused.
    pub fn number<T: std::str::FromStr>(&self, key: &str, value: &str) -> Result<T, Error> {
        value.parse().map_err(|_| {
            Error::invalid_input(format!(
                "{} option {key}={value:?} is not a non-negative whole number",
                self.what
            ))
        })
    }

    /// A duration in milliseconds (`timeout_ms=5000`). Zero is accepted here; a setting that
    /// must be positive says so when the configuration is validated.
    pub fn millis(&self, key: &str, value: &str) -> Result<Duration, Error> {
        self.number(key, value).map(Duration::from_millis)
    }

    /// A boolean: `true`, `1` or `yes`; `false`, `0` or `no`.
    pub fn boolean(&self, key: &str, value: &str) -> Result<bool, Error> {
        match value {
            "true" | "1" | "yes" => Ok(true),
            "false" | "0" | "no" => Ok(false),
            _ => Err(Error::invalid_input(format!(
                "{} option {key}={value:?} is not a boolean; use true or false",
                self.what
            ))),
        }
    }

    /// The secret held by the file at `path`, named by option `key` (`password_file=PATH`); see
    /// [`read_secret_file`].
    pub fn secret_file(&self, key: &str, path: &str) -> Result<String, Error> {
        read_secret_file(self.what, key, path)
    }

    /// The error for option `key`, which is none of `valid`, in the URL `shown` (redacted with
    /// [`redact_url`](crate::redact_url) by the caller).
    pub fn unknown(&self, key: &str, shown: &str, valid: &[&str]) -> Error {
        Error::invalid_input(format!(
            "unknown {} option {key:?} in {shown:?}; valid options: {}",
            self.what,
            valid.join(", ")
        ))
    }
}

/// `text` percent-decoded (`p%40ss` -> `p@ss`), as the user name and password of a URL are
/// written; `None` when the decoded bytes are not UTF-8. A `%` not followed by two hex digits
/// stays as it is.
///
/// ```
/// assert_eq!(outbox_url::percent_decode("p%40ss%2C").as_deref(), Some("p@ss,"));
/// assert_eq!(outbox_url::percent_decode("100%").as_deref(), Some("100%"));
/// assert_eq!(outbox_url::percent_decode("%FF"), None);
/// ```
pub fn percent_decode(text: &str) -> Option<String> {
    percent_encoding::percent_decode_str(text)
        .decode_utf8()
        .ok()
        .map(|decoded| decoded.into_owned())
}

/// `text` percent-decoded, with bytes that are not UTF-8 replaced by `U+FFFD`.
pub fn percent_decode_lossy(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_and_their_errors() {
        let redis = UrlOptions::new("Redis");
        assert_eq!(redis.number::<u32>("wait_replicas", "1").unwrap(), 1);
        for bad in ["-1", "1.5", "", "ten", "99999999999"] {
            let err = redis.number::<u32>("wait_replicas", bad).unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{bad}: {err}");
            assert!(
                err.to_string().contains("Redis option wait_replicas="),
                "{err}"
            );
        }
        for (text, value) in [("true", true), ("1", true), ("no", false), ("0", false)] {
            assert_eq!(redis.boolean("cluster", text).unwrap(), value);
        }
        let err = redis.boolean("cluster", "maybe").unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid input: Redis option cluster=\"maybe\" is not a boolean; use true or false"
        );
        assert_eq!(
            redis.millis("timeout_ms", "0").unwrap(),
            Duration::from_millis(0)
        );
        let err = redis.unknown("colour", "redis://h?colour=red", &["stream", "maxlen"]);
        assert_eq!(
            err.to_string(),
            "invalid input: unknown Redis option \"colour\" in \"redis://h?colour=red\"; valid \
             options: stream, maxlen"
        );
        let err = redis
            .secret_file("password_file", "/nonexistent/pw")
            .unwrap_err();
        assert!(
            err.to_string().contains("Redis option password_file="),
            "{err}"
        );
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("a%20b").as_deref(), Some("a b"));
        assert_eq!(percent_decode("%zz%4").as_deref(), Some("%zz%4"));
        assert_eq!(percent_decode_lossy("%FFa"), "\u{FFFD}a");
    }
}
