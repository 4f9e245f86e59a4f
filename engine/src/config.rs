//! Configuration: a TOML file, overridden by environment variables, overridden by flags
//! (CONTRACT.md section 2). Parsed and validated once in `main`, then passed down by value;
//! nothing below `main` reads the environment.
//!
//! Only the settings that the implemented commands use live here; each later subsystem adds
//! its section (with its bounds checked in [`Config::validate`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::stack::StackEnv;

/// The stack directory used when none is given (CONTRACT.md section 1).
pub const DEFAULT_STACK_DIR: &str = "var/stack";
/// The configuration file read when `--config` is absent and it exists.
pub const DEFAULT_CONFIG_FILE: &str = "flashsale.toml";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid {name}: {message}")]
    Invalid { name: &'static str, message: String },
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub redis_url: String,
    pub pg_url: String,
    pub nats_url: String,
    pub http_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Number of glommio shards (`FLASHSALE_SHARDS`, default: available cores).
    pub shards: usize,
    /// `kid:hexkey,...` as given; parsed and checked by `auth::PassKeys::parse` in `main`.
    pub pass_keys: Option<String>,
    pub admin_token: Option<String>,
    pub control_key: Option<String>,
    /// `FLASHSALE_PAYMENT_KEY` (hex) as given; parsed by `shard::orders::PaymentKey::from_hex`
    /// in `main`. None: payment callbacks are refused.
    pub payment_key: Option<String>,
    /// `decide_submit`'s budgets (`[admission]`, validated).
    pub admission: crate::admission::Budgets,
    /// Where accepted mode snapshots persist (`FLASHSALE_MODE_STATE_FILE`, default
    /// `var/modes.json`).
    pub mode_state_file: PathBuf,
    /// Hot SKUs pinned to shards (`[engine] pins = ["10001:20001=1"]`).
    pub pins: Vec<(crate::router::SkuKey, usize)>,
}

/// The TOML file's shape. Every field optional: the file only overrides defaults.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    redis: Option<UrlSection>,
    pg: Option<UrlSection>,
    nats: Option<UrlSection>,
    http: Option<AddrSection>,
    admin: Option<AdminSection>,
    engine: Option<EngineSection>,
    auth: Option<AuthSection>,
    admission: Option<AdmissionSection>,
}

