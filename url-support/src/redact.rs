//! Passwords out of text that may hold a URL: connection strings are logged and put in errors,
//! their credentials and secret options never.

/// Remove the password from anything that looks like a URL with credentials
/// (`scheme://user:password@host`), and the value of every query option whose name says it is a
/// secret (`password`, `token`, `secret`, `ssl.key.pem`, e.g. `?sasl.password=...`), so that
/// connection strings can be logged and put in errors.
///
/// ```
/// assert_eq!(
///     outbox_url::redact_url("postgres://app:s3cret@db:5432/app"),
///     "postgres://app:***@db:5432/app"
/// );
/// assert_eq!(
///     outbox_url::redact_url("kafka://h:9092?sasl.password=s3cret&topic=t"),
///     "kafka://h:9092?sasl.password=***&topic=t"
/// );
/// ```
pub fn redact_url(text: &str) -> String {
    redact_secret_options(&redact_userinfo(text))
}

/// Whether a URL query option named `key` holds a secret (its value is never shown).
pub fn is_secret_option(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    key.contains("password")
        || key.contains("secret")
        || key.contains("token")
        || key == "ssl.key.pem"
}

/// Replace the value of each `?key=value` / `&key=value` whose key [`is_secret_option`].
fn redact_secret_options(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find(['?', '&']) {
        let (head, tail) = rest.split_at(pos + 1);
        out.push_str(head);
        let key_len = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
            .unwrap_or(tail.len());
        let (key, after) = tail.split_at(key_len);
        match after.strip_prefix('=') {
            Some(value) if is_secret_option(key) => {
                out.push_str(key);
                out.push_str("=***");
                let end = value
                    .find(|c: char| c.is_whitespace() || matches!(c, '&' | '"' | '\'' | '#'))
                    .unwrap_or(value.len());
                rest = &value[end..];
            }
            _ => rest = tail,
        }
    }
    out.push_str(rest);
    out
}

fn redact_userinfo(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find("://") {
        let (head, tail) = rest.split_at(pos + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| c.is_whitespace() || c == '/' || c == '"' || c == '\'')
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match (authority.rfind('@'), authority.find(':')) {
            (Some(at), Some(colon)) if colon < at => {
                out.push_str(&authority[..colon]);
                out.push_str(":***");
                out.push_str(&authority[at..]);
            }
            _ => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords_only() {
        assert_eq!(
            redact_url("failed: mysql://root:pw@127.0.0.1:3306/test and nats://h:4222"),
            "failed: mysql://root:***@127.0.0.1:3306/test and nats://h:4222"
        );
        assert_eq!(redact_url("redis://user@h"), "redis://user@h");
        assert_eq!(redact_url("no url"), "no url");
        assert_eq!(
            redact_url("nats://h:4222?token=t0k&subject=a&user_password=x y"),
            "nats://h:4222?token=***&subject=a&user_password=*** y"
        );
        assert_eq!(redact_url("a?b&c=d"), "a?b&c=d");
    }
}
