//! A private PostgreSQL cluster's data directory: `initdb` once, and, when we run as root,
//! the `postgres` system user that must own the directory and run the server (PostgreSQL
//! refuses to run as root).
//!
//! Also what the backup commands (`app/backup/`) need to act as that user: [`postgres_tool`]
//! (`pg_basebackup`, `pg_verifybackup` run as it) and [`hand_to_postgres`] (a directory it
//! must own).
//!
//! Not here: starting the server (`server.rs`), standbys (`pg_standbys.rs`).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use super::error::{io_err, StackError};
use super::kind::{find_binary, Kind};
use super::process::current_euid;

/// A PostgreSQL program (`pg_basebackup`, `pg_verifybackup`, ...) found where Debian puts
/// them, set to run as the `postgres` user when we are root (the files it writes are then the
/// server's, and it can read the server's).
pub fn postgres_tool(name: &'static str) -> Result<Command, StackError> {
    let mut command = Command::new(find_binary(Kind::Postgres, name)?);
    as_postgres_user(&mut command)?;
    Ok(command)
}

/// Gives `dir` and everything under it to the `postgres` user when we are root (a no-op
/// otherwise), after checking that it can walk down to `dir`.
pub fn hand_to_postgres(dir: &Path) -> Result<(), StackError> {
    if let Some(owner) = postgres_owner()? {
        ensure_traversable(dir, owner)?;
        chown_tree(dir, owner)?;
    }
    Ok(())
}

pub(super) fn init_postgres(dir: &Path) -> Result<(), StackError> {
    let data = dir.join("data");
    if data.join("PG_VERSION").is_file() {
        return Ok(());
    }
    if let Some(owner) = postgres_owner()? {
        ensure_traversable(dir, owner)?;
        chown_tree(dir, owner)?;
    }
    let mut command = Command::new(find_binary(Kind::Postgres, "initdb")?);
    command.arg("-D").arg(&data).args([
        "-U",
        "postgres",
        "--auth=trust",
        "--encoding=UTF8",
        "--no-locale",
        "--no-sync",
    ]);
    as_postgres_user(&mut command)?;
    let output = command.output().map_err(io_err("run initdb"))?;
    if !output.status.success() {
        return Err(StackError::Service {
            service: "postgres",
            message: format!(
                "initdb failed: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        });
    }
    Ok(())
}

/// PostgreSQL refuses to run as root. When we are root, the cluster runs as the `postgres`
/// system user (created by the Debian package), which must own the data directory.
#[derive(Debug, Clone, Copy)]
pub(super) struct Owner {
    pub(super) uid: u32,
    pub(super) gid: u32,
}

pub(super) fn postgres_owner() -> Result<Option<Owner>, StackError> {
    if current_euid() != 0 {
        return Ok(None);
    }
    let passwd = fs::read_to_string("/etc/passwd").map_err(io_err("read /etc/passwd"))?;
    for line in passwd.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() >= 4 && fields[0] == "postgres" {
            let uid = fields[2].parse().ok();
            let gid = fields[3].parse().ok();
            if let (Some(uid), Some(gid)) = (uid, gid) {
                return Ok(Some(Owner { uid, gid }));
            }
        }
    }
    Err(StackError::Service {
        service: "postgres",
        message: "running as root but there is no `postgres` user to run the server as; \
                  apt-get install -y postgresql creates it"
            .into(),
    })
}

pub(super) fn as_postgres_user(command: &mut Command) -> Result<(), StackError> {
    if let Some(owner) = postgres_owner()? {
        command.uid(owner.uid).gid(owner.gid);
        // The inherited HOME (/root) is unreadable for postgres; psql-style tools look there.
        command.env("HOME", "/var/lib/postgresql");
    }
    Ok(())
}

pub(super) fn chown_tree(dir: &Path, owner: Owner) -> Result<(), StackError> {
    std::os::unix::fs::chown(dir, Some(owner.uid), Some(owner.gid))
        .map_err(io_err(format!("chown {}", dir.display())))?;
    for entry in fs::read_dir(dir).map_err(io_err(format!("read {}", dir.display())))? {
        let entry = entry.map_err(io_err("read_dir entry"))?;
        let path = entry.path();
        if entry.file_type().map_err(io_err("file_type"))?.is_dir() {
            chown_tree(&path, owner)?;
        } else {
            std::os::unix::fs::chown(&path, Some(owner.uid), Some(owner.gid))
                .map_err(io_err(format!("chown {}", path.display())))?;
        }
    }
    Ok(())
}

/// The postgres user must be able to walk down to its data directory. A checkout under a
/// private home (mode 0700) cannot host the cluster; say so instead of failing obscurely.
pub(super) fn ensure_traversable(dir: &Path, owner: Owner) -> Result<(), StackError> {
    let mut current = dir.parent();
    while let Some(path) = current {
        let meta = fs::metadata(path).map_err(io_err(format!("stat {}", path.display())))?;
        let mode = meta.permissions().mode();
        let others_x = mode & 0o001 != 0;
        let owner_x = std::os::unix::fs::MetadataExt::uid(&meta) == owner.uid && mode & 0o100 != 0;
        if !others_x && !owner_x {
            return Err(StackError::Service {
                service: "postgres",
                message: format!(
                    "the `postgres` user cannot traverse {} (mode {:o}); use --dir on a \
                     world-traversable path such as /var/tmp/flashsale, or chmod o+x {}",
                    path.display(),
                    mode & 0o777,
                    path.display()
                ),
            });
        }
        current = path.parent();
    }
    Ok(())
}
