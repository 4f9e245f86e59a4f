//! The mode table: the accepted snapshot per scope, the transition rules
//! ([`ModeTable::apply`]) and the effective mode of a SKU ([`ModeTable::effective`]), as the
//! `modes` module documentation states them.

use flashsale_io::bounds::MODE_VERSION_STEP_MAX;
use flashsale_io::key::HmacKey;
use std::collections::HashMap;

use super::snapshot::{verify, ModeSnapshot, SignedSnapshot};
use super::types::{Mode, ModeError, Scope};

// ---------------------------------------------------------------------------------------------
// The table
// ---------------------------------------------------------------------------------------------

/// Limits and steps of a [`ModeTable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModeConfig {
    /// Largest raise of RECOVERING's share per snapshot. Default 25: 25, 50, 75, 100, then
    /// NORMAL. (The seed's stages 1, 5, 20, 50, 100 % need a step of 50.)
    pub recovering_step_percent_max: u8,
    /// Scopes held at once (global + activities + SKUs with their own snapshot).
    pub scopes_max: usize,
}

impl Default for ModeConfig {
    fn default() -> ModeConfig {
        ModeConfig { recovering_step_percent_max: 25, scopes_max: 4_096 }
    }
}

impl ModeConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=100).contains(&self.recovering_step_percent_max) {
            return Err("recovering_step_percent_max must be within 1..=100".into());
        }
        if !(1..=65_536).contains(&self.scopes_max) {
            return Err("scopes_max must be within 1..=65536".into());
        }
        Ok(())
    }
}

/// What one scope holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Entry {
    Accepted {
        signed: SignedSnapshot,
        recovery_required: bool,
    },
    /// A persisted entry that did not verify: closed, and only a version above `version`
    /// (as recorded, untrusted) replaces it.
    Unverifiable {
        version: u64,
        recovery_required: bool,
    },
}

impl Entry {
    pub(super) fn version(&self) -> u64 {
        match self {
            Entry::Accepted { signed, .. } => signed.snapshot.version,
            Entry::Unverifiable { version, .. } => *version,
        }
    }

    /// The mode transitions are judged from (an unverifiable entry is closed).
    pub(super) fn mode(&self) -> Mode {
        match self {
            Entry::Accepted { signed, .. } => signed.snapshot.mode,
            Entry::Unverifiable { .. } => Mode::SubmitClosed,
        }
    }

    pub(super) fn recovery_required(&self) -> bool {
        match self {
            Entry::Accepted { recovery_required, .. }
            | Entry::Unverifiable { recovery_required, .. } => *recovery_required,
        }
    }
}

/// A snapshot that [`ModeTable::apply`] accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub scope: Scope,
    pub version: u64,
    /// The scope's mode before (None: the scope had no snapshot).
    pub previous: Option<Mode>,
    pub mode: Mode,
}

/// Where an [`EffectiveMode`] comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeSource {
    /// No applicable scope ever held a snapshot.
    NoSnapshot,
    Snapshot {
        scope: Scope,
        version: u64,
    },
    /// That scope's snapshot expired: closed.
    Expired {
        scope: Scope,
        version: u64,
    },
    /// That scope's persisted state did not verify: closed.
    Unverifiable {
        scope: Scope,
        version: u64,
    },
}

/// The mode a submit obeys, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EffectiveMode {
    pub mode: Mode,
    pub source: ModeSource,
}

impl EffectiveMode {
    /// What a deployment without any snapshot runs in.
    pub const NO_SNAPSHOT: EffectiveMode =
        EffectiveMode { mode: Mode::Normal, source: ModeSource::NoSnapshot };

