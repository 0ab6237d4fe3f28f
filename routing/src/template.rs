//! Routing templates: destination names made of literal text and `{field}` placeholders.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use outbox_traits::{Error, Message};

/// Every placeholder a template may use, in the order error messages list them.
pub const PLACEHOLDERS: &[&str] = &[
    "aggregate_type",
    "aggregate_id",
    "event_type",
    "partition_key",
    "id",
];

/// A message field that a template can insert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Field {
    /// `{aggregate_type}`: [`Message::aggregate_type`].
    AggregateType,
    /// `{aggregate_id}`: [`Message::aggregate_id`].
    AggregateId,
    /// `{event_type}`: [`Message::event_type`].
    EventType,
    /// `{partition_key}`: [`Message::partition_key`], or the empty string for an unordered
    /// message (adapters usually sanitize that to a placeholder token).
    PartitionKey,
    /// `{id}`: the message id, hyphenated lower-case UUID.
    Id,
}

impl Field {
    /// The placeholder name, without braces.
    pub fn name(self) -> &'static str {
        match self {
            Field::AggregateType => "aggregate_type",
            Field::AggregateId => "aggregate_id",
            Field::EventType => "event_type",
            Field::PartitionKey => "partition_key",
            Field::Id => "id",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "aggregate_type" => Field::AggregateType,
            "aggregate_id" => Field::AggregateId,
            "event_type" => Field::EventType,
            "partition_key" => Field::PartitionKey,
            "id" => Field::Id,
            _ => return None,
        })
    }

    /// This field's value in `msg`.
    pub fn value(self, msg: &Message) -> Cow<'_, str> {
        match self {
            Field::AggregateType => Cow::Borrowed(&msg.aggregate_type),
            Field::AggregateId => Cow::Borrowed(&msg.aggregate_id),
            Field::EventType => Cow::Borrowed(&msg.event_type),
            Field::PartitionKey => Cow::Borrowed(msg.partition_key.as_deref().unwrap_or("")),
            Field::Id => Cow::Owned(msg.id.hyphenated().to_string()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Field(Field),
}

/// A destination name built from a message's fields, e.g. `outbox.{aggregate_type}.{event_type}`.
///
/// Placeholders are listed in [`PLACEHOLDERS`]. Braces are reserved for placeholders: a template
/// with an unknown name, an unclosed `{` or a stray `}` is refused at parse time with
/// [`Error::InvalidInput`] naming the valid placeholders.
///
/// ```
/// use outbox_routing::RoutingTemplate;
/// let t = RoutingTemplate::parse("outbox.{aggregate_type}.{event_type}").unwrap();
/// assert_eq!(t.as_str(), "outbox.{aggregate_type}.{event_type}");
/// assert!(RoutingTemplate::parse("outbox.{tenant}").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingTemplate {
    source: String,
    parts: Vec<Part>,
}

impl RoutingTemplate {
    /// Parse and check `template`.
    pub fn parse(template: &str) -> Result<Self, Error> {
        if template.trim().is_empty() {
            return Err(Error::invalid_input(format!(
                "routing template is empty; give one such as \"outbox.{{aggregate_type}}\" \
                 (placeholders: {})",
                placeholder_list()
            )));
        }
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut rest = template;
        while let Some(pos) = rest.find(['{', '}']) {
            literal.push_str(&rest[..pos]);
            if rest[pos..].starts_with('}') {
                return Err(Error::invalid_input(format!(
                    "routing template {template:?} has a '}}' without a matching '{{'; \
                     braces may only enclose a placeholder ({})",
                    placeholder_list()
                )));
            }
            let after = &rest[pos + 1..];
            let Some(close) = after.find('}') else {
                return Err(Error::invalid_input(format!(
                    "routing template {template:?} has an unclosed '{{'; \
                     write placeholders as {{name}} with one of: {}",
                    placeholder_list()
                )));
            };
            let name = &after[..close];
            let Some(field) = Field::from_name(name) else {
                return Err(Error::invalid_input(format!(
                    "routing template {template:?} uses unknown placeholder {{{name}}}; \
                     valid placeholders: {}",
                    placeholder_list()
                )));
            };
            if !literal.is_empty() {
                parts.push(Part::Literal(std::mem::take(&mut literal)));
            }
            parts.push(Part::Field(field));
            rest = &after[close + 1..];
        }
        literal.push_str(rest);
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        Ok(Self {
            source: template.to_owned(),
            parts,
        })
    }

