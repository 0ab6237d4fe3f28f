//! The `password_file=` URL option: the database password read from a file (a mounted secret)
//! instead of written into the URL.

use std::borrow::Cow;

use outbox_traits::{read_secret_file, redact_url, Error};

/// The URL option naming the password file.
pub const PASSWORD_FILE: &str = "password_file";

/// `url` with its `password_file=PATH` option replaced by the password that file holds (without
/// its trailing line break); `url` itself when it has no such option. `what` names the database
/// in errors, which name the option and the path but never the password.
pub(crate) fn resolve<'a>(url: &'a str, what: &str) -> Result<Cow<'a, str>, Error> {
    if !url.contains(PASSWORD_FILE) {
        return Ok(Cow::Borrowed(url));
    }
    let shown = redact_url(url);
    let mut parsed = url::Url::parse(url)
        .map_err(|e| Error::invalid_input(format!("{what} URL {shown:?} is not valid: {e}")))?;
    let mut path = None;
    let others: Vec<(String, String)> = parsed
        .query_pairs()
        .filter_map(|(k, v)| {
            if k == PASSWORD_FILE {
                path = Some(v.into_owned());
                None
            } else {
                Some((k.into_owned(), v.into_owned()))
            }
        })
        .collect();
    let Some(path) = path else {
        return Ok(Cow::Borrowed(url));
    };
    if parsed.password().is_some() {
        return Err(Error::invalid_input(format!(
            "{what} URL {shown:?} has both a password and {PASSWORD_FILE}=; give one"
        )));
    }
    let password = read_secret_file(what, PASSWORD_FILE, &path)?;
    if others.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(others);
    }
    parsed.set_password(Some(&password)).map_err(|()| {
        Error::invalid_input(format!(
            "{what} URL {shown:?} cannot take a password (it names no host)"
        ))
    })?;
    Ok(Cow::Owned(parsed.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_becomes_the_password_and_the_option_goes() {
        let dir = std::env::temp_dir().join(format!("outbox-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pw");
        std::fs::write(&file, "s3cr@t/x\n").unwrap();
        let url = format!(
            "postgres://app@db:5432/app?sslmode=verify-full&password_file={}",
            file.display()
        );
        let resolved = resolve(&url, "postgres").unwrap();
        let parsed = url::Url::parse(&resolved).unwrap();
        assert_eq!(parsed.username(), "app");
        assert_eq!(parsed.password(), Some("s3cr%40t%2Fx"));
        assert_eq!(parsed.query(), Some("sslmode=verify-full"));

        let plain = "postgres://app@db/app?sslmode=require";
        assert!(matches!(
            resolve(plain, "postgres").unwrap(),
            Cow::Borrowed(_)
        ));

        let both = format!("postgres://app:pw@db/app?password_file={}", file.display());
        let err = resolve(&both, "postgres").unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)) && !err.to_string().contains("s3cr"));
        let missing = "mysql://app@db/app?password_file=/nonexistent/pw";
        let err = resolve(missing, "mysql").unwrap_err();
        assert!(err.to_string().contains("/nonexistent/pw"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
