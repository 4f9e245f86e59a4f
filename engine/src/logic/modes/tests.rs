//! The mode rules, property-tested and example by example.

use std::collections::HashMap;

use super::*;
use flashsale_io::key::{HmacKey, KeyError};
use proptest::prelude::*;

const KEY_HEX: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
const OTHER_KEY_HEX: &str = "ff0102030405060708090a0b0c0d0e0f";

fn key() -> HmacKey {
    control_key(KEY_HEX).expect("test key")
}

fn snap(version: u64, scope: Scope, mode: Mode) -> ModeSnapshot {
    ModeSnapshot {
        version,
        scope,
        mode,
        issued_at_ms: 1_000,
        expires_at_ms: 100_000,
        issuer: "ops-alice".into(),
    }
}

fn signed(version: u64, scope: Scope, mode: Mode) -> SignedSnapshot {
    sign(&key(), snap(version, scope, mode)).expect("sign")
}

fn table() -> ModeTable {
    ModeTable::new(key(), ModeConfig::default())
}

fn rec(p: u8) -> Mode {
    Mode::Recovering { admit_percent: p }
}

fn shed(p: u8) -> Mode {
    Mode::ShedLoad { admit_percent: p }
}

#[test]
fn canonical_text_is_fixed() {
    let s = snap(7, Scope::Sku(10001, 20001), rec(25));
    assert_eq!(
        s.canonical_text().unwrap(),
        r#"{"version":7,"scope":"sku:10001:20001","mode":"RECOVERING","admit_percent":25,"issued_at_ms":1000,"expires_at_ms":100000,"issuer":"ops-alice"}"#
    );
    let g = snap(1, Scope::Global, Mode::QueryOnly);
    assert_eq!(
        g.canonical_text().unwrap(),
        r#"{"version":1,"scope":"global","mode":"QUERY_ONLY","issued_at_ms":1000,"expires_at_ms":100000,"issuer":"ops-alice"}"#
    );
    // serde's shape of the struct is the canonical text too (the envelope embeds it).
    assert_eq!(serde_json::to_string(&s).unwrap(), s.canonical_text().unwrap());
    assert_eq!(ModeSnapshot::from_canonical_text(&s.canonical_text().unwrap()), Ok(s));
}

#[test]
fn non_canonical_spellings_are_malformed() {
    let text = snap(7, Scope::Activity(5), Mode::Normal).canonical_text().unwrap();
    for other in [
        text.replace("\"version\":7", "\"version\":07"),
        text.replace("\"version\":7,", "\"version\": 7,"),
        text.replace("activity:5", "activity:05"),
        text.replace("\"mode\":\"NORMAL\"", "\"mode\":\"NORMAL\",\"admit_percent\":null"),
        text.replacen('{', "{ ", 1),
    ] {
        assert!(
            matches!(ModeSnapshot::from_canonical_text(&other), Err(ModeError::Malformed(_))),
            "{other}"
        );
    }
}

#[test]
fn field_rules() {
    let bad = |s: ModeSnapshot| matches!(sign(&key(), s), Err(ModeError::Malformed(_)));
    assert!(bad(snap(0, Scope::Global, Mode::Normal)), "version 0");
    assert!(bad(snap(1, Scope::Global, rec(101))), "percent over 100");
    assert!(bad(ModeSnapshot { expires_at_ms: 1_000, ..snap(1, Scope::Global, Mode::Normal) }));
    assert!(bad(ModeSnapshot { issuer: String::new(), ..snap(1, Scope::Global, Mode::Normal) }));
    assert!(bad(ModeSnapshot { issuer: "a\"b".into(), ..snap(1, Scope::Global, Mode::Normal) }));
    assert!(bad(ModeSnapshot {
        issuer: "x".repeat(ISSUER_LEN_MAX + 1),
        ..snap(1, Scope::Global, Mode::Normal)
    }));
    for text in [
        r#"{"version":1,"scope":"global","mode":"SHED_LOAD","issued_at_ms":1,"expires_at_ms":2,"issuer":"a"}"#,
        r#"{"version":1,"scope":"global","mode":"NORMAL","admit_percent":5,"issued_at_ms":1,"expires_at_ms":2,"issuer":"a"}"#,
        r#"{"version":1,"scope":"global","mode":"PANIC","issued_at_ms":1,"expires_at_ms":2,"issuer":"a"}"#,
        r#"{"version":1,"scope":"planet","mode":"NORMAL","issued_at_ms":1,"expires_at_ms":2,"issuer":"a"}"#,
        r#"{"version":1,"scope":"global","mode":"NORMAL","issued_at_ms":1,"expires_at_ms":2,"issuer":"a","x":1}"#,
        r#"{"version":-1,"scope":"global","mode":"NORMAL","issued_at_ms":1,"expires_at_ms":2,"issuer":"a"}"#,
    ] {
        assert!(
            matches!(ModeSnapshot::from_canonical_text(text), Err(ModeError::Malformed(_))),
            "{text}"
        );
    }
}