    /// The template text as given.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// The fields the template uses, in order of appearance (repeats included).
    pub fn fields(&self) -> impl Iterator<Item = Field> + '_ {
        self.parts.iter().filter_map(|p| match p {
            Part::Field(f) => Some(*f),
            Part::Literal(_) => None,
        })
    }

    /// Whether the template has no placeholder, so every message goes to the same destination.
    pub fn is_static(&self) -> bool {
        self.fields().next().is_none()
    }

    /// The destination for `msg`, with field values inserted unchanged.
    pub fn render(&self, msg: &Message) -> String {
        self.render_with(msg, |value| Cow::Borrowed(value))
    }

    /// The destination for `msg`, passing every field value (not the literal text) through
    /// `sanitize` first, so that an adapter can make values valid for its broker (e.g. replace
    /// spaces and wildcards in a NATS subject).
    pub fn render_with<'m, F>(&self, msg: &'m Message, mut sanitize: F) -> String
    where
        F: FnMut(&str) -> Cow<'_, str>,
    {
        let mut out = String::with_capacity(self.source.len() + 32);
        for part in &self.parts {
            match part {
                Part::Literal(text) => out.push_str(text),
                Part::Field(field) => {
                    let value: Cow<'m, str> = field.value(msg);
                    out.push_str(&sanitize(&value));
                }
            }
        }
        out
    }
}

fn placeholder_list() -> String {
    PLACEHOLDERS
        .iter()
        .map(|p| format!("{{{p}}}"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl FromStr for RoutingTemplate {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Self::parse(s)
    }
}

impl fmt::Display for RoutingTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests_support::message;

    #[test]
    fn renders_every_field() {
        let msg = message();
        let t = RoutingTemplate::parse(
            "x.{aggregate_type}.{aggregate_id}.{event_type}.{partition_key}.{id}",
        )
        .unwrap();
        assert_eq!(
            t.render(&msg),
            format!("x.order.order-42.order.placed.key-1.{}", msg.id)
        );
        assert!(!t.is_static());
        assert_eq!(t.fields().count(), 5);
    }

    #[test]
    fn static_template_and_missing_key() {
        let mut msg = message();
        msg.partition_key = None;
        let t = RoutingTemplate::parse("events").unwrap();
        assert!(t.is_static());
        assert_eq!(t.render(&msg), "events");
        let k = RoutingTemplate::parse("k.{partition_key}").unwrap();
        assert_eq!(k.render(&msg), "k.");
    }

    #[test]
    fn sanitizer_sees_values_only() {
        let mut msg = message();
        msg.aggregate_type = "a b".into();
        let t = RoutingTemplate::parse("lit eral.{aggregate_type}").unwrap();
        let out = t.render_with(&msg, |v| Cow::Owned(v.replace(' ', "_")));
        assert_eq!(out, "lit eral.a_b");
    }

    #[test]
    fn refuses_bad_templates_with_the_valid_list() {
        for bad in ["", "  ", "a.{tenant}", "a.{aggregate_type", "a}", "a.{}"] {
            let err = RoutingTemplate::parse(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{bad:?}");
            assert!(err.to_string().contains("{aggregate_type}"), "{err}");
        }
        let err = RoutingTemplate::parse("a.{tenant}")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("{tenant}") && err.contains("{event_type}"),
            "{err}"
        );
    }

    #[test]
    fn round_trips_through_display_and_from_str() {
        let t: RoutingTemplate = "outbox.{event_type}".parse().unwrap();
        assert_eq!(t.to_string(), "outbox.{event_type}");
    }
}
