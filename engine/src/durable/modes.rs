//! The degradation modes on one instance (DESIGN.md section 7): the mode table every shard
//! obeys, where it is persisted, how snapshots arrive. The decisions themselves are sans-I/O
//! elsewhere (`logic::modes` for the table's rules, `admission.rs` for a submission's fate);
//! this module is the glue with I/O. The dependency health admission also reads is
//! `health.rs`.
//!
//! - [`ModeState`]: the accepted [`ModeTable`] behind a mutex plus a revision counter. A shard
//!   keeps its own clone ([`ShardModes`]) and re-clones only when the revision moved, so a
//!   submit reads its mode with one relaxed load and a few hash lookups, never a lock.
//!   Every accepted snapshot is persisted (write + rename) before the revision moves, so the
//!   last snapshot and the highest version survive restarts; an unreadable file fails closed.
//! - Distribution: a JetStream KV bucket ([`flashsale_io::jetstream::MODES_BUCKET`], one key per
//!   scope), watched by every instance ([`watch`]). It is not the Redis being protected: a mode
//!   change must reach the fleet when Redis is the problem. `POST /admin/v1/mode` checks a
//!   snapshot against the local table first (a dry run), puts it into the bucket by
//!   compare-and-set ([`put_mode`]: the stored entry's version must be older, the write names
//!   the revision it read), then applies it; the watcher applies what other instances put
//!   (its own put comes back as a stale version and is ignored). Two instances accepting
//!   snapshots of one scope at once never overwrite each other blindly: the loser answers
//!   409 STALE_VERSION.
//!
//! Without `FLASHSALE_CONTROL_KEY` there is no table: every SKU is NORMAL and mode changes are
//! refused (CONTRACT.md section 2).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flashsale_io::jetstream::async_nats;

use super::error::DurableError;
use super::wait::pause;
use crate::logic::modes::{Applied, EffectiveMode, ModeConfig, ModeError, ModeTable};
use crate::logic::modes::{Scope, SignedSnapshot};
use flashsale_io::key::HmacKey;

/// Where the control plane's state comes from.
#[derive(Debug, Clone, Default)]
pub struct ControlConfig {
    /// `FLASHSALE_CONTROL_KEY`; None: no modes (NORMAL everywhere, changes refused).
    pub key: Option<HmacKey>,
    /// Where the accepted snapshots are persisted; None: not persisted (tests, dev).
    pub state_file: Option<PathBuf>,
    pub modes: ModeConfig,
}

/// The instance's mode table.
pub struct ModeState {
    table: Mutex<Option<ModeTable>>,
    revision: AtomicU64,
    state_file: Option<PathBuf>,
}

impl ModeState {
    /// Restores the persisted table (a missing file is a fresh start; an unreadable one closes
    /// everything until a valid global snapshot arrives).
    pub fn load(config: &ControlConfig) -> ModeState {
        let table = config.key.clone().map(|key| match &config.state_file {
            None => ModeTable::new(key, config.modes),
            Some(path) => restore(path, key, config.modes),
        });
        ModeState {
            table: Mutex::new(table),
            revision: AtomicU64::new(1),
            state_file: config.state_file.clone(),
        }
    }

