//! The files at the root of a stack directory that every topology shares: `DIR/env`, the
//! three URLs as `export NAME=value` lines ([`StackEnv`]), and `DIR/.lock`, which serialises
//! `up` and `down` among processes ([`lock_dir`]).
//!
//! Not here: the servers themselves (`server.rs`), which live in subdirectories.

use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use super::error::{io_err, StackError};
use super::kind::Kind;

/// The three URLs of a running stack, as written to `DIR/env`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackEnv {
    pub redis_url: String,
    pub pg_url: String,
    pub nats_url: String,
}

impl StackEnv {
    /// Reads `DIR/env` (`export NAME=value` lines).
    pub fn read(dir: &Path) -> Option<StackEnv> {
        let text = fs::read_to_string(dir.join("env")).ok()?;
        let get = |name: &str| {
            text.lines().find_map(|line| {
                let rest = line.strip_prefix("export ")?.strip_prefix(name)?.strip_prefix('=')?;
                Some(rest.trim().to_string())
            })
        };
        Some(StackEnv {
            redis_url: get("FLASHSALE_REDIS_URL")?,
            pg_url: get("FLASHSALE_PG_URL")?,
            nats_url: get("FLASHSALE_NATS_URL")?,
        })
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        for (kind, url) in [
            (Kind::Redis, &self.redis_url),
            (Kind::Postgres, &self.pg_url),
            (Kind::Nats, &self.nats_url),
        ] {
            let _ = writeln!(out, "export {}={}", kind.env_name(), url);
        }
        out
    }
}

/// Takes the lock of `dir` (created if missing), held until the file is dropped.
pub(super) fn lock_dir(dir: &Path) -> Result<fs::File, StackError> {
    fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
    let path = dir.join(".lock");
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_err(format!("open {}", path.display())))?;
    file.lock().map_err(io_err(format!("lock {}", path.display())))?;
    Ok(file)
}
