//! Tidy: the engine's layout rules, checked by reading the sources (a normal `cargo test`, like
//! lints run as tests). Each rule fails with the file, the line and what to do instead.
//!
//! 1. **Layers.** `engine/src` has four layers of folders, each importing only the ones below
//!    it: `logic` and `http` (sans-I/O) < `durable` (the tokio side) < `shard` (the per-core
//!    glommio tasks) < `app` (start-up and CLI glue). No file imports a higher layer, and the
//!    two folders of the bottom layer do not import each other both ways.
//! 2. **Sans-I/O stays sans-I/O.** Files under `logic/` and `http/` name no runtime (glommio,
//!    tokio), no socket or file, no Redis connection, log or PostgreSQL client, and do not read
//!    the clock (except `logic/clock.rs`, the one place that does).
//! 3. **Redis layout lives in `io::redis`.** No file under `engine/src` spells a Redis command
//!    as a string literal (the private server stack, which drives `redis-cli`, is exempt).
//! 4. **Functions fit on a screen.** No non-test function in the engine, io or pg-worker
//!    crates is longer than [`FN_LINES_MAX`] lines, except the allow-listed ones, each with its
//!    reason; an allow-listed function that got short again must leave the list.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Longest non-test function, in lines from its `fn` line to its closing brace.
const FN_LINES_MAX: usize = 100;

/// Functions allowed to be longer, as `path:function` (from the workspace root), each with why.
const LONG_FNS_ALLOWED: &[(&str, &str)] = &[];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).expect("read dir").flatten().collect();
    entries.sort_by_key(|e| e.path());
    for entry in entries {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The file's lines before its test module (`#[cfg(test)]` at the start of a line), with
/// comments blanked so that prose cannot trip a rule.
fn code_lines(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).expect("read source");
    let mut lines = Vec::new();
    for line in text.lines() {
        if line.starts_with("#[cfg(test)]") {
            break;
        }
        let trimmed = line.trim_start();
        if trimmed.starts_with("//") {
            lines.push(String::new());
        } else {
            lines.push(line.split(" // ").next().unwrap_or(line).to_owned());
        }
    }
    lines
}

fn relative(path: &Path) -> String {
    path.strip_prefix(workspace()).unwrap_or(path).display().to_string()
}

/// The layer folder of a file under `engine/src` (None for `lib.rs` / `main.rs`).
fn folder_of(path: &Path) -> Option<String> {
    let src = workspace().join("engine/src");
    let rest = path.strip_prefix(&src).ok()?;
    let mut parts = rest.components();
    let first = parts.next()?.as_os_str().to_str()?.to_owned();
    parts.next().map(|_| first)
}

fn rank(folder: &str) -> Option<u8> {
    match folder {
        "logic" | "http" => Some(0),
        "durable" => Some(1),
        "shard" => Some(2),
        "app" => Some(3),
        _ => None,
    }
}

fn engine_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    rust_files(&workspace().join("engine/src"), &mut files);
    files
}

/// Every `crate::<folder>` a line names.
fn crate_folders(line: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        let after = &rest[at + "crate::".len()..];
        let name: String =
            after.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if let Some(group) = after.strip_prefix('{') {
            // `use crate::{a, b}`: every name in the group.
            let group = group.split('}').next().unwrap_or("");
            for item in group.split(',') {
                let item = item.trim().split("::").next().unwrap_or("").trim();
                if !item.is_empty() {
                    found.push(item.to_owned());
                }
            }
        } else if !name.is_empty() {
            found.push(name);
        }
        rest = &after[1..];
    }
    found
}

