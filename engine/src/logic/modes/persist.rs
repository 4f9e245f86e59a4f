//! The mode table's persisted form (text in, text out; the file I/O, write + rename, is the
//! control plane's in `durable/modes.rs`): every accepted snapshot with its scope's version
//! and recovery flag, re-verified when read back; what does not verify closes its scope.

use flashsale_io::key::HmacKey;
use serde::{Deserialize, Serialize};

use super::snapshot::{verify_signature, SignedSnapshot, SIGNED_JSON_LEN_MAX};
use super::table::{Entry, ModeConfig, ModeTable};
use super::types::{Mode, ModeError, Scope};

/// Bytes of persisted text allowed per scope (an entry is a signed envelope plus its scope,
/// version and flag).
const PERSISTED_ENTRY_LEN_MAX: usize = SIGNED_JSON_LEN_MAX + 256;
/// Version of the persisted format.
const PERSISTED_FORMAT: u32 = 1;

/// The persisted form: one entry per scope, sorted by scope.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PersistedWire {
    format: u32,
    entries: Vec<PersistedEntry>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PersistedEntry {
    scope: String,
    version: u64,
    recovery_required: bool,
    /// Kept as raw JSON so that one bad entry does not make the whole state unreadable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    signed: Option<serde_json::Value>,
}

impl ModeTable {
    /// The state to write to disk (the caller does the I/O, atomically: write + rename).
    pub fn to_persisted(&self) -> String {
        let mut scopes: Vec<&Scope> = self.entries.keys().collect();
        scopes.sort();
        let entries = scopes
            .into_iter()
            .filter_map(|scope| {
                let entry = self.entries.get(scope)?;
                let signed = match entry {
                    Entry::Accepted { signed, .. } => serde_json::to_value(signed).ok(),
                    Entry::Unverifiable { .. } => None,
                };
                Some(PersistedEntry {
                    scope: scope.to_string(),
                    version: entry.version(),
                    recovery_required: entry.recovery_required(),
                    signed,
                })
            })
            .collect();
        let wire = PersistedWire { format: PERSISTED_FORMAT, entries };
        // Only integers, strings and booleans: serializing cannot fail.
        serde_json::to_string(&wire).expect("the persisted mode state always serializes")
    }

    /// Restores a persisted state, re-verifying every snapshot with `key`. An entry that does
    /// not verify closes its scope (an entry whose scope cannot even be read closes the global
    /// scope); an unreadable document is `Err(Malformed)` — then start from
    /// [`ModeTable::fail_closed`].
    pub fn from_persisted(
        text: &str,
        key: HmacKey,
        config: ModeConfig,
    ) -> Result<ModeTable, ModeError> {
        let mut table = ModeTable::new(key, config);
        let len_max = config.scopes_max.saturating_mul(PERSISTED_ENTRY_LEN_MAX).saturating_add(64);
        if text.len() > len_max {
            return Err(ModeError::Malformed("persisted state too long"));
        }
        let wire: PersistedWire =
            serde_json::from_str(text).map_err(|_| ModeError::Malformed("persisted state json"))?;
        if wire.format != PERSISTED_FORMAT {
            return Err(ModeError::Malformed("persisted state format"));
        }
        if wire.entries.len() > config.scopes_max {
            return Err(ModeError::Malformed("persisted state has too many scopes"));
        }
        for entry in wire.entries {
            let (scope, restored) = table.restore_entry(entry);
            table.merge_restored(scope, restored);
        }
        Ok(table)
    }

    /// One persisted entry → the scope it governs and what it holds.
    fn restore_entry(&self, persisted: PersistedEntry) -> (Scope, Entry) {
        let Some(scope) = Scope::parse(&persisted.scope) else {
            // Which scope it governed is unknown: close everything.
            return (Scope::Global, Entry::Unverifiable { version: 0, recovery_required: true });
        };
        let signed =
            persisted.signed.and_then(|value| serde_json::from_value::<SignedSnapshot>(value).ok());
        let Some(signed) = signed else {
            return (
                scope,
                Entry::Unverifiable {
                    version: restorable(persisted.version),
                    recovery_required: persisted.recovery_required,
                },
            );
        };
        let snapshot = &signed.snapshot;
        let genuine = verify_signature(&self.key, &signed).is_ok()
            && snapshot.scope == scope
            && snapshot.version == persisted.version;
        if genuine {
            // The flag can only be made stricter by what the snapshot itself proves.
            let recovery_required = persisted.recovery_required || snapshot.mode == Mode::QueryOnly;
            (scope, Entry::Accepted { signed, recovery_required })
        } else {
            let version = restorable(persisted.version.max(snapshot.version));
            (scope, Entry::Unverifiable { version, recovery_required: persisted.recovery_required })
        }
    }

    /// Two persisted entries for one scope never come from [`ModeTable::to_persisted`]: keep
    /// the scope closed at the higher version.
    fn merge_restored(&mut self, scope: Scope, restored: Entry) {
        let merged = match self.entries.remove(&scope) {
            None => restored,
            Some(existing) => Entry::Unverifiable {
                version: existing.version().max(restored.version()),
                recovery_required: existing.recovery_required() || restored.recovery_required(),
            },
        };
        self.entries.insert(scope, merged);
    }
}

/// The way out of a scope frozen by a version no snapshot can exceed (one written before
/// versions were bounded, issue 23): it restores closed (unverifiable, recovery required) at
/// version 0, so the next snapshot an operator signs — any valid version (through RECOVERING
/// if the frozen one required it) — reopens it. A scope stays closed until then: never opened by a guess.
fn restorable(version: u64) -> u64 {
    if version > flashsale_io::bounds::MODE_VERSION_MAX {
        0
    } else {
        version
    }
}