    pub fn revision(&self) -> u64 {
        self.revision.load(Ordering::Acquire)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<ModeTable>> {
        // A panic while holding the lock leaves a table that was either updated or not:
        // both are consistent states.
        self.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A copy for a shard, with the revision it reflects.
    pub fn copy(&self) -> (u64, Option<ModeTable>) {
        let table = self.lock();
        (self.revision(), table.clone())
    }

    /// Whether an operator's `signed` would be accepted now (its version step included),
    /// without accepting it.
    pub fn check(&self, signed: &SignedSnapshot, now_ms: u64) -> Result<Applied, ControlError> {
        let table = self.lock();
        let mut trial = table.clone().ok_or(ControlError::NoKey)?;
        trial.check_version_step(&signed.snapshot).map_err(ControlError::Mode)?;
        trial.apply(signed, now_ms).map_err(ControlError::Mode)
    }

    /// Accepts `signed` if every rule holds, persists the table, then publishes the change to
    /// the shards. A persist failure keeps the snapshot (it is in force in the fleet) and is
    /// reported.
    pub fn apply(&self, signed: &SignedSnapshot, now_ms: u64) -> Result<Applied, ControlError> {
        let mut table = self.lock();
        let current = table.as_mut().ok_or(ControlError::NoKey)?;
        let applied = current.apply(signed, now_ms).map_err(ControlError::Mode)?;
        let persisted = match &self.state_file {
            Some(path) => write_atomically(path, &current.to_persisted()),
            None => Ok(()),
        };
        self.revision.fetch_add(1, Ordering::AcqRel);
        drop(table);
        tracing::info!(
            scope = %applied.scope,
            version = applied.version,
            mode = applied.mode.name(),
            previous = applied.previous.map_or("none", |m| m.name()),
            "mode snapshot accepted"
        );
        persisted.map_err(|e| ControlError::Persist(e.to_string()))?;
        Ok(applied)
    }

    /// The global scope's effective mode now (the `flashsale_mode` gauge).
    pub fn global(&self, now_ms: u64) -> EffectiveMode {
        self.lock().as_ref().map_or(EffectiveMode::NO_SNAPSHOT, |t| t.effective(0, 0, now_ms))
    }

    /// The accepted snapshot of each scope (the admin API's view).
    pub fn describe(&self, scope: Scope) -> Option<SignedSnapshot> {
        self.lock().as_ref().and_then(|t| t.snapshot(scope).cloned())
    }
}

fn restore(path: &Path, key: HmacKey, config: ModeConfig) -> ModeTable {
    match std::fs::read_to_string(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => ModeTable::new(key, config),
        Err(e) => {
            tracing::error!(path = %path.display(), error = %e, "mode state unreadable: closed");
            ModeTable::fail_closed(key, config)
        }
        Ok(text) => match ModeTable::from_persisted(&text, key.clone(), config) {
            Ok(table) => {
                if table.unverifiable_scopes() > 0 {
                    tracing::error!(
                        scopes = table.unverifiable_scopes(),
                        "persisted mode snapshots failed verification: those scopes are closed"
                    );
                }
                table
            }
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "mode state malformed: closed");
                ModeTable::fail_closed(key, config)
            }
        },
    }
}

fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    {
        use std::io::Write as _;
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

/// Why a snapshot was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("FLASHSALE_CONTROL_KEY is not set: mode changes are refused")]
    NoKey,
    #[error("{0}")]
    Mode(ModeError),
    #[error("accepted but not persisted: {0}")]
    Persist(String),
    #[error("mode store: {0}")]
    Store(String),
}

impl ControlError {
    /// The HTTP status and `reason_code` of the admin answer.
    pub fn http(&self) -> (u16, &'static str) {
        match self {
            ControlError::NoKey => (503, "CONTROL_KEY_MISSING"),
            ControlError::Mode(e @ (ModeError::BadSignature | ModeError::BadKey(_))) => {
                (403, e.label())
            }
            ControlError::Mode(e @ ModeError::StaleVersion { .. }) => (409, e.label()),
            ControlError::Mode(e) => (400, e.label()),
            ControlError::Persist(_) => (500, "PERSIST_FAILED"),
            ControlError::Store(_) => (503, "MODE_STORE_UNAVAILABLE"),
        }
    }
}

/// A shard's copy of the table, refreshed when the instance's revision moves.
pub struct ShardModes {
    revision: u64,
    table: Option<ModeTable>,
}

impl ShardModes {
    pub fn new(state: &ModeState) -> ShardModes {
        let (revision, table) = state.copy();
        ShardModes { revision, table }
    }

