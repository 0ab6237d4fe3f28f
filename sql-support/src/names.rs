//! Names derived from a table's name (indexes, constraints, triggers, functions), kept within
//! the identifier limits of Postgres (63 bytes) and MariaDB/MySQL (64 characters).

/// Longest derived name, in bytes: Postgres truncates identifiers longer than this silently,
/// and MariaDB/MySQL refuse names over 64 characters.
pub const MAX_IDENT: usize = 63;

/// `{base}_{suffix}`, or a shortened `base` plus a hash when that would exceed [`MAX_IDENT`]
/// bytes, so that two derived names never collide through truncation. `base` must be a
/// validated identifier (ASCII).
pub fn derived_name(base: &str, suffix: &str) -> String {
    let full = format!("{base}_{suffix}");
    if full.len() <= MAX_IDENT {
        return full;
    }
    let hash = format!("{:016x}", fnv1a(base.as_bytes()));
    // base is ASCII (validated identifier), so any byte index is a char boundary.
    let keep = MAX_IDENT - suffix.len() - hash.len() - 2;
    format!("{}_{hash}_{suffix}", &base[..keep.min(base.len())])
}

/// FNV-1a: a stable hash (unlike `DefaultHasher`, which may change between Rust releases), so a
/// shortened name is the same for every process and version.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_names_are_shortened_with_a_hash() {
        assert_eq!(derived_name("outbox", "key_idx"), "outbox_key_idx");
        let a = derived_name(&"t".repeat(63), "partition_key");
        let b = derived_name(&format!("{}u", "t".repeat(62)), "partition_key");
        assert!(a.len() <= MAX_IDENT && b.len() <= MAX_IDENT);
        assert!(a.ends_with("_partition_key"));
        assert_ne!(a, b);
    }
}
