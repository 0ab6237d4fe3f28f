//! What opening an outbox store or publisher from a URL needs, shared by the backends, the
//! publishers, the consumers and the `outbox` facade, so that every URL is read, checked and
//! shown alike:
//!
//! - [`redact_url`] (and [`is_secret_option`]): passwords and secret options out of any text that
//!   may hold a URL, before it goes into an error or a log line;
//! - [`UrlOptions`]: the values of query options (whole numbers, booleans, milliseconds, secret
//!   files) and the errors that name the valid choices; [`percent_decode`] for user names and
//!   passwords;
//! - [`read_secret_file`] (`password_file=`, `token_file=`: secrets mounted as files) and
//!   [`error_chain_line`] (a connection error and its causes on one line);
//! - [`split_seed_list`]: a clustered broker's URL with several seed servers;
//! - [`StoreOptions`] and [`Migrate`]: what a store's `open_url` takes besides the URL, and the
//!   one call beyond the contract that a store opened by scheme offers.
//!
//! The contract itself (traits, messages, errors) is `outbox-traits`; this crate adds no
//! database driver or broker client.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod options;
mod redact;
mod secret;
mod seeds;
mod store;

pub use options::{percent_decode, percent_decode_lossy, UrlOptions};
pub use redact::{is_secret_option, redact_url};
pub use secret::{error_chain_line, read_secret_file};
pub use seeds::{split_seed_list, SeedList};
pub use store::{store_scheme, Migrate, StoreOptions};
