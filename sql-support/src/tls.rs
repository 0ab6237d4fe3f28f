//! What to do about a failed connection: the TLS and authentication failures a user meets
//! first against a managed database, each turned into the fix, in the driver's own URL options.
//!
//! The drivers' own messages name the cause ("invalid peer certificate: UnknownIssuer", "no
//! pg_hba.conf entry ... no encryption") but not what to change; [`fix`] adds that. The options
//! are sqlx's (and libpq's / MySQL's) names:
//!
//! | what | Postgres | MySQL / MariaDB |
//! |---|---|---|
//! | TLS mode | `sslmode=disable\|prefer\|require\|verify-ca\|verify-full` | `ssl-mode=DISABLED\|PREFERRED\|REQUIRED\|VERIFY_CA\|VERIFY_IDENTITY` |
//! | CA file | `sslrootcert=/path/ca.pem` | `ssl-ca=/path/ca.pem` |
//! | client certificate | `sslcert=/path/client.pem` | `ssl-cert=/path/client.pem` |
//! | client key | `sslkey=/path/client.key` | `ssl-key=/path/client.key` |

/// The URL option names of one database, for the fixes [`fix`] proposes.
#[derive(Debug, Clone, Copy)]
struct Options {
    verify_full: &'static str,
    require: &'static str,
    ca: &'static str,
    cert: &'static str,
    key: &'static str,
}

const POSTGRES: Options = Options {
    verify_full: "sslmode=verify-full",
    require: "sslmode=require",
    ca: "sslrootcert",
    cert: "sslcert",
    key: "sslkey",
};

const MYSQL: Options = Options {
    verify_full: "ssl-mode=VERIFY_IDENTITY",
    require: "ssl-mode=REQUIRED",
    ca: "ssl-ca",
    cert: "ssl-cert",
    key: "ssl-key",
};

/// What to change when connecting to the `what` database (`"postgres"`, `"mysql"`) failed
/// with `text` (the driver's message with its sources), or `None` when the message says
/// enough by itself (a refused connection, an unknown host).
pub(crate) fn fix(what: &str, url: &str, text: &str) -> Option<String> {
    let o = if what == "mysql" { MYSQL } else { POSTGRES };
    let t = text.to_ascii_lowercase();
    let u = url.to_ascii_lowercase();
    // MariaDB answers a plaintext login to a server with require_secure_transport=ON with
    // "Access denied", as for a wrong password.
    let plaintext = u.contains("sslmode=disable") || u.contains("ssl-mode=disabled");
    let has = |needles: &[&str]| needles.iter().any(|n| t.contains(n));
    let fix = if has(&["unknownissuer", "unknown issuer", "badsignature"]) {
        format!(
            "the server's certificate is not signed by a CA this client trusts: set {}= to the \
             file of the CA that signed it (the system's CAs are trusted without it)",
            o.ca
        )
    } else if has(&[
        "notvalidforname",
        "not valid for name",
        "certificate is not valid for",
    ]) {
        format!(
            "the server's certificate does not name the host in the URL: connect by a name the \
             certificate lists ({} checks both the CA and the name)",
            o.verify_full
        )
    } else if has(&["expired", "notvalidyet"]) {
        "the server's certificate is expired or not yet valid: renew it, or check this \
         machine's clock"
            .to_owned()
    } else if has(&[
        "certificaterequired",
        "certificate required",
        "peer did not return a certificate",
        "requires a valid client certificate",
    ]) {
        format!(
            "the server requires a client certificate: set {}= and {}= to the client's \
             certificate and key files",
            o.cert, o.key
        )
    } else if has(&[
        "no encryption",
        "insecure transport",
        "require_secure_transport",
    ]) {
        format!(
            "the server accepts only TLS connections: add {}&{}=/path/ca.pem to the URL (or {} \
             to encrypt without checking the certificate)",
            o.verify_full, o.ca, o.require
        )
    } else if has(&["server does not support tls", "server does not support ssl"]) {
        "the server does not offer TLS: enable TLS on the server, or lower the TLS mode \
         (sslmode=prefer / ssl-mode=PREFERRED) if an unencrypted connection is acceptable"
            .to_owned()
    } else if has(&[
        "password authentication failed",
        "access denied for user",
        "no password supplied",
        "authentication failed",
    ]) {
        if plaintext && what == "mysql" {
            format!(
                "check the user name and the password (give the password in the URL, or in a \
                 file with the password_file= option); if the server requires TLS \
                 (require_secure_transport), add {}&{}=/path/ca.pem instead of the disabled TLS \
                 mode",
                o.verify_full, o.ca
            )
        } else {
            "check the user name and the password (give the password in the URL, or in a file \
             with the password_file= option)"
                .to_owned()
        }
    } else if has(&["no pg_hba.conf entry"]) {
        "the server's pg_hba.conf has no entry for this user, database and address: ask its \
         administrator, or connect with TLS (sslmode=verify-full) if only hostssl entries exist"
            .to_owned()
    } else if has(&["no such file", "failed to read", "os error 2"]) {
        format!(
            "a file named in the URL cannot be read: check the paths of {}, {} and {}",
            o.ca, o.cert, o.key
        )
    } else if has(&["tls", "ssl", "certificate", "handshake"]) {
        format!(
            "the TLS handshake failed: check the TLS mode ({}) and the {} / {} / {} files",
            o.verify_full, o.ca, o.cert, o.key
        )
    } else {
        return None;
    };
    Some(fix)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_gets_its_own_fix_in_the_database_options() {
        let cases = [
            ("postgres", "invalid peer certificate: UnknownIssuer", "sslrootcert="),
            ("mysql", "invalid peer certificate: UnknownIssuer", "ssl-ca="),
            ("postgres", "invalid peer certificate: NotValidForName", "connect by a name"),
            (
                "postgres",
                "no pg_hba.conf entry for host \"127.0.0.1\", user \"u\", database \"d\", no encryption",
                "sslmode=verify-full",
            ),
            (
                "mysql",
                "Connections using insecure transport are prohibited while --require_secure_transport=ON.",
                "ssl-mode=VERIFY_IDENTITY",
            ),
            ("postgres", "password authentication failed for user \"u\"", "password_file="),
            ("mysql", "Access denied for user 'u'@'localhost'", "password_file="),
        ];
        for (what, text, expected) in cases {
            let fix = fix(what, "postgres://h/d", text).unwrap_or_default();
            assert!(fix.contains(expected), "{what} {text}: {fix}");
        }
        assert_eq!(
            fix("postgres", "", "Connection refused (os error 111)"),
            None
        );
        let denied = fix(
            "mysql",
            "mysql://app@h/d?ssl-mode=DISABLED",
            "Access denied for user 'app'@'127.0.0.1' (using password: YES)",
        )
        .unwrap_or_default();
        assert!(denied.contains("ssl-mode=VERIFY_IDENTITY"), "{denied}");
    }

    #[test]
    fn one_line_joins_the_sources_without_repeating_them() {
        let inner = std::io::Error::other("invalid peer certificate: UnknownIssuer");
        let outer = sqlx::Error::Io(inner);
        let text = outbox_traits::error_chain_line(&outer);
        assert_eq!(text.matches("UnknownIssuer").count(), 1, "{text}");
        assert!(!text.contains('\n'));
    }
}
