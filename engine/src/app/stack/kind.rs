//! The three kinds of server a stack runs (Redis, PostgreSQL, NATS) as a closed enum, with
//! what each is called: binary, Debian package, client URL, `DIR/env` name; and
//! [`find_binary`], which looks for a binary on PATH and where Debian puts it.
//!
//! Not here: starting or probing a server (`server.rs`), the processes (`process.rs`).

use std::path::PathBuf;

use super::error::StackError;

/// The three servers of a stack. A closed set: placement of data and the readiness probe
/// are decided per variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Redis,
    Postgres,
    Nats,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Redis, Kind::Postgres, Kind::Nats];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Redis => "redis",
            Kind::Postgres => "postgres",
            Kind::Nats => "nats",
        }
    }

    pub(super) fn binary(self) -> &'static str {
        match self {
            Kind::Redis => "redis-server",
            Kind::Postgres => "postgres",
            Kind::Nats => "nats-server",
        }
    }

    pub(super) fn package(self) -> &'static str {
        match self {
            Kind::Redis => "redis-server",
            Kind::Postgres => "postgresql",
            Kind::Nats => "nats-server",
        }
    }

    /// The URL clients use, as written to `DIR/env`.
    pub fn url(self, port: u16) -> String {
        match self {
            Kind::Redis => format!("redis://127.0.0.1:{port}"),
            Kind::Postgres => format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            Kind::Nats => format!("nats://127.0.0.1:{port}"),
        }
    }

    pub(super) fn env_name(self) -> &'static str {
        match self {
            Kind::Redis => "FLASHSALE_REDIS_URL",
            Kind::Postgres => "FLASHSALE_PG_URL",
            Kind::Nats => "FLASHSALE_NATS_URL",
        }
    }
}

/// Where Debian puts PostgreSQL's server binaries (they are not on PATH).
const PG_BIN_DIRS: [&str; 4] = [
    "/usr/lib/postgresql/17/bin",
    "/usr/lib/postgresql/16/bin",
    "/usr/lib/postgresql/15/bin",
    "/usr/lib/postgresql/14/bin",
];

pub(super) fn find_binary(kind: Kind, name: &'static str) -> Result<PathBuf, StackError> {
    let mut dirs: Vec<PathBuf> =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    dirs.extend(["/usr/sbin", "/usr/local/sbin", "/sbin"].map(PathBuf::from));
    if kind == Kind::Postgres {
        dirs.extend(PG_BIN_DIRS.map(PathBuf::from));
    }
    for dir in &dirs {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(StackError::MissingBinary {
        binary: name,
        package: kind.package(),
        searched: "/usr/sbin, /usr/lib/postgresql/*/bin".to_string(),
    })
}