    /// The mode a submit for this SKU obeys now.
    pub fn effective(
        &mut self,
        state: &ModeState,
        activity_id: u64,
        sku_id: u64,
        now_ms: u64,
    ) -> EffectiveMode {
        if state.revision() != self.revision {
            let (revision, table) = state.copy();
            self.revision = revision;
            self.table = table;
        }
        match &self.table {
            Some(table) if !table.is_empty() => table.effective(activity_id, sku_id, now_ms),
            _ => EffectiveMode::NO_SNAPSHOT,
        }
    }
}

/// The KV key of a scope (`global`, `activity.A`, `sku.A.S`: KV keys allow no `:`).
pub fn kv_key(scope: Scope) -> String {
    match scope {
        Scope::Global => "global".to_owned(),
        Scope::Activity(a) => format!("activity.{a}"),
        Scope::Sku(a, s) => format!("sku.{a}.{s}"),
    }
}

/// Re-reads after a lost race at most this many times before answering "store busy".
pub const PUT_ATTEMPTS_MAX: usize = 8;

/// Puts `value` (a signed snapshot of `version`) under `key` only over an older one: reads the
/// entry with its revision, refuses when the stored version is not older
/// ([`DurableError::StaleMode`]), writes with `update(key, value, revision)` (or `create` when
/// the key is new), and on a revision mismatch re-reads and re-checks, at most
/// [`PUT_ATTEMPTS_MAX`] times. Returns the new revision. A stored value that does not parse
/// counts as version 0 (the watcher refuses it anyway).
pub async fn put_mode(
    store: &async_nats::jetstream::kv::Store,
    key: &str,
    value: &str,
    version: u64,
) -> Result<u64, DurableError> {
    use async_nats::jetstream::kv::{CreateErrorKind, UpdateErrorKind};
    use DurableError;
    let failed = |e: &dyn std::fmt::Display| DurableError::ModeStore(e.to_string());
    for _ in 0..PUT_ATTEMPTS_MAX {
        let entry = store.entry(key).await.map_err(|e| failed(&e))?;
        let bytes = bytes::Bytes::copy_from_slice(value.as_bytes());
        let Some(entry) = entry else {
            match store.create(key, bytes).await {
                Ok(revision) => return Ok(revision),
                Err(e) if e.kind() == CreateErrorKind::AlreadyExists => continue,
                Err(e) => return Err(failed(&e)),
            }
        };
        let current = stored_version(&entry.value);
        if current >= version {
            return Err(DurableError::StaleMode { current });
        }
        match store.update(key, bytes, entry.revision).await {
            Ok(revision) => return Ok(revision),
            Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => continue,
            Err(e) => return Err(failed(&e)),
        }
    }
    Err(DurableError::ModeStore(format!("{key}: lost {PUT_ATTEMPTS_MAX} races in a row")))
}

fn stored_version(value: &[u8]) -> u64 {
    std::str::from_utf8(value)
        .ok()
        .and_then(|text| SignedSnapshot::from_json(text).ok())
        .map_or(0, |signed| signed.snapshot.version)
}

/// Applies every snapshot of the bucket (the latest per scope first, then each new one) until
/// `stop`; re-watches after errors. Refusals are logged: a stale version is the normal echo of
/// this instance's own put.
pub async fn watch(
    store: async_nats::jetstream::kv::Store,
    state: Arc<ModeState>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    use futures::StreamExt as _;
    loop {
        let mut entries = match store.watch_with_history(">").await {
            Ok(entries) => entries,
            Err(e) => {
                tracing::warn!(error = %e, "mode bucket watch failed; retrying");
                if pause(Duration::from_secs(1), &mut stop).await {
                    return;
                }
                continue;
            }
        };
        loop {
            let entry = tokio::select! {
                entry = entries.next() => entry,
                _ = stop.changed() => return,
            };
            let Some(entry) = entry else { break };
            let entry = match entry {
                Ok(entry) => entry,
                Err(e) => {
                    tracing::warn!(error = %e, "mode bucket watch error; re-watching");
                    break;
                }
            };
            if entry.operation != async_nats::jetstream::kv::Operation::Put {
                continue;
            }
            apply_entry(&state, &entry.key, &entry.value, crate::logic::clock::now_ms());
        }
        if pause(Duration::from_millis(200), &mut stop).await {
            return;
        }
    }
}