    /// A stable reason code for rejections and logs.
    pub const fn reason(&self) -> &'static str {
        match self.source {
            ModeSource::Expired { .. } => "MODE_EXPIRED",
            ModeSource::Unverifiable { .. } => "MODE_UNVERIFIABLE",
            ModeSource::NoSnapshot | ModeSource::Snapshot { .. } => match self.mode {
                Mode::Normal => "MODE_NORMAL",
                Mode::ShedLoad { .. } => "MODE_SHED_LOAD",
                Mode::SubmitClosed => "MODE_SUBMIT_CLOSED",
                Mode::QueryOnly => "MODE_QUERY_ONLY",
                Mode::Recovering { .. } => "MODE_RECOVERING",
            },
        }
    }

    /// Whether this refuses every submission (expired/unverifiable sources always do).
    pub const fn closes_submissions(&self) -> bool {
        matches!(self.source, ModeSource::Expired { .. } | ModeSource::Unverifiable { .. })
            || self.mode.closes_submissions()
    }

    /// The share admitted, in percent (0 when closed).
    pub const fn admit_percent(&self) -> u8 {
        if self.closes_submissions() {
            0
        } else {
            self.mode.admit_percent()
        }
    }

    /// Lower = more restrictive: by admitted share, then QUERY_ONLY, unverifiable, expired,
    /// SUBMIT_CLOSED, RECOVERING, SHED_LOAD, NORMAL.
    const fn restrictiveness(&self) -> (u8, u8) {
        let kind = match (self.source, self.mode) {
            (ModeSource::Unverifiable { .. }, _) => 1,
            (ModeSource::Expired { .. }, _) => 2,
            (_, Mode::QueryOnly) => 0,
            (_, Mode::SubmitClosed) => 3,
            (_, Mode::Recovering { .. }) => 4,
            (_, Mode::ShedLoad { .. }) => 5,
            (_, Mode::Normal) => 6,
        };
        (self.admit_percent(), kind)
    }
}

/// The accepted snapshot per scope, on every instance (and every shard: `Clone`, updated by
/// version). The key is held so that nothing unverified can enter.
#[derive(Debug, Clone)]
pub struct ModeTable {
    pub(super) key: HmacKey,
    pub(super) config: ModeConfig,
    pub(super) entries: HashMap<Scope, Entry>,
    /// Bumped by every accepted snapshot: shards holding a copy (or caching `effective` per
    /// SKU) compare it to know whether theirs is current.
    revision: u64,
}

impl ModeTable {
    /// An empty table: every SKU NORMAL until a snapshot arrives.
    pub fn new(key: HmacKey, config: ModeConfig) -> ModeTable {
        if let Err(why) = config.validate() {
            panic!("invalid ModeConfig: {why}");
        }
        ModeTable { key, config, entries: HashMap::new(), revision: 0 }
    }

    /// Everything closed until a valid global snapshot arrives (any version), after which the
    /// recovery ramp applies: for a persisted state that could not be read at all.
    pub fn fail_closed(key: HmacKey, config: ModeConfig) -> ModeTable {
        let mut table = ModeTable::new(key, config);
        table
            .entries
            .insert(Scope::Global, Entry::Unverifiable { version: 0, recovery_required: true });
        table
    }

    /// Verifies `signed` and, if every rule holds, makes it its scope's snapshot.
    pub fn apply(&mut self, signed: &SignedSnapshot, now_ms: u64) -> Result<Applied, ModeError> {
        let snapshot = verify(&self.key, signed, now_ms)?;
        let scope = snapshot.scope;
        let current = self.entries.get(&scope);
        match current {
            Some(entry) if snapshot.version <= entry.version() => {
                return Err(ModeError::StaleVersion {
                    scope,
                    current: entry.version(),
                    offered: snapshot.version,
                });
            }
            None if self.entries.len() >= self.config.scopes_max => {
                return Err(ModeError::TableFull { scopes_max: self.config.scopes_max });
            }
            _ => {}
        }
        let previous = current.map(Entry::mode);
        let from = previous.unwrap_or(Mode::Normal);
        let required = current.is_some_and(Entry::recovery_required);
        let recovery_required = transition(
            scope,
            from,
            required,
            snapshot.mode,
            self.config.recovering_step_percent_max,
        )?;
        self.entries.insert(scope, Entry::Accepted { signed: signed.clone(), recovery_required });
        self.revision += 1;
        Ok(Applied { scope, version: snapshot.version, previous, mode: snapshot.mode })
    }

