//! NATS subject rules: making field values subject-safe and checking configured names.

use std::borrow::Cow;

use outbox_routing::RoutingTemplate;
use outbox_traits::{chrono::Utc, uuid::Uuid, Error, Message};

/// Make one field value safe inside a subject: whitespace, control characters and the wildcards
/// `*` and `>` become `_`, and empty tokens (from an empty value or doubled dots) become `_`.
/// Dots stay, so a value such as `order.placed` spans two subject tokens.
pub(crate) fn sanitize_value(value: &str) -> Cow<'_, str> {
    let bad = |c: char| c.is_whitespace() || c.is_control() || c == '*' || c == '>';
    let needs_work = value.is_empty()
        || value.contains(bad)
        || value.starts_with('.')
        || value.ends_with('.')
        || value.contains("..");
    if !needs_work {
        return Cow::Borrowed(value);
    }
    let replaced: String = value
        .chars()
        .map(|c| if bad(c) { '_' } else { c })
        .collect();
    let tokens: Vec<&str> = replaced
        .split('.')
        .map(|t| if t.is_empty() { "_" } else { t })
        .collect();
    Cow::Owned(tokens.join("."))
}

/// Whether `subject` is a valid subject to publish to: non-empty tokens, no whitespace, control
/// characters or wildcards.
pub(crate) fn is_valid_publish_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|token| {
            !token.is_empty()
                && !token
                    .chars()
                    .any(|c| c.is_whitespace() || c.is_control() || c == '*' || c == '>')
        })
}

/// Check that the template's literal text yields valid subjects (values are sanitized at
/// publish time, so rendering with a plain sample value checks the literal parts).
pub(crate) fn check_template(template: &RoutingTemplate) -> Result<(), Error> {
    let sample = sample_message();
    let rendered = template.render_with(&sample, |_| Cow::Borrowed("x"));
    if is_valid_publish_subject(&rendered) {
        Ok(())
    } else {
        Err(Error::invalid_input(format!(
            "subject template {:?} does not give a valid NATS subject (dot-separated non-empty \
             tokens without spaces, '*' or '>'), e.g. \"outbox.{{aggregate_type}}.{{event_type}}\"",
            template.as_str()
        )))
    }
}

/// Check a subject filter for a stream (wildcards allowed: `*` as a whole token, `>` last).
pub(crate) fn check_filter(filter: &str) -> Result<(), Error> {
    let tokens: Vec<&str> = filter.split('.').collect();
    let ok = !filter.is_empty()
        && tokens.iter().enumerate().all(|(i, t)| {
            !t.is_empty()
                && !t.chars().any(|c| c.is_whitespace() || c.is_control())
                && (!t.contains('*') || *t == "*")
                && (!t.contains('>') || (*t == ">" && i == tokens.len() - 1))
        });
    if ok {
        Ok(())
    } else {
        Err(Error::invalid_input(format!(
            "stream subject {filter:?} is not a valid NATS subject filter \
             (dot-separated tokens; '*' as a whole token, '>' only as the last token)"
        )))
    }
}

/// Check a stream name: no whitespace, `.`, `*`, `>`, path separators.
pub(crate) fn check_stream_name(name: &str) -> Result<(), Error> {
    let bad =
        |c: char| c.is_whitespace() || c.is_control() || matches!(c, '.' | '*' | '>' | '/' | '\\');
    if name.is_empty() || name.contains(bad) {
        Err(Error::invalid_input(format!(
            "stream name {name:?} is not valid in NATS (no spaces, '.', '*', '>', '/' or '\\'), \
             e.g. OUTBOX"
        )))
    } else {
        Ok(())
    }
}

/// The subject filter a created stream needs for `template`: the literal prefix before the first
/// placeholder followed by `>`, or the template itself when it has no placeholder.
pub(crate) fn default_stream_subject(template: &RoutingTemplate) -> Result<String, Error> {
    if template.is_static() {
        return Ok(template.as_str().to_owned());
    }
    let prefix = template.as_str().split('{').next().unwrap_or_default();
    match prefix.rfind('.') {
        Some(dot) if dot > 0 => Ok(format!("{}.>", &prefix[..dot])),
        _ => Err(Error::invalid_input(format!(
            "cannot derive the stream's subjects from subject template {:?} (it has no fixed \
             first token); set stream_subjects, e.g. stream_subjects=outbox.>",
            template.as_str()
        ))),
    }
}

fn sample_message() -> Message {
    Message {
        id: Uuid::nil(),
        seq: 0,
        aggregate_type: String::new(),
        aggregate_id: String::new(),
        event_type: String::new(),
        payload: String::new(),
        binary: None,
        headers: Default::default(),
        partition_key: None,
        dedup_key: None,
        attempts: 0,
        created_at: Utc::now(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sanitizes_values_into_valid_tokens() {
        assert_eq!(sanitize_value("order.placed"), "order.placed");
        assert_eq!(sanitize_value(""), "_");
        assert_eq!(sanitize_value("a b*c>"), "a_b_c_");
        assert_eq!(sanitize_value(".a..b."), "_.a._.b._");
        for v in ["", " ", "..", "a\tb", "*", ">", "ü.x"] {
            assert!(
                is_valid_publish_subject(&format!("p.{}", sanitize_value(v))),
                "{v:?}"
            );
        }
    }

    #[test]
    fn default_stream_subjects() {
        let t = |s| RoutingTemplate::parse(s).unwrap();
        assert_eq!(default_stream_subject(&t("a.b.{id}")).unwrap(), "a.b.>");
        assert_eq!(default_stream_subject(&t("a.x{id}")).unwrap(), "a.>");
        assert_eq!(default_stream_subject(&t("events")).unwrap(), "events");
        assert!(default_stream_subject(&t("{id}.a")).is_err());
    }

    #[test]
    fn filters_and_names() {
        assert!(check_filter("a.*.>").is_ok());
        assert!(check_filter("a.>.b").is_err());
        assert!(check_filter("a..b").is_err());
        assert!(check_filter("a*").is_err());
        assert!(check_stream_name("OUTBOX_1").is_ok());
        assert!(check_stream_name("a.b").is_err());
    }
}
