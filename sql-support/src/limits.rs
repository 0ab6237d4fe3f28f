//! The limits every SQL store applies the same way: durations in the units their SQL takes
//! (bounded by the contract's [`MAX_DURATION`]), the longest stored error text, and the error
//! for a row that does not decode.

use std::time::Duration;

use outbox_traits::{validate_duration, Error, GroupRenewal};

pub use outbox_traits::MAX_DURATION;

/// Longest stored error text (`last_error`), in bytes, on every SQL store; longer errors are
/// cut at a character boundary so a broker that returns a huge error body cannot bloat the
/// table.
pub const MAX_ERROR_BYTES: usize = 8 * 1024;

/// `duration` in whole microseconds (rounded up, so a tiny positive value stays positive).
///
/// # Errors
/// [`Error::InvalidInput`] naming `what` when `duration` is longer than [`MAX_DURATION`].
pub fn micros(what: &str, duration: Duration) -> Result<i64, Error> {
    validate_duration(what, duration)?;
    let us = duration.as_nanos().div_ceil(1000);
    // Bounded by MAX_DURATION above, far below i64::MAX microseconds.
    Ok(i64::try_from(us).unwrap_or(i64::MAX))
}

/// `duration` in whole milliseconds (rounded up: a 0.5 ms lease must not end at once).
///
/// # Errors
/// [`Error::InvalidInput`] naming `what` when `duration` is longer than [`MAX_DURATION`].
pub fn millis(what: &str, duration: Duration) -> Result<i64, Error> {
    validate_duration(what, duration)?;
    let ms = duration.as_micros().div_ceil(1000);
    // Bounded by MAX_DURATION above, far below i64::MAX milliseconds.
    Ok(i64::try_from(ms).unwrap_or(i64::MAX))
}

/// A relay-group renewal's shard count and lease in microseconds, as the stores' renewal SQL
/// takes them, after [`GroupRenewal::validate`].
///
/// # Errors
/// [`Error::InvalidInput`] for a renewal that does not validate or whose shard count does not
/// fit an SQL `int`.
pub fn group_renewal(req: &GroupRenewal) -> Result<(i32, i64), Error> {
    req.validate()?;
    let lease_us = micros("relay group lease", req.lease)?;
    let shards = i32::try_from(req.shards).map_err(|_| {
        Error::invalid_input(format!(
            "relay group shard count {} is too large",
            req.shards
        ))
    })?;
    Ok((shards, lease_us))
}

/// `text` cut to at most [`MAX_ERROR_BYTES`], at a character boundary.
pub fn truncate_error(text: &str) -> &str {
    let mut cut = text.len().min(MAX_ERROR_BYTES);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    &text[..cut]
}

/// The permanent error for a row of `table` that does not decode.
pub fn decode_error(err: impl std::fmt::Display, table: &str) -> Error {
    Error::permanent(
        format!("a row of {table} could not be decoded: {err}; was the table changed by hand?"),
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_up_and_are_bounded() {
        assert_eq!(
            micros("lease", Duration::from_secs(2)).ok(),
            Some(2_000_000)
        );
        assert_eq!(micros("lease", Duration::from_nanos(1)).ok(), Some(1));
        assert_eq!(micros("lease", Duration::ZERO).ok(), Some(0));
        assert!(matches!(
            micros("lease", Duration::MAX),
            Err(Error::InvalidInput(_))
        ));
        assert_eq!(millis("lease", Duration::from_micros(500)).ok(), Some(1));
        assert_eq!(millis("lease", Duration::from_secs(2)).ok(), Some(2000));
        assert_eq!(millis("delay", Duration::ZERO).ok(), Some(0));
        assert!(millis("lease", MAX_DURATION).is_ok());
        let err = millis("lease", MAX_DURATION + Duration::from_secs(1)).unwrap_err();
        assert!(err.to_string().contains("lease"), "{err}");
    }

    #[test]
    fn error_texts_are_cut_at_a_character_boundary() {
        let long = "é".repeat(MAX_ERROR_BYTES);
        let cut = truncate_error(&long);
        assert!(cut.len() <= MAX_ERROR_BYTES && cut.len() >= MAX_ERROR_BYTES - 1);
        assert_eq!(truncate_error("short"), "short");
    }
}