    /// The rule for an operator's new snapshot on top of [`ModeTable::apply`]'s: its version is
    /// at most `MODE_VERSION_STEP_MAX` above the scope's current one (0 for a scope without a
    /// snapshot). Not applied to snapshots replicated from the mode bucket or the state file:
    /// those were checked where an operator posted them, and refusing them here would leave
    /// an instance that lost its state behind the fleet.
    pub fn check_version_step(&self, snapshot: &ModeSnapshot) -> Result<(), ModeError> {
        let current = self.entries.get(&snapshot.scope).map_or(0, Entry::version);
        if snapshot.version > current.saturating_add(MODE_VERSION_STEP_MAX) {
            return Err(ModeError::VersionJump {
                scope: snapshot.scope,
                current,
                offered: snapshot.version,
                step_max: MODE_VERSION_STEP_MAX,
            });
        }
        Ok(())
    }

    /// The mode a submit for (`activity_id`, `sku_id`) obeys at `now_ms`: the most
    /// restrictive of the global, activity and SKU entries (see the module doc).
    pub fn effective(&self, activity_id: u64, sku_id: u64, now_ms: u64) -> EffectiveMode {
        let chain = [Scope::Global, Scope::Activity(activity_id), Scope::Sku(activity_id, sku_id)];
        let mut best: Option<EffectiveMode> = None;
        for scope in chain {
            let Some(entry) = self.entries.get(&scope) else { continue };
            let candidate = match entry {
                Entry::Unverifiable { version, .. } => EffectiveMode {
                    mode: Mode::SubmitClosed,
                    source: ModeSource::Unverifiable { scope, version: *version },
                },
                Entry::Accepted { signed, .. } => {
                    let snapshot = &signed.snapshot;
                    let version = snapshot.version;
                    if snapshot.is_expired(now_ms) {
                        EffectiveMode {
                            mode: Mode::SubmitClosed,
                            source: ModeSource::Expired { scope, version },
                        }
                    } else {
                        EffectiveMode {
                            mode: snapshot.mode,
                            source: ModeSource::Snapshot { scope, version },
                        }
                    }
                }
            };
            // Ties go to the narrower scope (it names the more precise cause).
            best = match best {
                Some(b) if b.restrictiveness() < candidate.restrictiveness() => Some(b),
                _ => Some(candidate),
            };
        }
        best.unwrap_or(EffectiveMode::NO_SNAPSHOT)
    }

    /// The accepted snapshot of `scope`, if any (for the admin API and replication).
    pub fn snapshot(&self, scope: Scope) -> Option<&SignedSnapshot> {
        match self.entries.get(&scope) {
            Some(Entry::Accepted { signed, .. }) => Some(signed),
            _ => None,
        }
    }

    /// The highest version `scope` holds (accepted or unverifiable).
    pub fn version(&self, scope: Scope) -> Option<u64> {
        self.entries.get(&scope).map(Entry::version)
    }

    /// Accepted snapshots since this table was created or restored.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Scopes held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Scopes closed because their persisted state did not verify (log it, alert on it).
    pub fn unverifiable_scopes(&self) -> usize {
        self.entries.values().filter(|e| matches!(e, Entry::Unverifiable { .. })).count()
    }
}

/// Judges `from → to` for one scope; returns the recovery flag after the change.
fn transition(
    scope: Scope,
    from: Mode,
    recovery_required: bool,
    to: Mode,
    step_max: u8,
) -> Result<bool, ModeError> {
    match to {
        Mode::QueryOnly => Ok(true),
        Mode::SubmitClosed => Ok(recovery_required),
        Mode::Recovering { admit_percent: to_percent } => {
            let base = match from {
                Mode::Recovering { admit_percent } => Some(admit_percent),
                _ if recovery_required => Some(0),
                _ => None,
            };
            match base {
                Some(from_percent) if to_percent > from_percent.saturating_add(step_max) => {
                    Err(ModeError::StepTooLarge { scope, from_percent, to_percent, step_max })
                }
                _ => Ok(recovery_required),
            }
        }
        Mode::ShedLoad { .. } if recovery_required => {
            Err(ModeError::MustRecover { scope, from, to })
        }
        Mode::ShedLoad { .. } => Ok(false),
        Mode::Normal => match from {
            Mode::Recovering { admit_percent: 100 } => Ok(false),
            Mode::Recovering { admit_percent } => Err(ModeError::StepTooLarge {
                scope,
                from_percent: admit_percent,
                to_percent: 100,
                step_max,
            }),
            _ if recovery_required => Err(ModeError::MustRecover { scope, from, to }),
            _ => Ok(false),
        },
    }
}