fn apply_entry(state: &ModeState, key: &str, value: &[u8], now_ms: u64) {
    let parsed = std::str::from_utf8(value)
        .map_err(|_| ModeError::Malformed("not utf-8"))
        .and_then(SignedSnapshot::from_json);
    let signed = match parsed {
        Ok(signed) => signed,
        Err(e) => {
            tracing::warn!(key, error = %e, "mode bucket entry refused");
            return;
        }
    };
    match state.apply(&signed, now_ms) {
        Ok(_) => {}
        Err(ControlError::Mode(ModeError::StaleVersion { .. })) => {}
        Err(e) => tracing::warn!(key, error = %e, "mode bucket entry refused"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logic::modes::{control_key, sign, Mode, ModeSnapshot};

    const KEY: &str = "000102030405060708090a0b0c0d0e0f";

    fn snapshot(version: u64, mode: Mode, now: u64) -> SignedSnapshot {
        let key = control_key(KEY).unwrap();
        sign(
            &key,
            ModeSnapshot {
                version,
                scope: Scope::Global,
                mode,
                issued_at_ms: now,
                expires_at_ms: now + 60_000,
                issuer: "test".into(),
            },
        )
        .unwrap()
    }

    fn config(dir: &Path) -> ControlConfig {
        ControlConfig {
            key: Some(control_key(KEY).unwrap()),
            state_file: Some(dir.join("modes.json")),
            modes: ModeConfig::default(),
        }
    }

    #[test]
    fn accepted_snapshots_survive_a_restart_and_versions_stay_monotonic() {
        let dir = tempfile::tempdir().unwrap();
        let now = 1_000_000;
        let state = ModeState::load(&config(dir.path()));
        state.apply(&snapshot(3, Mode::SubmitClosed, now), now).unwrap();
        let again = ModeState::load(&config(dir.path()));
        assert_eq!(again.global(now).mode, Mode::SubmitClosed);
        let err = again.apply(&snapshot(2, Mode::Normal, now), now).unwrap_err();
        assert_eq!(err.http(), (409, "STALE_VERSION"));
    }

    #[test]
    fn a_corrupt_state_file_closes_everything() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("modes.json"), "{not json").unwrap();
        let state = ModeState::load(&config(dir.path()));
        assert!(state.global(1).closes_submissions());
    }

    #[test]
    fn shards_see_a_change_through_the_revision() {
        let now = 1_000_000;
        let state = ModeState::load(&ControlConfig {
            state_file: None,
            ..config(Path::new("/nonexistent"))
        });
        let mut shard = ShardModes::new(&state);
        assert_eq!(shard.effective(&state, 1, 2, now).mode, Mode::Normal);
        state.apply(&snapshot(1, Mode::QueryOnly, now), now).unwrap();
        assert_eq!(shard.effective(&state, 1, 2, now).mode, Mode::QueryOnly);
        // check() is a dry run.
        state.check(&snapshot(2, Mode::SubmitClosed, now), now).unwrap();
        assert_eq!(shard.effective(&state, 1, 2, now).mode, Mode::QueryOnly);
    }

    #[test]
    fn without_a_key_everything_is_normal_and_changes_are_refused() {
        let state = ModeState::load(&ControlConfig::default());
        let mut shard = ShardModes::new(&state);
        assert_eq!(shard.effective(&state, 1, 2, 5).mode, Mode::Normal);
        let err = state.apply(&snapshot(1, Mode::SubmitClosed, 5), 5).unwrap_err();
        assert_eq!(err.http(), (503, "CONTROL_KEY_MISSING"));
    }

    #[test]
    fn kv_keys_are_valid_nats_keys() {
        for scope in [Scope::Global, Scope::Activity(7), Scope::Sku(7, 9)] {
            let key = kv_key(scope);
            assert!(key.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=".contains(&b)));
        }
    }
}