/// `[admission]`: `decide_submit`'s budgets (defaults derived from the 3 s order SLO in
/// `admission.rs`; override them knowingly, e.g. with the deployment's measured drain rate).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AdmissionSection {
    oldest_pending_age_max_ms: Option<u64>,
    pending_count_max: Option<u64>,
    backlog_sample_age_max_ms: Option<u64>,
    pg_outage_age_max_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AdminSection {
    addr: Option<String>,
    token: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct EngineSection {
    shards: Option<usize>,
    /// `"activity:sku=shard"` entries pinning hot SKUs to shards.
    pins: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuthSection {
    pass_keys: Option<String>,
    control_key: Option<String>,
    payment_key: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct UrlSection {
    url: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AddrSection {
    addr: Option<String>,
}

/// Flag values (highest precedence); `None` = not given.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub redis_url: Option<String>,
    pub pg_url: Option<String>,
    pub nats_url: Option<String>,
    pub http_addr: Option<String>,
    pub admin_addr: Option<String>,
    pub shards: Option<usize>,
}

/// Where the environment comes from: the process environment in `main`, a map in tests.
pub type Env = BTreeMap<String, String>;

pub fn process_env() -> Env {
    std::env::vars().filter(|(k, _)| k.starts_with("FLASHSALE_")).collect()
}

impl Config {
    /// TOML (explicit path, else `flashsale.toml` if present) < env < flags. URL defaults
    /// come from the stack's env file (`var/stack/env`) when a stack was started here.
    pub fn load(
        config_path: Option<&Path>,
        env: &Env,
        flags: &Overrides,
        stack_dir: &Path,
    ) -> Result<Config, ConfigError> {
        let file = match config_path {
            Some(path) => read_file(path)?,
            None if Path::new(DEFAULT_CONFIG_FILE).is_file() => {
                read_file(Path::new(DEFAULT_CONFIG_FILE))?
            }
            None => FileConfig::default(),
        };
        let stack = StackEnv::read(stack_dir);
        let pick = |flag: &Option<String>, var: &str, file: Option<String>, default: String| {
            flag.clone().or_else(|| env.get(var).cloned()).or(file).unwrap_or(default)
        };
        let redis_url = pick(
            &flags.redis_url,
            "FLASHSALE_REDIS_URL",
            file.redis.and_then(|s| s.url),
            stack.as_ref().map_or("redis://127.0.0.1:6379".into(), |s| s.redis_url.clone()),
        );
        let pg_url = pick(
            &flags.pg_url,
            "FLASHSALE_PG_URL",
            file.pg.and_then(|s| s.url),
            stack
                .as_ref()
                .map_or("postgres://postgres@127.0.0.1:5432/postgres".into(), |s| s.pg_url.clone()),
        );
        let nats_url = pick(
            &flags.nats_url,
            "FLASHSALE_NATS_URL",
            file.nats.and_then(|s| s.url),
            stack.as_ref().map_or("nats://127.0.0.1:4222".into(), |s| s.nats_url.clone()),
        );
        let http_addr = pick(
            &flags.http_addr,
            "FLASHSALE_HTTP_ADDR",
            file.http.and_then(|s| s.addr),
            "0.0.0.0:8080".into(),
        );
        let (admin_file_addr, admin_file_token) =
            file.admin.map_or((None, None), |s| (s.addr, s.token));
        let admin_addr = pick(
            &flags.admin_addr,
            "FLASHSALE_ADMIN_ADDR",
            admin_file_addr,
            "127.0.0.1:9090".into(),
        );
        let (file_keys, file_control, file_payment) =
            file.auth.map_or((None, None, None), |s| (s.pass_keys, s.control_key, s.payment_key));
        let optional = |var: &str, file: Option<String>| {
            env.get(var).cloned().or(file).filter(|v| !v.trim().is_empty())
        };
        let admission = admission_budgets(file.admission.unwrap_or_default())?;
        let pins = parse_pins(file.engine.as_ref().and_then(|e| e.pins.as_deref()).unwrap_or(&[]))?;
        let shards = match flags.shards {
            Some(n) => n,
            None => match env.get("FLASHSALE_SHARDS") {
                Some(text) => text.trim().parse().map_err(|_| ConfigError::Invalid {
                    name: "FLASHSALE_SHARDS",
                    message: format!("{text:?} is not a number"),
                })?,
                None => file
                    .engine
                    .and_then(|e| e.shards)
                    .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            },
        };
        if shards == 0 || shards > crate::router::SHARDS_MAX {
            return Err(ConfigError::Invalid {
                name: "FLASHSALE_SHARDS",
                message: format!("{shards} must be between 1 and {}", crate::router::SHARDS_MAX),
            });
        }
        let config = Config {
            redis_url: check_scheme("FLASHSALE_REDIS_URL", redis_url, &["redis://"])?,
            pg_url: check_scheme("FLASHSALE_PG_URL", pg_url, &["postgres://", "postgresql://"])?,
            nats_url: check_scheme("FLASHSALE_NATS_URL", nats_url, &["nats://"])?,
            http_addr: parse_addr("FLASHSALE_HTTP_ADDR", &http_addr)?,
            admin_addr: parse_addr("FLASHSALE_ADMIN_ADDR", &admin_addr)?,
            shards,
            pass_keys: optional("FLASHSALE_PASS_KEYS", file_keys),
            admin_token: optional("FLASHSALE_ADMIN_TOKEN", admin_file_token),
            control_key: optional("FLASHSALE_CONTROL_KEY", file_control),
            payment_key: optional("FLASHSALE_PAYMENT_KEY", file_payment),
            admission,
            mode_state_file: optional("FLASHSALE_MODE_STATE_FILE", None)
                .map_or_else(|| PathBuf::from("var/modes.json"), PathBuf::from),
            pins,
        };
        Ok(config)
    }
}

fn admission_budgets(section: AdmissionSection) -> Result<crate::admission::Budgets, ConfigError> {
    let mut budgets = crate::admission::Budgets::default();
    let fields = [
        (section.oldest_pending_age_max_ms, &mut budgets.oldest_pending_age_max_ms),
        (section.pending_count_max, &mut budgets.pending_count_max),
        (section.backlog_sample_age_max_ms, &mut budgets.backlog_sample_age_max_ms),
        (section.pg_outage_age_max_ms, &mut budgets.pg_outage_age_max_ms),
    ];
    for (value, field) in fields {
        if let Some(value) = value {
            *field = value;
        }
    }
    budgets.validate().map_err(|message| ConfigError::Invalid { name: "[admission]", message })?;
    Ok(budgets)
}

fn parse_pins(entries: &[String]) -> Result<Vec<(crate::router::SkuKey, usize)>, ConfigError> {
    entries
        .iter()
        .map(|entry| {
            let parsed = entry.split_once('=').and_then(|(sku, shard)| {
                let (a, s) = sku.split_once(':')?;
                Some((
                    crate::router::SkuKey::new(a.trim().parse().ok()?, s.trim().parse().ok()?),
                    shard.trim().parse().ok()?,
                ))
            });
            parsed.ok_or_else(|| ConfigError::Invalid {
                name: "[engine] pins",
                message: format!("{entry:?} is not \"activity:sku=shard\""),
            })
        })
        .collect()
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
    toml::from_str(&text)
        .map_err(|e| ConfigError::Parse { path: path.to_path_buf(), message: e.to_string() })
}

fn check_scheme(
    name: &'static str,
    value: String,
    schemes: &[&str],
) -> Result<String, ConfigError> {
    // Comma-separated seeds (cluster) are allowed; each must carry the scheme.
    let ok = value.split(',').all(|part| schemes.iter().any(|s| part.trim().starts_with(s)));
    if ok && !value.trim().is_empty() {
        Ok(value)
    } else {
        Err(ConfigError::Invalid {
            name,
            message: format!("{value:?} must start with {}", schemes.join(" or ")),
        })
    }
}

fn parse_addr(name: &'static str, value: &str) -> Result<SocketAddr, ConfigError> {
    value.parse().map_err(|e| ConfigError::Invalid {
        name,
        message: format!("{value:?} is not host:port ({e})"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Env {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn precedence_is_file_then_env_then_flags() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.toml");
        std::fs::write(
            &path,
            "[redis]\nurl = \"redis://file:1\"\n[pg]\nurl = \"postgres://file/db\"\n",
        )
        .expect("write");
        let e = env(&[("FLASHSALE_PG_URL", "postgres://env/db")]);
        let flags = Overrides { redis_url: Some("redis://flag:3".into()), ..Default::default() };
        let c = Config::load(Some(&path), &e, &flags, dir.path()).expect("config");
        assert_eq!(c.redis_url, "redis://flag:3");
        assert_eq!(c.pg_url, "postgres://env/db");
        assert_eq!(c.nats_url, "nats://127.0.0.1:4222");
    }

    #[test]
    fn stack_env_file_supplies_defaults() {
        let dir = tempfile::tempdir().expect("tempdir");
        let stack = StackEnv {
            redis_url: "redis://127.0.0.1:1111".into(),
            pg_url: "postgres://postgres@127.0.0.1:2222/postgres".into(),
            nats_url: "nats://127.0.0.1:3333".into(),
        };
        std::fs::write(dir.path().join("env"), stack.render()).expect("write");
        let c = Config::load(None, &Env::new(), &Overrides::default(), dir.path()).expect("config");
        assert_eq!(c.redis_url, stack.redis_url);
        assert_eq!(c.pg_url, stack.pg_url);
        assert_eq!(c.nats_url, stack.nats_url);
    }

    #[test]
    fn pins_parse_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.toml");
        std::fs::write(&path, "[engine]\nshards = 2\npins = [\"10001:20001=1\"]\n").expect("w");
        let c =
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).expect("c");
        assert_eq!(c.shards, 2);
        assert_eq!(c.pins, vec![(crate::router::SkuKey::new(10001, 20001), 1)]);
        std::fs::write(&path, "[engine]\npins = [\"10001-20001\"]\n").expect("w");
        let err =
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).unwrap_err();
        assert!(err.to_string().contains("pins"), "{err}");
        let e = env(&[("FLASHSALE_SHARDS", "0")]);
        let err = Config::load(None, &e, &Overrides::default(), dir.path()).unwrap_err();
        assert!(err.to_string().contains("FLASHSALE_SHARDS"), "{err}");
    }

    #[test]
    fn admission_budgets_come_from_the_file_and_are_validated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.toml");
        std::fs::write(&path, "[admission]\npending_count_max = 20000\n").expect("w");
        let c =
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).expect("c");
        assert_eq!(c.admission.pending_count_max, 20_000);
        assert_eq!(
            c.admission.oldest_pending_age_max_ms,
            crate::admission::Budgets::default().oldest_pending_age_max_ms
        );
        std::fs::write(&path, "[admission]\npg_outage_age_max_ms = 0\n").expect("w");
        let err =
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).unwrap_err();
        assert!(err.to_string().contains("[admission]"), "{err}");
    }

    #[test]
    fn bad_values_are_clear_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let e = env(&[("FLASHSALE_REDIS_URL", "http://x")]);
        let err = Config::load(None, &e, &Overrides::default(), dir.path()).unwrap_err();
        assert!(err.to_string().contains("FLASHSALE_REDIS_URL"), "{err}");
        let e = env(&[("FLASHSALE_HTTP_ADDR", "nonsense")]);
        let err = Config::load(None, &e, &Overrides::default(), dir.path()).unwrap_err();
        assert!(err.to_string().contains("FLASHSALE_HTTP_ADDR"), "{err}");
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, "[redis]\nurll = \"x\"\n").expect("write");
        let err =
            Config::load(Some(&path), &Env::new(), &Overrides::default(), dir.path()).unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }
}
