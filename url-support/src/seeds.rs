//! Broker URLs that list several seed servers, as clustered brokers are addressed:
//! `scheme://[user:password@]h1:4222,h2:4222,h3:4222[/path][?options]`.
//!
//! The credentials (before the first host), the path and the options belong to the whole URL;
//! each seed is `host[:port]`, or `scheme://host[:port]` when written so (the form NATS tools
//! print). Publishers split the list with [`split_seed_list`], parse [`SeedList::first`] as an
//! ordinary one-host URL and check each of [`SeedList::others`].

use outbox_traits::Error;

use crate::redact_url;

/// A broker URL split into its first seed (as a complete URL) and the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedList {
    /// The URL with only its first host: scheme, credentials, path and options are kept, so it
    /// parses as an ordinary one-server URL.
    pub first: String,
    /// The other seeds as written, without a trailing `/`: `host:port`, or
    /// `scheme://host:port` when the seed was written with its scheme.
    pub others: Vec<String>,
}

/// Split `url` at the commas of its host list.
///
/// Credentials are read before the first host only (a comma in a password must be
/// percent-encoded, `%2C`); a later seed with `user@` is refused, as is an empty seed
/// (`h1:4222,,h2:4222`). A URL without `://` or without a comma comes back whole in
/// [`SeedList::first`]. Errors never show the password.
///
/// ```
/// use outbox_url::split_seed_list;
/// let s = split_seed_list("nats://app:pw@h1:4222,h2:4222,nats://h3:4222?subject=a").unwrap();
/// assert_eq!(s.first, "nats://app:pw@h1:4222?subject=a");
/// assert_eq!(s.others, ["h2:4222", "nats://h3:4222"]);
/// assert!(split_seed_list("redis://h1:7000,,h2:7001").is_err());
/// ```
pub fn split_seed_list(url: &str) -> Result<SeedList, Error> {
    let whole = || SeedList {
        first: url.to_owned(),
        others: Vec::new(),
    };
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok(whole());
    };
    let end = rest.find(['?', '#']).unwrap_or(rest.len());
    let (authority_and_path, tail) = rest.split_at(end);
    let first_comma = authority_and_path.find(',');
    let Some(first_comma) = first_comma else {
        return Ok(whole());
    };
    // Credentials end at the last '@' before the first comma (as a URL parser reads them).
    let user_end = authority_and_path[..first_comma]
        .rfind('@')
        .map_or(0, |at| at + 1);
    let (userinfo, hosts) = authority_and_path.split_at(user_end);
    // The path (e.g. Redis' `/0`) follows the last seed; the first seed takes it along.
    let (hosts, path) = match hosts.rfind("://") {
        Some(scheme_at) => {
            let after = scheme_at + 3;
            match hosts[after..].find('/') {
                Some(slash) => hosts.split_at(after + slash),
                None => (hosts, ""),
            }
        }
        None => match hosts.find('/') {
            Some(slash) => hosts.split_at(slash),
            None => (hosts, ""),
        },
    };
    let shown = || redact_url(url);
    if hosts.split(',').any(|seed| seed.trim().is_empty()) {
        return Err(Error::invalid_input(format!(
            "broker URL {:?} has an empty server in its list; write the servers as \
             {scheme}://host1:port,host2:port,...",
            shown()
        )));
    }
    let first = hosts.split(',').next().unwrap_or_default().trim();
    let mut others = Vec::new();
    for (n, seed) in hosts.split(',').map(str::trim).enumerate().skip(1) {
        let host = seed.split_once("://").map_or(seed, |(_, h)| h);
        if host.contains('@') {
            // The URL is not shown: its later credentials are where no redaction looks.
            return Err(Error::invalid_input(format!(
                "a {scheme}:// broker URL gives credentials on server {} of its list; give them \
                 once, before the first server ({scheme}://user:password@host1:port,host2:port): \
                 they apply to every server",
                n + 1
            )));
        }
        others.push(seed.trim_end_matches('/').to_owned());
    }
    Ok(SeedList {
        first: format!("{scheme}://{userinfo}{first}{path}{tail}"),
        others,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_server_comes_back_whole() {
        for url in [
            "nats://h:4222?subject=a",
            "redis://:pw@h/2",
            "stdout://",
            "no-scheme",
        ] {
            let s = split_seed_list(url).unwrap();
            assert_eq!(s.first, url);
            assert!(s.others.is_empty());
        }
    }

    #[test]
    fn path_and_options_stay_with_the_first_server() {
        let s =
            split_seed_list("redis://:pw@a:7000,b:7001,c:7002/0?stream=s&cluster=true").unwrap();
        assert_eq!(s.first, "redis://:pw@a:7000/0?stream=s&cluster=true");
        assert_eq!(s.others, ["b:7001", "c:7002"]);
        let s = split_seed_list("nats://a:1,nats://b:2/?subject=x").unwrap();
        assert_eq!(s.first, "nats://a:1/?subject=x");
        assert_eq!(s.others, ["nats://b:2"]);
        let s = split_seed_list("nats://[::1]:4222, [::1]:4223").unwrap();
        assert_eq!(s.others, ["[::1]:4223"]);
    }

    #[test]
    fn refuses_empty_servers_and_late_credentials_without_showing_the_password() {
        for url in [
            "nats://u:s3cret@a:1,,b:2",
            "nats://u:s3cret@a:1,b:2,",
            "nats://,a:1",
            "nats://u:s3cret@a:1,u:s3cret@b:2",
            "nats://a:1,nats://u:s3cret@b:2",
        ] {
            let err = split_seed_list(url).unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{url}: {err}");
            assert!(!err.to_string().contains("s3cret"), "{err}");
        }
    }
}