#[test]
fn layers_import_only_downwards() {
    let mut problems = Vec::new();
    let mut edges: BTreeSet<(String, String)> = BTreeSet::new();
    for path in engine_files() {
        let Some(from) = folder_of(&path) else {
            let root_file = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if !matches!(root_file, "lib.rs" | "main.rs") {
                problems.push(format!("{}: every module lives in a layer folder", relative(&path)));
            }
            continue;
        };
        let Some(from_rank) = rank(&from) else {
            problems.push(format!("{}: folder `{from}` is in no layer", relative(&path)));
            continue;
        };
        for (n, line) in code_lines(&path).iter().enumerate() {
            for to in crate_folders(line) {
                let Some(to_rank) = rank(&to) else { continue };
                if to_rank > from_rank {
                    problems.push(format!(
                        "{}:{}: `{from}` imports the higher layer `{to}`; move the shared item \
                         down to the lower layer (or the task up to where it runs)",
                        relative(&path),
                        n + 1
                    ));
                }
                if to != from {
                    edges.insert((from.clone(), to));
                }
            }
        }
    }
    for (a, b) in &edges {
        if a < b && edges.contains(&(b.clone(), a.clone())) {
            problems.push(format!("folders `{a}` and `{b}` import each other"));
        }
    }
    assert!(problems.is_empty(), "layer rule broken:\n{}", problems.join("\n"));
}

/// What a sans-I/O file must not name, with what to do instead.
const SANS_IO_FORBIDDEN: &[(&str, &str)] = &[
    ("glommio", "runtimes belong to `shard/`"),
    ("tokio", "runtimes belong to `durable/`"),
    ("std::net::TcpStream", "sockets belong to the I/O layers"),
    ("std::fs", "files belong to the I/O layers"),
    ("SystemTime", "take `now_ms` as an argument (`logic/clock.rs` reads the clock)"),
    ("Instant::now", "take the time as an argument"),
    ("flashsale_io::redis::script", "Redis calls belong to the I/O layers"),
    ("flashsale_io::redis::reads", "Redis calls belong to the I/O layers"),
    ("flashsale_io::redis::connection", "Redis calls belong to the I/O layers"),
    ("RedisClient", "Redis calls belong to the I/O layers"),
    ("flashsale_io::log", "the log belongs to `durable/`"),
    ("tokio_postgres", "PostgreSQL belongs to `durable/` (through pg-worker)"),
    ("deadpool", "PostgreSQL belongs to `durable/` (through pg-worker)"),
];

