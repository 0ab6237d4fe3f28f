//! What `broker` and `store` share: URL scheme tables, and the errors that name the choices.

use outbox_traits::Error;

/// `a:// (how), b:// (how)`: every scheme with how to get it, for an error message.
pub(crate) fn choices(schemes: &[(&str, &str)]) -> String {
    schemes
        .iter()
        .map(|(scheme, how)| format!("{scheme}:// ({how})"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The schemes of `table` whose feature is on (`(scheme, cfg!(feature = ...))` pairs).
pub(crate) fn compiled(table: &[(&'static str, bool)]) -> Vec<&'static str> {
    table
        .iter()
        .filter(|(_, on)| *on)
        .map(|(scheme, _)| *scheme)
        .collect()
}

/// The error for `scheme://`, whose `feature` of the `outbox` crate is off.
#[cfg_attr(
    all(
        feature = "postgres",
        feature = "mysql",
        feature = "sqlite",
        feature = "nats",
        feature = "kafka",
        feature = "redis"
    ),
    allow(dead_code)
)]
pub(crate) fn not_compiled(scheme: &str, feature: &str, compiled: &[&str]) -> Error {
    let compiled: Vec<String> = compiled.iter().map(|s| format!("{s}://")).collect();
    Error::invalid_input(format!(
        "{scheme}:// needs the `{feature}` feature of the `outbox` crate, which is not compiled \
         in (add `features = [\"{feature}\"]`); compiled-in choices: {}",
        if compiled.is_empty() {
            "none".to_owned()
        } else {
            compiled.join(", ")
        }
    ))
}