#[test]
fn scope_text_round_trips() {
    for scope in [Scope::Global, Scope::Activity(0), Scope::Sku(u64::MAX, 3)] {
        assert_eq!(Scope::parse(&scope.to_string()), Some(scope));
    }
    for bad in ["", "Global", "activity:", "activity:+1", "sku:1", "sku:1:2:3", "sku:01:2"] {
        assert_eq!(Scope::parse(bad), None, "{bad}");
    }
}

#[test]
fn keys() {
    assert!(control_key(KEY_HEX).is_ok());
    assert_eq!(control_key("zz").err(), Some(ModeError::BadKey(KeyError::NotHex)));
    assert_eq!(
        control_key("00112233").err(),
        Some(ModeError::BadKey(KeyError::TooShort { bytes: 4 }))
    );
    assert_eq!(control_key(&"ab".repeat(65)).err(), Some(ModeError::BadKey(KeyError::TooLong)));
    assert_eq!(format!("{:?}", key()), "HmacKey(..)");
}

#[test]
fn verify_checks_signature_then_expiry() {
    let s = signed(1, Scope::Global, Mode::SubmitClosed);
    assert_eq!(verify(&key(), &s, 99_999), Ok(s.snapshot.clone()));
    assert_eq!(verify(&key(), &s, 100_000), Err(ModeError::Expired), "expiry is exclusive");
    let other = control_key(OTHER_KEY_HEX).unwrap();
    assert_eq!(verify(&other, &s, 0), Err(ModeError::BadSignature));
    // A forged AND expired snapshot is reported as forged.
    assert_eq!(verify(&other, &s, 200_000), Err(ModeError::BadSignature));
    let upper = SignedSnapshot { sig_hex: s.sig_hex.to_uppercase(), ..s.clone() };
    assert_eq!(verify(&key(), &upper, 0), Err(ModeError::BadSignature), "one spelling");
    let short = SignedSnapshot { sig_hex: s.sig_hex[..62].to_owned(), ..s.clone() };
    assert_eq!(verify(&key(), &short, 0), Err(ModeError::BadSignature));
    let altered = SignedSnapshot { snapshot: snap(1, Scope::Global, Mode::Normal), ..s };
    assert_eq!(verify(&key(), &altered, 0), Err(ModeError::BadSignature));
}