#[test]
fn sans_io_folders_do_no_io() {
    let mut problems = Vec::new();
    for path in engine_files() {
        let folder = folder_of(&path);
        if !matches!(folder.as_deref(), Some("logic" | "http")) {
            continue;
        }
        let clock = path.ends_with("logic/clock.rs");
        for (n, line) in code_lines(&path).iter().enumerate() {
            for (token, instead) in SANS_IO_FORBIDDEN {
                if line.contains(token) && !(clock && *token == "SystemTime") {
                    problems.push(format!(
                        "{}:{}: names `{token}`: {instead}",
                        relative(&path),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "sans-I/O rule broken:\n{}", problems.join("\n"));
}

/// Redis commands the engine has used or might be tempted to spell.
const REDIS_COMMANDS: &[&str] = &[
    "GET", "SET", "DEL", "EXISTS", "INCR", "DECR", "EXPIRE", "HGET", "HSET", "HMGET", "HGETALL",
    "HDEL", "ZADD", "ZREM", "ZCARD", "ZRANGE", "ZSCORE", "ZCOUNT", "SADD", "SREM", "SMEMBERS",
    "SCAN", "FCALL", "FUNCTION", "EVAL", "EVALSHA", "WAIT", "MULTI", "EXEC", "CLUSTER", "ASKING",
    "PING", "INFO", "FLUSHALL",
];

#[test]
fn no_redis_command_is_spelled_in_the_engine() {
    let mut problems = Vec::new();
    for path in engine_files() {
        // The private server stack drives redis-server/redis-cli themselves, not the engine's
        // data path.
        if relative(&path).starts_with("engine/src/app/stack/") {
            continue;
        }
        for (n, line) in code_lines(&path).iter().enumerate() {
            for command in REDIS_COMMANDS {
                // `"GET"` alone is also an HTTP method; as bytes it is only ever Redis here.
                let plain = (*command != "GET").then(|| format!("\"{command}\""));
                for quoted in std::iter::once(format!("b\"{command}\"")).chain(plain) {
                    if line.contains(&quoted) {
                        problems.push(format!(
                            "{}:{}: spells the Redis command {quoted}; add a typed read or \
                             function to io::redis instead",
                            relative(&path),
                            n + 1
                        ));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "Redis layout outside io::redis:\n{}", problems.join("\n"));
}

/// `(name, first line, line count)` of every function in `lines`, by brace matching from the
/// line that declares it (strings with braces inside are rare enough in this codebase that
/// the count is a good guide; the allow-list absorbs the rest).
fn functions(lines: &[String]) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let decl =
            ["fn ", "pub fn ", "pub(crate) fn ", "pub(super) fn ", "async fn ", "pub async fn "]
                .iter()
                .chain(
                    ["pub(crate) async fn ", "pub(super) async fn ", "const fn ", "pub const fn "]
                        .iter(),
                )
                .find_map(|p| trimmed.strip_prefix(p));
        let Some(rest) = decl else { continue };
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let mut depth = 0i64;
        let mut opened = false;
        for (i, l) in lines.iter().enumerate().skip(start) {
            for c in l.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    ';' if !opened && depth == 0 => break,
                    _ => {}
                }
            }
            if !opened && l.trim_end().ends_with(';') {
                break; // a declaration without a body (trait item)
            }
            if opened && depth <= 0 {
                out.push((name.clone(), start + 1, i - start + 1));
                break;
            }
        }
    }
    out
}

#[test]
fn functions_fit_on_a_screen() {
    let allowed: BTreeMap<&str, &str> = LONG_FNS_ALLOWED.iter().copied().collect();
    let mut seen_long = BTreeSet::new();
    let mut problems = Vec::new();
    let mut files = Vec::new();
    for crate_dir in ["engine/src", "io/src", "pg-worker/src"] {
        rust_files(&workspace().join(crate_dir), &mut files);
    }
    for path in files {
        // Test-only modules.
        if path.file_name().is_some_and(|n| n == "proptests.rs") {
            continue;
        }
        for (name, line, len) in functions(&code_lines(&path)) {
            if len <= FN_LINES_MAX {
                continue;
            }
            let id = format!("{}:{name}", relative(&path));
            if allowed.contains_key(id.as_str()) {
                seen_long.insert(id);
            } else {
                problems.push(format!(
                    "{}:{line}: `{name}` is {len} lines (> {FN_LINES_MAX}); split it, or add \
                     `{id}` to LONG_FNS_ALLOWED with the reason",
                    relative(&path)
                ));
            }
        }
    }
    for id in allowed.keys() {
        if !seen_long.contains(*id) {
            problems.push(format!("{id} is allow-listed but no longer long (or gone): remove it"));
        }
    }
    assert!(problems.is_empty(), "function length rule broken:\n{}", problems.join("\n"));
}

#[test]
fn the_checks_see_what_they_claim_to() {
    // The parsers behind the rules, on known input (so a rule cannot pass by reading nothing).
    assert_eq!(crate_folders("use crate::shard::{a, b};"), vec!["shard"]);
    assert_eq!(crate_folders("use crate::{logic::x, http::y};"), vec!["logic", "http"]);
    let body: Vec<String> =
        ["fn long() {", "    let a = 1;", "    if a > 0 {", "    }", "}", "fn short();"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
    assert_eq!(functions(&body), vec![("long".to_owned(), 1, 5)]);
    assert!(engine_files().len() > 40, "the engine's sources were found");
    assert_eq!(
        folder_of(&workspace().join("engine/src/shard/submit.rs")).as_deref(),
        Some("shard")
    );
    assert_eq!(folder_of(&workspace().join("engine/src/lib.rs")), None);
}