#[test]
fn envelope_round_trips_and_is_bounded() {
    let s = signed(3, Scope::Activity(9), shed(40));
    let json = s.to_json();
    assert!(json.starts_with(r#"{"snapshot":{"version":3,"scope":"activity:9""#), "{json}");
    assert_eq!(SignedSnapshot::from_json(&json), Ok(s.clone()));
    // Any spelling of the envelope: the MAC covers the canonical text of what was parsed.
    let pretty = serde_json::to_string_pretty(&s).unwrap();
    let parsed = SignedSnapshot::from_json(&pretty).unwrap();
    assert_eq!(verify(&key(), &parsed, 2_000), Ok(s.snapshot.clone()));
    let long = format!("{json}{}", " ".repeat(SIGNED_JSON_LEN_MAX));
    assert_eq!(
        SignedSnapshot::from_json(&long),
        Err(ModeError::Malformed("signed snapshot too long"))
    );
    assert!(SignedSnapshot::from_json(r#"{"snapshot":{},"sig_hex":""}"#).is_err());
}

#[test]
fn versions_strictly_increase_per_scope() {
    let mut t = table();
    let applied = t.apply(&signed(5, Scope::Global, Mode::SubmitClosed), 2_000).unwrap();
    assert_eq!(
        applied,
        Applied { scope: Scope::Global, version: 5, previous: None, mode: Mode::SubmitClosed }
    );
    assert_eq!(
        t.apply(&signed(5, Scope::Global, Mode::Normal), 2_000),
        Err(ModeError::StaleVersion { scope: Scope::Global, current: 5, offered: 5 })
    );
    assert_eq!(
        t.apply(&signed(4, Scope::Global, Mode::Normal), 2_000),
        Err(ModeError::StaleVersion { scope: Scope::Global, current: 5, offered: 4 })
    );
    // Another scope has its own sequence.
    assert!(t.apply(&signed(1, Scope::Activity(1), Mode::Normal), 2_000).is_ok());
    let applied = t.apply(&signed(6, Scope::Global, Mode::Normal), 2_000).unwrap();
    assert_eq!(applied.previous, Some(Mode::SubmitClosed));
    assert_eq!(t.version(Scope::Global), Some(6));
    assert_eq!(t.revision(), 3, "only accepted snapshots bump the revision");
}

#[test]
fn apply_refuses_forged_and_expired() {
    let mut t = table();
    let other = control_key(OTHER_KEY_HEX).unwrap();
    let forged = sign(&other, snap(1, Scope::Global, Mode::Normal)).unwrap();
    assert_eq!(t.apply(&forged, 2_000), Err(ModeError::BadSignature));
    assert_eq!(t.apply(&signed(1, Scope::Global, Mode::Normal), 100_000), Err(ModeError::Expired));
    assert!(t.is_empty(), "nothing refused is kept");
}

#[test]
fn query_only_must_recover_in_steps() {
    let mut t = table();
    let g = Scope::Global;
    t.apply(&signed(1, g, Mode::QueryOnly), 2_000).unwrap();
    let must = |from, to| Err(ModeError::MustRecover { scope: g, from, to });
    assert_eq!(t.apply(&signed(2, g, Mode::Normal), 2_000), must(Mode::QueryOnly, Mode::Normal));
    assert_eq!(t.apply(&signed(2, g, shed(10)), 2_000), must(Mode::QueryOnly, shed(10)));
    assert_eq!(
        t.apply(&signed(2, g, rec(30)), 2_000),
        Err(ModeError::StepTooLarge { scope: g, from_percent: 0, to_percent: 30, step_max: 25 })
    );
    // The detour through SUBMIT_CLOSED does not clear the obligation.
    t.apply(&signed(2, g, Mode::SubmitClosed), 2_000).unwrap();
    assert_eq!(t.apply(&signed(3, g, Mode::Normal), 2_000), must(Mode::SubmitClosed, Mode::Normal));
    t.apply(&signed(3, g, rec(25)), 2_000).unwrap();
    t.apply(&signed(4, g, rec(50)), 2_000).unwrap();
    assert_eq!(
        t.apply(&signed(5, g, Mode::Normal), 2_000),
        Err(ModeError::StepTooLarge { scope: g, from_percent: 50, to_percent: 100, step_max: 25 })
    );
    // Rolling back mid-ramp restarts the ramp from 0.
    t.apply(&signed(5, g, Mode::SubmitClosed), 2_000).unwrap();
    assert!(matches!(
        t.apply(&signed(6, g, rec(50)), 2_000),
        Err(ModeError::StepTooLarge { from_percent: 0, .. })
    ));
    for (v, p) in [(6, 25), (7, 50), (8, 75), (9, 100)] {
        t.apply(&signed(v, g, rec(p)), 2_000).unwrap();
    }
    t.apply(&signed(10, g, Mode::Normal), 2_000).unwrap();
    // Recovered: SHED_LOAD and a direct SUBMIT_CLOSED → NORMAL are allowed again.
    t.apply(&signed(11, g, shed(50)), 2_000).unwrap();
    t.apply(&signed(12, g, Mode::SubmitClosed), 2_000).unwrap();
    t.apply(&signed(13, g, Mode::Normal), 2_000).unwrap();
}

#[test]
fn recovering_steps_also_outside_a_recovery() {
    let mut t = table();
    let s = Scope::Sku(1, 2);
    t.apply(&signed(1, s, Mode::SubmitClosed), 2_000).unwrap();
    // Not after QUERY_ONLY: RECOVERING may start anywhere...
    t.apply(&signed(2, s, rec(60)), 2_000).unwrap();
    // ...but rises in steps, and may drop at any time.
    assert!(matches!(
        t.apply(&signed(3, s, rec(90)), 2_000),
        Err(ModeError::StepTooLarge { from_percent: 60, to_percent: 90, .. })
    ));
    t.apply(&signed(3, s, rec(10)), 2_000).unwrap();
    t.apply(&signed(4, s, rec(35)), 2_000).unwrap();
}

#[test]
fn table_is_bounded() {
    let mut t = ModeTable::new(key(), ModeConfig { scopes_max: 2, ..ModeConfig::default() });
    t.apply(&signed(1, Scope::Global, Mode::Normal), 2_000).unwrap();
    t.apply(&signed(1, Scope::Activity(1), Mode::Normal), 2_000).unwrap();
    assert_eq!(
        t.apply(&signed(1, Scope::Activity(2), Mode::Normal), 2_000),
        Err(ModeError::TableFull { scopes_max: 2 })
    );
    // Existing scopes still update.
    t.apply(&signed(2, Scope::Activity(1), Mode::SubmitClosed), 2_000).unwrap();
}

#[test]
fn effective_is_the_most_restrictive_scope() {
    let mut t = table();
    assert_eq!(t.effective(1, 2, 0), EffectiveMode::NO_SNAPSHOT);
    t.apply(&signed(1, Scope::Sku(1, 2), Mode::Normal), 2_000).unwrap();
    assert_eq!(
        t.effective(1, 2, 2_000),
        EffectiveMode {
            mode: Mode::Normal,
            source: ModeSource::Snapshot { scope: Scope::Sku(1, 2), version: 1 }
        }
    );
    // Another SKU of the same activity is untouched.
    assert_eq!(t.effective(1, 3, 2_000), EffectiveMode::NO_SNAPSHOT);
    // A global kill switch closes the SKU despite its own NORMAL.
    t.apply(&signed(1, Scope::Global, Mode::QueryOnly), 2_000).unwrap();
    assert_eq!(t.effective(1, 2, 2_000).mode, Mode::QueryOnly);
    assert_eq!(t.effective(9, 9, 2_000).reason(), "MODE_QUERY_ONLY");
    // Global ramps: every SKU is capped by the global share.
    t.apply(&signed(2, Scope::Global, rec(25)), 2_000).unwrap();
    assert_eq!(t.effective(1, 2, 2_000).mode, rec(25));
    // An activity can close more.
    t.apply(&signed(1, Scope::Activity(1), shed(10)), 2_000).unwrap();
    assert_eq!(t.effective(1, 2, 2_000).mode, shed(10));
    assert_eq!(t.effective(2, 2, 2_000).mode, rec(25));
}

#[test]
fn expired_closes_but_no_snapshot_is_normal() {
    let mut t = table();
    let mut s = snap(1, Scope::Activity(7), shed(50));
    s.expires_at_ms = 5_000;
    t.apply(&sign(&key(), s).unwrap(), 2_000).unwrap();
    assert_eq!(t.effective(7, 1, 4_999).mode, shed(50));
    let closed = t.effective(7, 1, 5_000);
    assert_eq!(
        closed,
        EffectiveMode {
            mode: Mode::SubmitClosed,
            source: ModeSource::Expired { scope: Scope::Activity(7), version: 1 }
        }
    );
    assert!(closed.closes_submissions());
    assert_eq!(closed.reason(), "MODE_EXPIRED");
    assert_eq!(closed.admit_percent(), 0);
    // Activities that never had a snapshot keep selling.
    assert_eq!(t.effective(8, 1, 5_000), EffectiveMode::NO_SNAPSHOT);
    // A refresh (higher version) re-opens.
    t.apply(&signed(2, Scope::Activity(7), Mode::Normal), 5_000).unwrap();
    assert_eq!(t.effective(7, 1, 5_000).mode, Mode::Normal);
}

#[test]
fn persistence_round_trips_and_reverifies() {
    let mut t = table();
    t.apply(&signed(3, Scope::Global, Mode::QueryOnly), 2_000).unwrap();
    t.apply(&signed(4, Scope::Global, Mode::SubmitClosed), 2_000).unwrap();
    t.apply(&signed(2, Scope::Sku(1, 2), shed(30)), 2_000).unwrap();
    let text = t.to_persisted();
    let back = ModeTable::from_persisted(&text, key(), ModeConfig::default()).unwrap();
    assert_eq!(back.to_persisted(), text);
    assert_eq!(back.version(Scope::Global), Some(4));
    assert_eq!(back.unverifiable_scopes(), 0);
    // The highest version and the recovery obligation survived the restart.
    let mut back = back;
    assert!(matches!(
        back.apply(&signed(4, Scope::Global, Mode::Normal), 2_000),
        Err(ModeError::StaleVersion { .. })
    ));
    assert!(matches!(
        back.apply(&signed(5, Scope::Global, Mode::Normal), 2_000),
        Err(ModeError::MustRecover { .. })
    ));
    // Expired snapshots are restored too (and still close).
    let expired = ModeTable::from_persisted(&text, key(), ModeConfig::default()).unwrap();
    assert_eq!(expired.effective(1, 2, 1_000_000).reason(), "MODE_EXPIRED");
}

#[test]
fn persisted_entries_that_do_not_verify_close_their_scope() {
    let mut t = table();
    t.apply(&signed(3, Scope::Activity(1), Mode::Normal), 2_000).unwrap();
    t.apply(&signed(2, Scope::Activity(2), Mode::Normal), 2_000).unwrap();
    let text = t.to_persisted();
    // Another key (rotation, or a forged file): both scopes closed, versions kept.
    let other = control_key(OTHER_KEY_HEX).unwrap();
    let mut back = ModeTable::from_persisted(&text, other, ModeConfig::default()).unwrap();
    assert_eq!(back.unverifiable_scopes(), 2);
    assert_eq!(
        back.effective(1, 5, 2_000),
        EffectiveMode {
            mode: Mode::SubmitClosed,
            source: ModeSource::Unverifiable { scope: Scope::Activity(1), version: 3 }
        }
    );
    assert_eq!(back.effective(3, 5, 2_000), EffectiveMode::NO_SNAPSHOT);
    // The marker persists as such and is replaced only by a higher version.
    let again = back.to_persisted();
    let mut again_table = ModeTable::from_persisted(&again, key(), ModeConfig::default()).unwrap();
    assert_eq!(again_table.unverifiable_scopes(), 2);
    let other = control_key(OTHER_KEY_HEX).unwrap();
    let new = sign(&other, snap(3, Scope::Activity(1), Mode::Normal)).unwrap();
    assert!(matches!(back.apply(&new, 2_000), Err(ModeError::StaleVersion { .. })));
    let new = sign(&key(), snap(4, Scope::Activity(1), Mode::Normal)).unwrap();
    again_table.apply(&new, 2_000).unwrap();
    assert_eq!(again_table.effective(1, 5, 2_000).mode, Mode::Normal);

    // Tampering inside one entry closes that scope only.
    let tampered = text.replacen("\"mode\":\"NORMAL\"", "\"mode\":\"SUBMIT_CLOSED\"", 1);
    assert_ne!(tampered, text);
    let back = ModeTable::from_persisted(&tampered, key(), ModeConfig::default()).unwrap();
    assert_eq!(back.unverifiable_scopes(), 1);
    assert_eq!(back.effective(2, 1, 2_000).mode, Mode::Normal);
    assert_eq!(back.effective(1, 1, 2_000).reason(), "MODE_UNVERIFIABLE");
}

#[test]
fn unreadable_persisted_state() {
    for text in ["", "{", r#"{"format":2,"entries":[]}"#, r#"{"format":1}"#] {
        assert!(
            matches!(
                ModeTable::from_persisted(text, key(), ModeConfig::default()),
                Err(ModeError::Malformed(_))
            ),
            "{text}"
        );
    }
    // A bad scope closes everything.
    let text =
        r#"{"format":1,"entries":[{"scope":"nowhere","version":1,"recovery_required":false}]}"#;
    let t = ModeTable::from_persisted(text, key(), ModeConfig::default()).unwrap();
    assert_eq!(t.effective(1, 1, 0).reason(), "MODE_UNVERIFIABLE");
    // The fail-closed table: closed until a valid global snapshot, then the ramp.
    let mut t = ModeTable::fail_closed(key(), ModeConfig::default());
    assert!(t.effective(1, 1, 2_000).closes_submissions());
    assert!(matches!(
        t.apply(&signed(1, Scope::Global, Mode::Normal), 2_000),
        Err(ModeError::MustRecover { .. })
    ));
    t.apply(&signed(1, Scope::Global, rec(25)), 2_000).unwrap();
    assert_eq!(t.effective(1, 1, 2_000).mode, rec(25));
}

#[test]
fn metric_values_and_labels() {
    let modes = [Mode::Normal, shed(1), rec(1), Mode::SubmitClosed, Mode::QueryOnly];
    let values: Vec<u8> = modes.iter().map(|m| m.metric_value()).collect();
    assert_eq!(values, [0, 1, 2, 3, 4]);
    assert_eq!(ModeError::BadSignature.label(), "BAD_SIGNATURE");
    assert!(ModeError::StaleVersion { scope: Scope::Global, current: 2, offered: 1 }
        .to_string()
        .contains("version 1 is not above the current 2"));
}

// --- properties -------------------------------------------------------------------------

fn mode_strategy() -> impl Strategy<Value = Mode> {
    prop_oneof![
        Just(Mode::Normal),
        Just(Mode::SubmitClosed),
        Just(Mode::QueryOnly),
        (0u8..=100).prop_map(shed),
        (0u8..=100).prop_map(rec),
        // Small steps too, so that ramps actually get through.
        (0u8..=4).prop_map(|k| rec(k * 25)),
    ]
}

fn scope_strategy() -> impl Strategy<Value = Scope> {
    prop_oneof![
        Just(Scope::Global),
        (0u64..3).prop_map(Scope::Activity),
        (0u64..3, 0u64..3).prop_map(|(a, s)| Scope::Sku(a, s)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any single-byte change of the signed text, or of the signature, never applies.
    #[test]
    fn forged_snapshots_never_apply(
        version in 1u64..1_000_000,
        scope in scope_strategy(),
        mode in mode_strategy(),
        at in any::<proptest::sample::Index>(),
        byte in any::<u8>(),
        in_sig in any::<bool>(),
    ) {
        let original = signed(version, scope, mode);
        let text = original.snapshot.canonical_text().unwrap();
        let mut forged = original.clone();
        if in_sig {
            let mut sig = original.sig_hex.clone().into_bytes();
            let i = at.index(sig.len());
            prop_assume!(sig[i] != byte);
            sig[i] = byte;
            let Ok(sig) = String::from_utf8(sig) else { return Ok(()) };
            forged.sig_hex = sig;
        } else {
            let mut bytes = text.clone().into_bytes();
            let i = at.index(bytes.len());
            prop_assume!(bytes[i] != byte);
            bytes[i] = byte;
            let Ok(changed) = String::from_utf8(bytes) else { return Ok(()) };
            match ModeSnapshot::from_canonical_text(&changed) {
                Ok(snapshot) => forged.snapshot = snapshot,
                Err(_) => return Ok(()), // not even a snapshot: cannot apply
            }
        }
        let mut t = table();
        prop_assert!(t.apply(&forged, 2_000).is_err());
        prop_assert!(t.is_empty());
        // The envelope too: a changed byte either fails to parse, parses to the same
        // signed snapshot (a harmless respelling), or does not apply.
        let json = original.to_json().into_bytes();
        let i = at.index(json.len());
        let mut json2 = json.clone();
        json2[i] = byte;
        if let Ok(s) = std::str::from_utf8(&json2) {
            if let Ok(parsed) = SignedSnapshot::from_json(s) {
                if parsed != original {
                    prop_assert!(t.apply(&parsed, 2_000).is_err());
                }
            }
        }
    }

    /// Whatever the order of arrival, each scope's accepted versions strictly increase,
    /// and with transitions that are always allowed the highest version wins.
    #[test]
    fn versions_never_go_backwards(
        picks in proptest::collection::vec((scope_strategy(), 1u64..40, mode_strategy()), 1..60),
    ) {
        let mut t = table();
        let mut last: HashMap<Scope, u64> = HashMap::new();
        for (scope, version, mode) in &picks {
            if let Ok(applied) = t.apply(&signed(*version, *scope, *mode), 2_000) {
                let before = last.insert(*scope, applied.version);
                prop_assert!(before.is_none_or(|b| b < applied.version));
            }
            prop_assert_eq!(t.version(*scope), last.get(scope).copied());
        }
        // Closing modes are always allowed: then the maximum version per scope wins.
        let mut t = table();
        let mut max: HashMap<Scope, u64> = HashMap::new();
        for (scope, version, _) in &picks {
            let _ = t.apply(&signed(*version, *scope, Mode::SubmitClosed), 2_000);
            let m = max.entry(*scope).or_insert(0);
            *m = (*m).max(*version);
        }
        for (scope, version) in max {
            prop_assert_eq!(t.version(scope), Some(version));
        }
    }

    /// From QUERY_ONLY, a scope reaches NORMAL only from RECOVERING 100, having raised
    /// RECOVERING by at most the step each time, and never passes through SHED_LOAD.
    #[test]
    fn query_only_reaches_normal_only_through_recovering(
        modes in proptest::collection::vec(mode_strategy(), 1..80),
    ) {
        let step = ModeConfig::default().recovering_step_percent_max;
        let mut t = table();
        let g = Scope::Global;
        let mut version = 0;
        let mut in_recovery = false;
        let mut ramp_percent = 0u8;
        let mut previous: Option<Mode> = None;
        for mode in modes {
            version += 1;
            let Ok(applied) = t.apply(&signed(version, g, mode), 2_000) else {
                version -= 1;
                continue;
            };
            prop_assert_eq!(applied.previous, previous);
            match mode {
                Mode::QueryOnly => { in_recovery = true; ramp_percent = 0; }
                Mode::Normal if in_recovery => {
                    prop_assert_eq!(previous, Some(rec(100)));
                    in_recovery = false;
                }
                Mode::Recovering { admit_percent } if in_recovery => {
                    prop_assert!(admit_percent <= ramp_percent.saturating_add(step));
                    ramp_percent = admit_percent;
                }
                Mode::SubmitClosed if in_recovery => ramp_percent = 0,
                Mode::ShedLoad { .. } => prop_assert!(!in_recovery),
                _ => {}
            }
            previous = Some(mode);
            // Persisting and restoring at any point keeps the obligation.
            let restored =
                ModeTable::from_persisted(&t.to_persisted(), key(), ModeConfig::default());
            prop_assert!(restored.is_ok());
            t = restored.unwrap();
        }
    }
}

/// Issue 23: no version that freezes a scope. `u64::MAX` (or anything above 2^53 - 1) is
/// malformed; an operator's jump of more than the step is refused; a scope persisted at such
/// a version before the bound existed restores closed at version 0 and reopens with the next
/// valid snapshot.
#[test]
fn versions_are_bounded_and_a_frozen_scope_has_a_way_out() {
    let bad = |v| {
        matches!(sign(&key(), snap(v, Scope::Global, Mode::Normal)), Err(ModeError::Malformed(_)))
    };
    assert!(bad(u64::MAX) && bad(flashsale_io::bounds::MODE_VERSION_MAX + 1));
    assert!(!bad(flashsale_io::bounds::MODE_VERSION_MAX));

    let step = flashsale_io::bounds::MODE_VERSION_STEP_MAX;
    let mut t = table();
    let first = snap(step + 1, Scope::Sku(1, 2), Mode::SubmitClosed);
    assert!(matches!(
        t.check_version_step(&first),
        Err(ModeError::VersionJump { current: 0, step_max, .. }) if step_max == step
    ));
    assert_eq!(t.check_version_step(&snap(step, Scope::Sku(1, 2), Mode::SubmitClosed)), Ok(()));
    t.apply(&signed(5, Scope::Sku(1, 2), Mode::SubmitClosed), 2_000).unwrap();
    assert!(t.check_version_step(&snap(5 + step + 1, Scope::Sku(1, 2), Mode::Normal)).is_err());
    assert_eq!(t.check_version_step(&snap(5 + step, Scope::Sku(1, 2), Mode::Normal)), Ok(()));

    // A state file written by an older build that accepted u64::MAX.
    let text = t.to_persisted().replace("\"version\":5", &format!("\"version\":{}", u64::MAX));
    assert!(text.contains(&u64::MAX.to_string()), "{text}");
    let mut back = ModeTable::from_persisted(&text, key(), ModeConfig::default()).unwrap();
    assert_eq!(back.effective(1, 2, 2_000).reason(), "MODE_UNVERIFIABLE", "still closed");
    assert_eq!(back.version(Scope::Sku(1, 2)), Some(0));
    back.apply(&signed(1, Scope::Sku(1, 2), Mode::Normal), 2_000).unwrap();
    assert_eq!(back.effective(1, 2, 2_000).mode, Mode::Normal);
}
