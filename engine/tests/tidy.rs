//! Tidy: the layout rules of the engine, io and pg-worker crates, checked by reading the
//! sources (a normal `cargo test`, like lints run as tests). Each rule fails with the file, the
//! line and what to do instead.
//!
//! How the sources are read: a small Rust lexer (comments dropped; string, char and number
//! literals kept as literals, so neither prose nor text can trip a rule), then a walk of each
//! crate's module tree from `lib.rs` / `main.rs` along its `mod` declarations (`name.rs` or
//! `name/mod.rs`, `#[path]` followed; an inline `mod x { .. }` is a module of its own but part
//! of its file). Items under `#[cfg(test)]` are left out, and so are the files only such a
//! `mod` declares (`http/proptests.rs`, `logic/modes/tests.rs`). Code under
//! `#[cfg(feature = "failpoints")]` is kept: that feature builds the same files.
//!
//! 1. **No import circle, in any crate.** The import graph has one node per file; an edge
//!    `a -> b` is every `use` (grouped, `pub use`, `self::`, `super::`, `crate::`, a child
//!    module's name) and every path in code (`crate::x::f()`, `super::Shard`, `admin::error()`
//!    after `use super::admin`) in `a` that names a module of `b` or an item in it. Declaring a
//!    submodule (`mod conn;`) is not importing it. A strongly connected set of more than one
//!    file fails, with the items behind each of its edges.
//! 2. **Layers.** `engine/src` has four layers of folders, each importing only the ones below
//!    it: `logic` and `http` (sans-I/O) < `durable` (the tokio side) < `shard` (the per-core
//!    glommio tasks) < `app` (start-up and CLI glue). No file imports a higher layer, and the
//!    two folders of the bottom layer do not import each other both ways (edges of rule 1).
//! 3. **Sans-I/O stays sans-I/O.** Files under `logic/` and `http/` name no runtime (glommio,
//!    tokio), no socket or file, no Redis connection, log or PostgreSQL client, and do not read
//!    the clock (except `logic/clock.rs`, the one place that does).
//! 4. **Redis layout lives in `io::redis`.** No file under `engine/src` spells a Redis command
//!    as a string literal (the private server stack, which drives `redis-cli`, is exempt).
//! 5. **Functions fit on a screen.** No non-test function in the three crates is longer than
//!    [`FN_LINES_MAX`] lines, except the allow-listed ones, each with its reason; an
//!    allow-listed function that got short again must leave the list.
//!
//! The inventory: `TIDY_REPORT=1 cargo test -p flashsale-engine --test tidy` writes every
//! circle (files, edges, items) and every function over the limit to stdout, and rules 1 and 5
//! report instead of failing.
//!
//! Known limits (it is a reader, not the compiler): no macro is expanded (paths inside
//! `macro_rules!` bodies count where the macro is defined); a name brought in by a glob counts
//! only if it is a module; a path through a name that a `use` binds to an item (`Shard::new`
//! after `use super::Shard`) adds nothing beyond that `use`'s own edge; re-exports are not
//! followed (`use super::RequestCtx` is an edge to `mod.rs` even if `mod.rs` re-exports it);
//! a function-local `use` counts for its whole module; paths to other crates are not edges.
//! `#[cfg(test)]` is honoured on items (a module, function, `impl`, `use`); on a struct field
//! or an expression it would drop more than that one field. Generic brackets `<..>` are not
//! tracked, so a `{` in a signature's const generic would end it early. A function's length
//! counts from its `fn` line (doc comments and attributes above it are free).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Longest non-test function, in lines from its `fn` line to its closing brace.
const FN_LINES_MAX: usize = 70;

/// Functions allowed to be longer, as `path:function` (from the workspace root), each with why.
const LONG_FNS_ALLOWED: &[(&str, &str)] = &[];

/// The source folders whose module trees and import graphs tidy reads.
const CRATE_SOURCES: &[&str] = &["engine/src", "io/src", "pg-worker/src"];

/// Set (to anything but `0`) to print the inventory instead of failing rules 1 and 5.
const REPORT_ENV: &str = "TIDY_REPORT";

fn report_mode() -> bool {
    std::env::var_os(REPORT_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

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

fn relative(path: &Path) -> String {
    path.strip_prefix(workspace()).unwrap_or(path).display().to_string()
}

// ------------------------------------------------------------------------------------------
// The lexer.

#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// A string literal's text as written (escapes not processed); `byte` for `b".."`.
    Str {
        text: String,
        byte: bool,
    },
    /// A char or byte literal, a lifetime or a number: nothing a rule reads.
    Other,
    /// `::`
    PathSep,
    Punct(char),
}

#[derive(Clone, Debug)]
struct Token {
    tok: Tok,
    line: usize,
}

/// The tokens of `source`, comments dropped (nested block comments included).
fn lex(source: &str) -> Vec<Token> {
    let chars: Vec<char> = source.chars().collect();
    let at = |k: usize| chars.get(k).copied().unwrap_or('\0');
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let mut tokens = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let start_line = line;
        if c == '\n' {
            line += 1;
            i += 1;
            continue;
        }
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(chars[i] == '\n');
                    i += 1;
                }
            }
            continue;
        }
        if let Some((text, byte, end)) = string_literal(&chars, i) {
            line += chars[i..end].iter().filter(|&&ch| ch == '\n').count();
            tokens.push(Token { tok: Tok::Str { text, byte }, line: start_line });
            i = end;
            continue;
        }
        if c == '\'' || (c == 'b' && at(i + 1) == '\'') {
            let quote = i + usize::from(c == 'b');
            i = if at(quote + 1) == '\\' {
                // An escape: the quote, the backslash, the escaped char, then up to the quote.
                let mut j = quote + 3;
                while j < chars.len() && chars[j] != '\'' {
                    j += 1;
                }
                j + 1
            } else if at(quote + 2) == '\'' {
                quote + 3
            } else {
                // A lifetime or a loop label.
                let mut j = quote + 1;
                while j < chars.len() && is_word(chars[j]) {
                    j += 1;
                }
                j
            };
            tokens.push(Token { tok: Tok::Other, line: start_line });
            continue;
        }
        if c.is_alphabetic() || c == '_' {
            // `r#name` is the identifier `name`.
            let from = if c == 'r' && at(i + 1) == '#' && is_word(at(i + 2)) { i + 2 } else { i };
            let mut j = from;
            while j < chars.len() && is_word(chars[j]) {
                j += 1;
            }
            tokens.push(Token { tok: Tok::Ident(chars[from..j].iter().collect()), line });
            i = j;
            continue;
        }
        if c.is_ascii_digit() {
            let mut j = i;
            while j < chars.len()
                && (is_word(chars[j]) || (chars[j] == '.' && at(j + 1).is_ascii_digit()))
            {
                j += 1;
            }
            tokens.push(Token { tok: Tok::Other, line });
            i = j;
            continue;
        }
        if c == ':' && at(i + 1) == ':' {
            tokens.push(Token { tok: Tok::PathSep, line });
            i += 2;
            continue;
        }
        tokens.push(Token { tok: Tok::Punct(c), line });
        i += 1;
    }
    tokens
}

/// The string literal starting at `i` (`".."`, `b".."`, `c".."`, `r#".."#`, `br".."`), if
/// one does: its text, whether it is a byte string, and the index after it.
fn string_literal(chars: &[char], i: usize) -> Option<(String, bool, usize)> {
    let at = |k: usize| chars.get(k).copied().unwrap_or('\0');
    let mut j = i;
    let byte = at(j) == 'b';
    if matches!(at(j), 'b' | 'c') {
        j += 1;
    }
    let raw = at(j) == 'r';
    if raw {
        j += 1;
    }
    let mut hashes = 0;
    while raw && at(j) == '#' {
        hashes += 1;
        j += 1;
    }
    if at(j) != '"' {
        return None;
    }
    j += 1;
    let from = j;
    if raw {
        while j < chars.len() {
            if chars[j] == '"' && (1..=hashes).all(|h| at(j + h) == '#') {
                return Some((chars[from..j].iter().collect(), byte, j + 1 + hashes));
            }
            j += 1;
        }
        return Some((chars[from..].iter().collect(), byte, chars.len()));
    }
    while j < chars.len() && chars[j] != '"' {
        j += if chars[j] == '\\' { 2 } else { 1 };
    }
    let end = j.min(chars.len());
    Some((chars[from..end].iter().collect(), byte, (end + 1).min(chars.len())))
}

fn is_punct(tokens: &[Token], i: usize, c: char) -> bool {
    matches!(tokens.get(i), Some(Token { tok: Tok::Punct(p), .. }) if *p == c)
}

fn is_path_sep(tokens: &[Token], i: usize) -> bool {
    matches!(tokens.get(i), Some(Token { tok: Tok::PathSep, .. }))
}

fn ident_at(tokens: &[Token], i: usize) -> Option<&str> {
    match tokens.get(i) {
        Some(Token { tok: Tok::Ident(s), .. }) => Some(s),
        _ => None,
    }
}

/// The index of the bracket that closes the one at `open` (`tokens.len()` if none does).
fn closing(tokens: &[Token], open: usize) -> usize {
    let mut depth = 0i32;
    for (k, t) in tokens.iter().enumerate().skip(open) {
        match t.tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    tokens.len()
}

// ------------------------------------------------------------------------------------------
// What one file says: its modules, `use`s, paths, functions and string literals.

#[derive(Clone, Debug, Default)]
struct FileSyntax {
    /// `#![cfg(test)]` at the top: nothing of the file is compiled outside tests.
    test_only: bool,
    /// Out-of-line `mod name;` declarations.
    mods: Vec<ModDecl>,
    /// Inline `mod name { .. }` blocks, each as its path inside the file.
    inline_mods: Vec<Vec<String>>,
    uses: Vec<UseLeaf>,
    paths: Vec<PathRef>,
    fns: Vec<FnSpan>,
    /// `(text, is a byte string, line)`
    strings: Vec<(String, bool, usize)>,
}

#[derive(Clone, Debug)]
struct ModDecl {
    /// The inline modules the declaration sits in (empty at the file's top level).
    ctx: Vec<String>,
    name: String,
    path_attr: Option<String>,
    /// Declared under `#[cfg(test)]`.
    test: bool,
}

/// One leaf of a `use` tree: `use a::{b, c::d as e}` has the leaves `a::b` and `a::c::d`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct UseLeaf {
    ctx: Vec<String>,
    /// The path, a trailing `self` dropped (`use a::{self}` is `a`).
    segs: Vec<String>,
    /// The name it brings into scope (`None` for a glob or `as _`).
    binding: Option<String>,
    glob: bool,
    /// `use ::name`: always another crate.
    external: bool,
    line: usize,
}

/// A path in code (`a::b::c`, or a single name), outside `use` items.
#[derive(Clone, Debug)]
struct PathRef {
    ctx: Vec<String>,
    segs: Vec<String>,
    line: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct FnSpan {
    name: String,
    line: usize,
    lines: usize,
}

/// True for `cfg(test)` and `cfg(all(.., test, ..))`: what is compiled only for tests.
fn is_test_cfg(attr: &[Token]) -> bool {
    let words: Vec<&str> = attr
        .iter()
        .filter_map(|t| match &t.tok {
            Tok::Ident(s) => Some(s.as_str()),
            _ => None,
        })
        .collect();
    match words.as_slice() {
        ["cfg", "test"] => true,
        ["cfg", "all", rest @ ..] => {
            rest.contains(&"test") && !rest.contains(&"not") && !rest.contains(&"any")
        }
        _ => false,
    }
}

/// The index after the item starting at `from` (its attributes, then up to `;` or its closing
/// brace), or the index of a brace that closes what the item sits in.
fn item_end(tokens: &[Token], from: usize) -> usize {
    let mut depth = 0i32;
    let mut k = from;
    while k < tokens.len() {
        match tokens[k].tok {
            Tok::Punct('#') if depth == 0 && is_punct(tokens, k + 1, '[') => {
                k = closing(tokens, k + 1) + 1;
                continue;
            }
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']') => depth -= 1,
            Tok::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    return k + 1;
                }
                if depth < 0 {
                    return k;
                }
            }
            Tok::Punct(';') if depth == 0 => return k + 1,
            _ => {}
        }
        k += 1;
    }
    k
}

/// The index of the brace that closes the block `from` is in.
fn enclosing_close(tokens: &[Token], from: usize) -> usize {
    let mut depth = 0i32;
    for (k, t) in tokens.iter().enumerate().skip(from) {
        match t.tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth -= 1;
                if depth < 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    tokens.len()
}

/// The name of an item that is `[pub[(..)]] mod name;`.
fn declared_mod(item: &[Token]) -> Option<String> {
    let mut k = 0;
    while is_punct(item, k, '#') {
        k = closing(item, k + 1) + 1;
    }
    if ident_at(item, k) == Some("pub") {
        k += 1;
        if is_punct(item, k, '(') {
            k = closing(item, k) + 1;
        }
    }
    match (ident_at(item, k), ident_at(item, k + 1)) {
        (Some("mod"), Some(name)) if is_punct(item, k + 2, ';') => Some(name.to_owned()),
        _ => None,
    }
}

fn parse_file(source: &str) -> FileSyntax {
    let tokens = lex(source);
    let mut syntax = FileSyntax::default();
    // One entry per open bracket of any kind: the inline module it opens, if any.
    let mut frames: Vec<Option<String>> = Vec::new();
    let mut path_attr: Option<String> = None;
    let mut i = 0;
    while i < tokens.len() {
        let ctx: Vec<String> = frames.iter().flatten().cloned().collect();
        let line = tokens[i].line;
        match &tokens[i].tok {
            Tok::Punct('#') => {
                let inner = is_punct(&tokens, i + 1, '!');
                let open = i + 1 + usize::from(inner);
                if is_punct(&tokens, open, '[') {
                    let close = closing(&tokens, open);
                    let attr = &tokens[open + 1..close.min(tokens.len())];
                    if is_test_cfg(attr) {
                        if inner && frames.is_empty() {
                            syntax.test_only = true;
                            return syntax;
                        }
                        i = if inner {
                            enclosing_close(&tokens, close + 1)
                        } else {
                            let end = item_end(&tokens, close + 1);
                            if let Some(name) = declared_mod(&tokens[close + 1..end]) {
                                syntax.mods.push(ModDecl {
                                    ctx,
                                    name,
                                    path_attr: None,
                                    test: true,
                                });
                            }
                            end
                        };
                        continue;
                    }
                    if let [Token { tok: Tok::Ident(key), .. }, Token { tok: Tok::Punct('='), .. }, Token { tok: Tok::Str { text, .. }, .. }] =
                        attr
                    {
                        if key == "path" {
                            path_attr = Some(text.clone());
                        }
                    }
                }
            }
            Tok::Ident(word) if word == "mod" => {
                if let Some(name) = ident_at(&tokens, i + 1).map(str::to_owned) {
                    if is_punct(&tokens, i + 2, ';') {
                        let path_attr = path_attr.take();
                        syntax.mods.push(ModDecl { ctx, name, path_attr, test: false });
                        i += 3;
                        continue;
                    }
                    if is_punct(&tokens, i + 2, '{') {
                        let mut inline = ctx;
                        inline.push(name.clone());
                        syntax.inline_mods.push(inline);
                        frames.push(Some(name));
                        path_attr = None;
                        i += 3;
                        continue;
                    }
                }
            }
            // `use<'a>` is precise capturing in a type, not an import.
            Tok::Ident(word) if word == "use" && !is_punct(&tokens, i + 1, '<') => {
                i = parse_use(&tokens, i + 1, &ctx, &mut syntax.uses);
                continue;
            }
            Tok::Ident(word) if word == "fn" => {
                if let Some(name) = ident_at(&tokens, i + 1) {
                    if let Some(last_line) = fn_body_end(&tokens, i + 2) {
                        let lines = last_line + 1 - line;
                        syntax.fns.push(FnSpan { name: name.to_owned(), line, lines });
                    }
                    i += 2;
                    continue;
                }
            }
            Tok::Punct('(' | '[' | '{') => frames.push(None),
            Tok::Punct(')' | ']' | '}') => {
                frames.pop();
            }
            Tok::Str { text, byte } => syntax.strings.push((text.clone(), *byte, line)),
            Tok::Ident(first) if !is_path_sep(&tokens, i.wrapping_sub(1)) => {
                let mut segs = vec![first.clone()];
                let mut k = i + 1;
                while is_path_sep(&tokens, k) {
                    let Some(seg) = ident_at(&tokens, k + 1) else { break };
                    segs.push(seg.to_owned());
                    k += 2;
                }
                // `pub(in crate::x)` names a module but imports nothing from it.
                let visibility = ident_at(&tokens, i.wrapping_sub(1)) == Some("in")
                    && is_punct(&tokens, i.wrapping_sub(2), '(');
                if !visibility {
                    syntax.paths.push(PathRef { ctx, segs, line });
                }
                i = k;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    syntax
}

/// Reads the `use` tree after the `use` at `from - 1`; returns the index after its `;`.
fn parse_use(tokens: &[Token], from: usize, ctx: &[String], out: &mut Vec<UseLeaf>) -> usize {
    let external = is_path_sep(tokens, from);
    let mut k = from + usize::from(external);
    use_tree(tokens, &mut k, &[], ctx, external, out);
    while k < tokens.len() && !is_punct(tokens, k, ';') {
        k += 1;
    }
    k + 1
}

fn use_tree(
    tokens: &[Token],
    k: &mut usize,
    prefix: &[String],
    ctx: &[String],
    external: bool,
    out: &mut Vec<UseLeaf>,
) {
    let mut segs = prefix.to_vec();
    loop {
        let line = tokens.get(*k).map_or(0, |t| t.line);
        match tokens.get(*k).map(|t| &t.tok) {
            Some(Tok::Ident(seg)) => {
                segs.push(seg.clone());
                *k += 1;
                if is_path_sep(tokens, *k) {
                    *k += 1;
                    continue;
                }
                if seg == "self" && segs.len() > 1 {
                    segs.pop();
                }
                let mut binding = segs.last().cloned();
                if ident_at(tokens, *k) == Some("as") {
                    binding = ident_at(tokens, *k + 1).filter(|b| *b != "_").map(str::to_owned);
                    *k += 2;
                }
                let ctx = ctx.to_vec();
                out.push(UseLeaf { ctx, segs, binding, glob: false, external, line });
                return;
            }
            Some(Tok::Punct('*')) => {
                *k += 1;
                let ctx = ctx.to_vec();
                out.push(UseLeaf { ctx, segs, binding: None, glob: true, external, line });
                return;
            }
            Some(Tok::Punct('{')) => {
                *k += 1;
                loop {
                    match tokens.get(*k).map(|t| &t.tok) {
                        None => return,
                        Some(Tok::Punct('}')) => {
                            *k += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *k += 1,
                        Some(_) => {
                            let before = *k;
                            use_tree(tokens, k, &segs, ctx, external, out);
                            if *k == before {
                                *k += 1;
                            }
                        }
                    }
                }
            }
            _ => return,
        }
    }
}

/// The line of the brace closing the body of the function whose signature starts at `from`
/// (after its name); `None` for a declaration without a body.
fn fn_body_end(tokens: &[Token], from: usize) -> Option<usize> {
    let mut depth = 0i32;
    for (k, t) in tokens.iter().enumerate().skip(from) {
        match t.tok {
            Tok::Punct('(' | '[') => depth += 1,
            Tok::Punct(')' | ']') => depth -= 1,
            Tok::Punct(';' | '}') if depth == 0 => return None,
            Tok::Punct('{') if depth == 0 => return tokens.get(closing(tokens, k)).map(|t| t.line),
            _ => {}
        }
    }
    None
}

// ------------------------------------------------------------------------------------------
// The module trees and the import graph.

#[derive(Debug)]
struct Module {
    file: String,
    parent: Option<usize>,
    root: usize,
    children: BTreeMap<String, usize>,
    uses: Vec<UseLeaf>,
    paths: Vec<PathRef>,
}

#[derive(Debug, Default)]
struct Tree {
    /// Every `.rs` file under the crates' source folders.
    all_files: BTreeSet<String>,
    /// The files compiled outside tests, reached from a crate root.
    files: BTreeMap<String, FileSyntax>,
    /// Files only a `#[cfg(test)] mod` declares, and the folders of their submodules.
    test_files: BTreeSet<String>,
    test_dirs: BTreeSet<String>,
    modules: Vec<Module>,
    /// `mod` declarations tidy could not follow.
    problems: Vec<String>,
}

/// The folder a module's out-of-line submodules live in.
fn module_dir(file: &str, ctx: &[String]) -> String {
    let (dir, name) = file.rsplit_once('/').unwrap_or(("", file));
    let mut out = if matches!(name, "mod.rs" | "lib.rs" | "main.rs") {
        dir.to_owned()
    } else {
        format!("{dir}/{}", name.trim_end_matches(".rs"))
    };
    for inline in ctx {
        out.push('/');
        out.push_str(inline);
    }
    out
}

fn normalize(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "." | "" => {}
            ".." => {
                parts.pop();
            }
            _ => parts.push(part),
        }
    }
    parts.join("/")
}

impl Tree {
    fn build(sources: &BTreeMap<String, String>, roots: &[String]) -> Tree {
        let mut tree = Tree { all_files: sources.keys().cloned().collect(), ..Tree::default() };
        for root in roots {
            let id = tree.modules.len();
            tree.modules.push(Module {
                file: root.clone(),
                parent: None,
                root: id,
                children: BTreeMap::new(),
                uses: Vec::new(),
                paths: Vec::new(),
            });
            tree.add_file(sources, id);
        }
        tree
    }

    fn add_child(&mut self, parent: usize, name: &str, file: String) -> usize {
        let id = self.modules.len();
        let root = self.modules[parent].root;
        self.modules.push(Module {
            file,
            parent: Some(parent),
            root,
            children: BTreeMap::new(),
            uses: Vec::new(),
            paths: Vec::new(),
        });
        self.modules[parent].children.insert(name.to_owned(), id);
        id
    }

    /// Parses the file of module `top`, adds its inline modules, and follows its `mod`s.
    fn add_file(&mut self, sources: &BTreeMap<String, String>, top: usize) {
        let file = self.modules[top].file.clone();
        let Some(text) = sources.get(&file) else {
            self.problems.push(format!("{file}: not found"));
            return;
        };
        let syntax = parse_file(text);
        if syntax.test_only {
            self.test_files.insert(file.clone());
            self.test_dirs.insert(module_dir(&file, &[]));
            return;
        }
        let mut by_ctx: BTreeMap<Vec<String>, usize> = BTreeMap::new();
        by_ctx.insert(Vec::new(), top);
        let mut inline = syntax.inline_mods.clone();
        inline.sort_by_key(Vec::len);
        for ctx in inline {
            let (Some(name), Some(&parent)) = (ctx.last(), by_ctx.get(&ctx[..ctx.len() - 1]))
            else {
                continue;
            };
            let id = self.add_child(parent, name, file.clone());
            by_ctx.insert(ctx, id);
        }
        for leaf in &syntax.uses {
            if let Some(&m) = by_ctx.get(&leaf.ctx) {
                self.modules[m].uses.push(leaf.clone());
            }
        }
        for path in &syntax.paths {
            if let Some(&m) = by_ctx.get(&path.ctx) {
                self.modules[m].paths.push(path.clone());
            }
        }
        let decls = syntax.mods.clone();
        self.files.insert(file.clone(), syntax);
        for decl in decls {
            let Some(&parent) = by_ctx.get(&decl.ctx) else { continue };
            let child_file = match locate(sources, &file, &decl) {
                Ok(child_file) => child_file,
                Err(problem) => {
                    self.problems.push(problem);
                    continue;
                }
            };
            if decl.test {
                self.test_dirs.insert(module_dir(&child_file, &[]));
                self.test_files.insert(child_file);
                continue;
            }
            let id = self.add_child(parent, &decl.name, child_file);
            self.add_file(sources, id);
        }
    }

    /// The module that `segs`, written in module `m`, starts with, and how many of its
    /// segments name modules (the rest name an item in it). `None` for another crate's path,
    /// a local item's, or a name tidy cannot place.
    fn resolve(&self, m: usize, segs: &[String], depth: usize) -> Option<(usize, usize)> {
        let first = segs.first()?;
        let (mut at, mut used) = match first.as_str() {
            "crate" => (self.modules[m].root, 1),
            "self" => (m, 1),
            "super" => {
                let mut at = m;
                let mut used = 0;
                while segs.get(used).is_some_and(|s| s == "super") {
                    at = self.modules[at].parent?;
                    used += 1;
                }
                (at, used)
            }
            name => (self.module_named(m, name, depth)?, 1),
        };
        while let Some(&child) = segs.get(used).and_then(|s| self.modules[at].children.get(s)) {
            at = child;
            used += 1;
        }
        Some((at, used))
    }

    /// The module a bare `name` denotes in module `m`: a child module, a `use` that binds a
    /// module to that name, or a glob `use` of a module that has such a child.
    fn module_named(&self, m: usize, name: &str, depth: usize) -> Option<usize> {
        if let Some(&child) = self.modules[m].children.get(name) {
            return Some(child);
        }
        if depth > 8 {
            return None;
        }
        let uses = self.modules[m].uses.iter().filter(|leaf| !leaf.external);
        for leaf in uses.clone().filter(|l| !l.glob && l.binding.as_deref() == Some(name)) {
            if let Some((target, used)) = self.resolve(m, &leaf.segs, depth + 1) {
                if used == leaf.segs.len() {
                    return Some(target);
                }
            }
        }
        for leaf in uses.filter(|l| l.glob) {
            if let Some((target, used)) = self.resolve(m, &leaf.segs, depth + 1) {
                let child = self.modules[target].children.get(name);
                if let (true, Some(&child)) = (used == leaf.segs.len(), child) {
                    return Some(child);
                }
            }
        }
        None
    }
}

fn locate(
    sources: &BTreeMap<String, String>,
    file: &str,
    decl: &ModDecl,
) -> Result<String, String> {
    let dir = module_dir(file, &decl.ctx);
    if let Some(path) = &decl.path_attr {
        let base = if decl.ctx.is_empty() {
            file.rsplit_once('/').map_or("", |(d, _)| d).to_owned()
        } else {
            dir
        };
        let target = normalize(&format!("{base}/{path}"));
        return if sources.contains_key(&target) {
            Ok(target)
        } else {
            Err(format!("{file}: `#[path = \"{path}\"] mod {}` names no file", decl.name))
        };
    }
    let flat = format!("{dir}/{}.rs", decl.name);
    let nested = format!("{dir}/{}/mod.rs", decl.name);
    match (sources.contains_key(&flat), sources.contains_key(&nested)) {
        (true, false) => Ok(flat),
        (false, true) => Ok(nested),
        (true, true) => Err(format!("{file}: `mod {}` is both {flat} and {nested}", decl.name)),
        (false, false) => Err(format!("{file}: `mod {}` has no file", decl.name)),
    }
}

/// `(from file, to file)` -> what ties them: `(line, item)`.
type Edges = BTreeMap<(String, String), BTreeSet<(usize, String)>>;

fn import_graph(tree: &Tree) -> Edges {
    let mut edges = Edges::new();
    for (m, module) in tree.modules.iter().enumerate() {
        let uses = module.uses.iter().filter(|l| !l.external).map(|l| (&l.segs, l.line, l.glob));
        let paths =
            module.paths.iter().filter(|p| p.segs.len() > 1).map(|p| (&p.segs, p.line, false));
        for (segs, line, glob) in uses.chain(paths) {
            let Some((target, used)) = tree.resolve(m, segs, 0) else { continue };
            let to = &tree.modules[target].file;
            if *to == module.file {
                continue;
            }
            let item = if used < segs.len() {
                segs[used..].join("::")
            } else if glob {
                format!("{}::*", segs.last().map_or("", String::as_str))
            } else {
                format!("mod {}", segs.last().map_or("", String::as_str))
            };
            edges.entry((module.file.clone(), to.clone())).or_default().insert((line, item));
        }
    }
    edges
}

/// `RequestCtx (line 22), error (lines 308, 311)`: items in the order they first appear.
fn items_text(items: &BTreeSet<(usize, String)>) -> String {
    let mut order: Vec<&str> = Vec::new();
    let mut lines: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (line, item) in items {
        if !lines.contains_key(item.as_str()) {
            order.push(item);
        }
        lines.entry(item).or_default().push(*line);
    }
    let text: Vec<String> = order
        .iter()
        .map(|item| {
            let at: Vec<String> = lines[item].iter().map(usize::to_string).collect();
            let word = if at.len() == 1 { "line" } else { "lines" };
            format!("{item} ({word} {})", at.join(", "))
        })
        .collect();
    text.join(", ")
}

/// The strongly connected components of more than one node, each sorted (Tarjan).
fn cycles(edges: &BTreeSet<(String, String)>) -> Vec<Vec<String>> {
    let nodes: Vec<&String> =
        edges.iter().flat_map(|(a, b)| [a, b]).collect::<BTreeSet<_>>().into_iter().collect();
    let index_of: BTreeMap<&String, usize> =
        nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut adjacent = vec![Vec::new(); nodes.len()];
    for (a, b) in edges {
        if a != b {
            adjacent[index_of[a]].push(index_of[b]);
        }
    }
    let mut tarjan = Tarjan {
        adjacent: &adjacent,
        index: vec![None; nodes.len()],
        low: vec![0; nodes.len()],
        on_stack: vec![false; nodes.len()],
        stack: Vec::new(),
        next: 0,
        found: Vec::new(),
    };
    for v in 0..nodes.len() {
        if tarjan.index[v].is_none() {
            tarjan.visit(v);
        }
    }
    let mut out: Vec<Vec<String>> = tarjan
        .found
        .into_iter()
        .map(|c| {
            let mut names: Vec<String> = c.into_iter().map(|v| nodes[v].clone()).collect();
            names.sort();
            names
        })
        .collect();
    out.sort();
    out
}

struct Tarjan<'a> {
    adjacent: &'a [Vec<usize>],
    index: Vec<Option<usize>>,
    low: Vec<usize>,
    on_stack: Vec<bool>,
    stack: Vec<usize>,
    next: usize,
    found: Vec<Vec<usize>>,
}

impl Tarjan<'_> {
    fn visit(&mut self, v: usize) {
        self.index[v] = Some(self.next);
        self.low[v] = self.next;
        self.next += 1;
        self.stack.push(v);
        self.on_stack[v] = true;
        let adjacent = self.adjacent;
        for &w in &adjacent[v] {
            match self.index[w] {
                None => {
                    self.visit(w);
                    self.low[v] = self.low[v].min(self.low[w]);
                }
                Some(index) if self.on_stack[w] => self.low[v] = self.low[v].min(index),
                Some(_) => {}
            }
        }
        if self.index[v] == Some(self.low[v]) {
            let mut component = Vec::new();
            while let Some(w) = self.stack.pop() {
                self.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                self.found.push(component);
            }
        }
    }
}

/// A shortest loop through `start` inside `members` (`start -> .. -> start`), by BFS.
fn shortest_loop(
    edges: &BTreeSet<(String, String)>,
    members: &[String],
    start: &str,
) -> Vec<String> {
    let inside = |f: &String| members.contains(f);
    let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = VecDeque::from([start]);
    while let Some(at) = queue.pop_front() {
        for (_, to) in edges.iter().filter(|(a, b)| a == at && inside(b)) {
            if to == start {
                let mut path = vec![start.to_owned()];
                let mut back = at;
                while back != start {
                    path.push(back.to_owned());
                    back = came_from[back];
                }
                path.push(start.to_owned());
                path.reverse();
                return path;
            }
            if !came_from.contains_key(to.as_str()) {
                came_from.insert(to, at);
                queue.push_back(to);
            }
        }
    }
    Vec::new()
}

/// Every circle of `graph`: its files, a shortest loop, and each edge with its items.
fn cycles_text(graph: &Edges) -> (usize, String) {
    let pairs: BTreeSet<(String, String)> = graph.keys().cloned().collect();
    let found = cycles(&pairs);
    let mut text = format!("{} import circle(s):\n", found.len());
    for (n, members) in found.iter().enumerate() {
        text += &format!("\ncircle {} ({} files): {}\n", n + 1, members.len(), members.join(", "));
        text += &format!(
            "  for example: {}\n",
            shortest_loop(&pairs, members, &members[0]).join(" -> ")
        );
        for ((from, to), items) in graph {
            if members.contains(from) && members.contains(to) {
                text += &format!("  {from} -> {to}: {}\n", items_text(items));
            }
        }
    }
    (found.len(), text)
}

// ------------------------------------------------------------------------------------------
// The workspace, read once.

fn workspace_tree() -> &'static Tree {
    static TREE: OnceLock<Tree> = OnceLock::new();
    TREE.get_or_init(|| {
        let mut sources = BTreeMap::new();
        let mut roots = Vec::new();
        for dir in CRATE_SOURCES {
            let mut files = Vec::new();
            rust_files(&workspace().join(dir), &mut files);
            for file in files {
                let text = std::fs::read_to_string(&file).expect("read source");
                sources.insert(relative(&file), text);
            }
            for root in ["lib.rs", "main.rs"] {
                let root = format!("{dir}/{root}");
                if sources.contains_key(&root) {
                    roots.push(root);
                }
            }
        }
        Tree::build(&sources, &roots)
    })
}

fn workspace_graph() -> &'static Edges {
    static GRAPH: OnceLock<Edges> = OnceLock::new();
    GRAPH.get_or_init(|| import_graph(workspace_tree()))
}

/// The layer folder of a file under `engine/src` (None for `lib.rs` / `main.rs`).
fn folder_of(file: &str) -> Option<&str> {
    let rest = file.strip_prefix("engine/src/")?;
    rest.split_once('/').map(|(folder, _)| folder)
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

fn engine_files() -> impl Iterator<Item = (&'static String, &'static FileSyntax)> {
    workspace_tree().files.iter().filter(|(file, _)| file.starts_with("engine/src/"))
}

// ------------------------------------------------------------------------------------------
// The rules.

#[test]
fn no_import_circles() {
    if report_mode() {
        return; // `inventory` prints them.
    }
    let (count, text) = cycles_text(workspace_graph());
    assert!(
        count == 0,
        "import circles (a file imports a file that imports it; move the shared type or helper \
         to a file of its own, or to where it belongs). Full inventory: `{REPORT_ENV}=1 cargo \
         test -p flashsale-engine --test tidy`\n{text}"
    );
}

#[test]
fn layers_import_only_downwards() {
    let mut problems = Vec::new();
    for (file, _) in engine_files() {
        match folder_of(file) {
            None if !matches!(file.as_str(), "engine/src/lib.rs" | "engine/src/main.rs") => {
                problems.push(format!("{file}: every module lives in a layer folder"));
            }
            Some(folder) if rank(folder).is_none() => {
                problems.push(format!("{file}: folder `{folder}` is in no layer"));
            }
            _ => {}
        }
    }
    let mut folder_edges: BTreeMap<(&str, &str), Vec<String>> = BTreeMap::new();
    for ((from, to), items) in workspace_graph() {
        let (Some(from_folder), Some(to_folder)) = (folder_of(from), folder_of(to)) else {
            continue;
        };
        let (Some(from_rank), Some(to_rank)) = (rank(from_folder), rank(to_folder)) else {
            continue;
        };
        if to_rank > from_rank {
            problems.push(format!(
                "{from} -> {to}: `{from_folder}` imports the higher layer `{to_folder}` ({}); \
                 move the shared item down to the lower layer (or the task up to where it runs)",
                items_text(items)
            ));
        }
        if from_folder != to_folder {
            folder_edges
                .entry((from_folder, to_folder))
                .or_default()
                .push(format!("{from} -> {to}"));
        }
    }
    for ((a, b), there) in &folder_edges {
        if a < b {
            if let Some(back) = folder_edges.get(&(*b, *a)) {
                problems.push(format!(
                    "folders `{a}` and `{b}` import each other: {}; {}",
                    there.join(", "),
                    back.join(", ")
                ));
            }
        }
    }
    assert!(problems.is_empty(), "layer rule broken:\n{}", problems.join("\n"));
}

/// What a sans-I/O file must not name (a path, or a run of its segments), with what to do
/// instead.
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
    ("deadpool_postgres", "PostgreSQL belongs to `durable/` (through pg-worker)"),
];

/// Whether the path `a::b::c` names `token` as a whole run of its segments.
fn names(path: &str, token: &str) -> bool {
    path == token
        || path.starts_with(&format!("{token}::"))
        || path.ends_with(&format!("::{token}"))
        || path.contains(&format!("::{token}::"))
}

#[test]
fn sans_io_folders_do_no_io() {
    let mut problems = BTreeSet::new();
    for (file, syntax) in engine_files() {
        if !matches!(folder_of(file), Some("logic" | "http")) {
            continue;
        }
        let clock = file == "engine/src/logic/clock.rs";
        let uses = syntax.uses.iter().map(|l| (l.segs.join("::"), l.line));
        let paths = syntax.paths.iter().map(|p| (p.segs.join("::"), p.line));
        for (path, line) in uses.chain(paths) {
            for (token, instead) in SANS_IO_FORBIDDEN {
                if names(&path, token) && !(clock && *token == "SystemTime") {
                    problems.insert(format!("{file}:{line}: names `{token}`: {instead}"));
                }
            }
        }
    }
    let problems: Vec<String> = problems.into_iter().collect();
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
    for (file, syntax) in engine_files() {
        // The private server stack drives redis-server/redis-cli themselves, not the engine's
        // data path.
        if file.starts_with("engine/src/app/stack/") {
            continue;
        }
        for (text, byte, line) in &syntax.strings {
            // `"GET"` alone is also an HTTP method; as bytes it is only ever Redis here.
            if REDIS_COMMANDS.contains(&text.as_str()) && (*byte || text != "GET") {
                let quoted = format!("{}\"{text}\"", if *byte { "b" } else { "" });
                problems.push(format!(
                    "{file}:{line}: spells the Redis command {quoted}; add a typed read or \
                     function to io::redis instead"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "Redis layout outside io::redis:\n{}", problems.join("\n"));
}

/// `(file, function)` of every non-test function over [`FN_LINES_MAX`], longest first.
fn long_functions() -> Vec<(&'static str, &'static FnSpan)> {
    let mut long: Vec<(&str, &FnSpan)> = workspace_tree()
        .files
        .iter()
        .flat_map(|(file, syntax)| syntax.fns.iter().map(move |f| (file.as_str(), f)))
        .filter(|(_, f)| f.lines > FN_LINES_MAX)
        .collect();
    long.sort_by(|a, b| b.1.lines.cmp(&a.1.lines).then(a.0.cmp(b.0)).then(a.1.line.cmp(&b.1.line)));
    long
}

fn long_functions_text() -> String {
    let allowed: BTreeMap<&str, &str> = LONG_FNS_ALLOWED.iter().copied().collect();
    let long = long_functions();
    let mut text = format!("{} function(s) over {FN_LINES_MAX} lines:\n", long.len());
    for (file, f) in long {
        let id = format!("{file}:{}", f.name);
        let why = allowed.get(id.as_str()).map(|r| format!(" (allowed: {r})")).unwrap_or_default();
        text += &format!("  {file}:{} `{}`: {} lines{why}\n", f.line, f.name, f.lines);
    }
    text
}

#[test]
fn functions_fit_on_a_screen() {
    if report_mode() {
        return; // `inventory` prints them.
    }
    let allowed: BTreeMap<&str, &str> = LONG_FNS_ALLOWED.iter().copied().collect();
    let mut seen_long = BTreeSet::new();
    let mut problems = Vec::new();
    for (file, f) in long_functions() {
        let id = format!("{file}:{}", f.name);
        if allowed.contains_key(id.as_str()) {
            seen_long.insert(id);
        } else {
            problems.push(format!(
                "{file}:{}: `{}` is {} lines (> {FN_LINES_MAX}); split it, or add `{id}` to \
                 LONG_FNS_ALLOWED with the reason",
                f.line, f.name, f.lines
            ));
        }
    }
    for id in allowed.keys() {
        if !seen_long.contains(*id) {
            problems.push(format!("{id} is allow-listed but no longer long (or gone): remove it"));
        }
    }
    assert!(
        problems.is_empty(),
        "function length rule broken ({} functions):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// `TIDY_REPORT=1`: the full inventory of rules 1 and 5, on stdout (past the test harness's
/// capture, so no `--nocapture` is needed).
#[test]
fn inventory() {
    if !report_mode() {
        return;
    }
    let (_, circles) = cycles_text(workspace_graph());
    let report = format!("\n=== tidy inventory ===\n{circles}\n{}", long_functions_text());
    std::io::stdout().lock().write_all(report.as_bytes()).expect("write the inventory");
}

#[test]
fn the_checks_see_what_they_claim_to() {
    // On the real tree: every file is either read or known to be test-only, so no rule can
    // pass by reading nothing.
    let tree = workspace_tree();
    assert!(
        tree.problems.is_empty(),
        "mod declarations not followed:\n{}",
        tree.problems.join("\n")
    );
    let unseen: Vec<&String> = tree
        .all_files
        .iter()
        .filter(|f| !tree.files.contains_key(*f) && !tree.test_files.contains(*f))
        .filter(|f| !tree.test_dirs.iter().any(|d| f.starts_with(&format!("{d}/"))))
        .collect();
    assert!(unseen.is_empty(), "files no crate root reaches: {unseen:?}");
    assert!(engine_files().count() > 40, "the engine's sources were found");
    for dir in CRATE_SOURCES {
        assert!(tree.files.contains_key(&format!("{dir}/lib.rs")), "{dir}/lib.rs was read");
        let files = tree.files.keys().filter(|f| f.starts_with(dir)).count();
        let fns: usize =
            tree.files.iter().filter(|(f, _)| f.starts_with(dir)).map(|(_, s)| s.fns.len()).sum();
        assert!(files > 10 && fns > 100, "{dir}: {files} files, {fns} functions");
    }
    assert!(tree.test_files.contains("engine/src/http/proptests.rs"));
    assert!(!tree.files.contains_key("engine/src/http/proptests.rs"));
    assert!(workspace_graph().len() > 100, "the import graph has its edges");
    // The two exemptions are seen, so the rules read what they exempt: the clock's
    // `SystemTime`, and the private stack's `redis-cli` command words.
    let clock = &tree.files["engine/src/logic/clock.rs"];
    assert!(clock.paths.iter().any(|p| names(&p.segs.join("::"), "SystemTime")));
    let stack_commands = tree
        .files
        .iter()
        .filter(|(file, _)| file.starts_with("engine/src/app/stack/"))
        .flat_map(|(_, syntax)| &syntax.strings)
        .filter(|(text, _, _)| REDIS_COMMANDS.contains(&text.as_str()))
        .count();
    assert!(stack_commands > 0, "the stack's Redis command strings are read");
    assert_eq!(folder_of("engine/src/shard/submit.rs"), Some("shard"));
    assert_eq!(folder_of("engine/src/lib.rs"), None);
}

// ------------------------------------------------------------------------------------------
// The reader, on small sources.

fn toy_tree(files: &[(&str, &str)]) -> Tree {
    let sources: BTreeMap<String, String> =
        files.iter().map(|(p, t)| ((*p).to_owned(), (*t).to_owned())).collect();
    Tree::build(&sources, &["t/src/lib.rs".to_owned()])
}

fn toy_edges(tree: &Tree) -> BTreeMap<(String, String), String> {
    import_graph(tree).iter().map(|(k, items)| (k.clone(), items_text(items))).collect()
}

fn edge(from: &str, to: &str) -> (String, String) {
    (format!("t/src/{from}"), format!("t/src/{to}"))
}

#[test]
fn grouped_use_trees_are_read_leaf_by_leaf() {
    let syntax = parse_file(
        "pub use crate::a::{b, c::{d, e as f}, self};\nuse super::g::*;\nuse ::ext::h as _;",
    );
    let leaves: Vec<(String, Option<&str>, bool, bool, usize)> = syntax
        .uses
        .iter()
        .map(|l| (l.segs.join("::"), l.binding.as_deref(), l.glob, l.external, l.line))
        .collect();
    assert_eq!(
        leaves,
        vec![
            ("crate::a::b".to_owned(), Some("b"), false, false, 1),
            ("crate::a::c::d".to_owned(), Some("d"), false, false, 1),
            ("crate::a::c::e".to_owned(), Some("f"), false, false, 1),
            ("crate::a".to_owned(), Some("a"), false, false, 1),
            ("super::g".to_owned(), None, true, false, 2),
            ("ext::h".to_owned(), None, false, true, 3),
        ]
    );
}

#[test]
fn use_and_path_edges_resolve_to_files() {
    let tree = toy_tree(&[
        ("t/src/lib.rs", "pub mod shard;\npub mod logic;\npub fn top() {}\n"),
        (
            "t/src/shard/mod.rs",
            "pub mod conn;\npub mod admin;\nmod inner {\n    pub fn f() { super::admin::ok(); }\n}\n\
             pub struct Shard;\npub fn spawn() { conn::serve(); inner::f(); }\n",
        ),
        (
            "t/src/shard/conn.rs",
            "use super::{admin, Shard};\nuse crate::logic::clock::{self, now};\n\
             pub struct RequestCtx;\npub fn serve() {\n    admin::error();\n    \
             clock::tick();\n    crate::top();\n}\n",
        ),
        ("t/src/shard/admin.rs", "use super::conn::RequestCtx;\npub fn error() {}\npub fn ok() {}\n"),
        ("t/src/logic/mod.rs", "pub mod clock;\n"),
        ("t/src/logic/clock.rs", "pub fn now() {}\npub fn tick() { self::now(); }\n"),
    ]);
    let expected: BTreeMap<(String, String), String> = [
        // A child uses its parent's item; a parent's path into its child; `mod admin;` is no edge.
        (edge("shard/conn.rs", "shard/mod.rs"), "Shard (line 1)"),
        (edge("shard/mod.rs", "shard/conn.rs"), "serve (line 7)"),
        // The sibling module brought in by `use super::{admin}`, then a bare `admin::error()`.
        (edge("shard/conn.rs", "shard/admin.rs"), "mod admin (line 1), error (line 5)"),
        (
            edge("shard/conn.rs", "logic/clock.rs"),
            "mod clock (line 2), now (line 2), tick (line 6)",
        ),
        (edge("shard/conn.rs", "lib.rs"), "top (line 7)"),
        (edge("shard/admin.rs", "shard/conn.rs"), "RequestCtx (line 1)"),
        // An inline module is part of its file: its `super::admin` is the file's edge.
        (edge("shard/mod.rs", "shard/admin.rs"), "ok (line 4)"),
    ]
    .into_iter()
    .map(|(k, v)| (k, v.to_owned()))
    .collect();
    assert_eq!(toy_edges(&tree), expected);
    let pairs: BTreeSet<(String, String)> = import_graph(&tree).keys().cloned().collect();
    assert_eq!(
        cycles(&pairs),
        vec![vec![
            "t/src/shard/admin.rs".to_owned(),
            "t/src/shard/conn.rs".to_owned(),
            "t/src/shard/mod.rs".to_owned()
        ]]
    );
}

#[test]
fn comments_and_strings_make_no_edges() {
    let tree = toy_tree(&[
        ("t/src/lib.rs", "//! Read `crate::b::f` first.\npub mod a;\npub mod b;\n"),
        (
            "t/src/a.rs",
            "/// Calls crate::b::f.\n\
             pub fn a() -> (&'static str, char, char) {\n    \
             /* nested /* crate::b::g */ crate::b::h */ // crate::b::k\n    \
             (r#\"crate::b::i \"quoted\" }\"#, '{', '\\'')\n}\n\
             pub fn after() { let _ = \"} { crate::b::j\"; }\n",
        ),
        ("t/src/b.rs", "pub fn f() {}\n"),
    ]);
    assert_eq!(toy_edges(&tree), BTreeMap::new());
    // The braces inside the literals do not throw off the function lengths either.
    let fns = &tree.files["t/src/a.rs"].fns;
    let spans: Vec<(&str, usize, usize)> =
        fns.iter().map(|f| (f.name.as_str(), f.line, f.lines)).collect();
    assert_eq!(spans, vec![("a", 2, 4), ("after", 6, 1)]);
}

#[test]
fn test_only_code_is_left_out() {
    let tree = toy_tree(&[
        (
            "t/src/lib.rs",
            "pub mod a;\npub mod b;\n#[cfg(test)]\nmod proptests;\n\
             #[cfg(all(test, feature = \"x\"))]\nfn helper() { crate::b::f(); }\n",
        ),
        (
            "t/src/a.rs",
            "pub fn a() {}\n#[cfg(test)]\nmod tests {\n    use crate::b::f;\n    \
             fn long() {\n        super::super::b::f();\n    }\n}\n\
             #[cfg(feature = \"failpoints\")]\npub fn drill() { crate::b::g(); }\n",
        ),
        ("t/src/b.rs", "pub fn f() {}\npub fn g() {}\n"),
        ("t/src/proptests.rs", "use crate::a::a;\n"),
    ]);
    // Only the failpoint code (compiled in that feature's builds) makes an edge.
    let expected: BTreeMap<(String, String), String> =
        [(edge("a.rs", "b.rs"), "g (line 10)".to_owned())].into_iter().collect();
    assert_eq!(toy_edges(&tree), expected);
    assert!(tree.test_files.contains("t/src/proptests.rs"));
    assert!(!tree.files.contains_key("t/src/proptests.rs"));
    let names: Vec<&str> =
        tree.files.values().flat_map(|s| &s.fns).map(|f| f.name.as_str()).collect();
    assert_eq!(names, vec!["a", "drill", "f", "g"]);
    assert!(parse_file("#![cfg(test)]\nuse crate::x::y;\n").test_only);
}

#[test]
fn function_lengths_count_from_fn_to_closing_brace() {
    let syntax = parse_file(
        "trait T {\n    fn declared(&self) -> [u8; 2];\n}\n\
         pub(crate) async fn long<F: Fn() -> u8>(f: F) -> u8\nwhere\n    F: Copy,\n{\n    \
         let g = |x: u8| { x };\n    fn inner() {}\n    g(f())\n}\n",
    );
    let spans: Vec<(&str, usize, usize)> =
        syntax.fns.iter().map(|f| (f.name.as_str(), f.line, f.lines)).collect();
    assert_eq!(spans, vec![("long", 4, 8), ("inner", 9, 1)]);
}

#[test]
fn circles_are_found_in_a_toy_graph() {
    let pairs: BTreeSet<(String, String)> = [
        ("a", "b"),
        ("b", "c"),
        ("c", "a"),
        ("c", "d"),
        ("d", "e"),
        ("e", "d"),
        ("f", "a"),
        ("g", "g"),
    ]
    .iter()
    .map(|(x, y)| ((*x).to_owned(), (*y).to_owned()))
    .collect();
    let to_strings = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    assert_eq!(cycles(&pairs), vec![to_strings(&["a", "b", "c"]), to_strings(&["d", "e"])]);
    assert_eq!(
        shortest_loop(&pairs, &to_strings(&["a", "b", "c"]), "b"),
        to_strings(&["b", "c", "a", "b"])
    );
    let graph: Edges =
        pairs.iter().map(|p| (p.clone(), BTreeSet::from([(3, "X".to_owned())]))).collect();
    let (count, text) = cycles_text(&graph);
    assert_eq!(count, 2);
    assert!(text.contains("  d -> e: X (line 3)\n"), "{text}");
    assert!(!text.contains("c -> d"), "an edge out of a circle is not part of it: {text}");
}

#[test]
fn path_attributes_and_inline_modules_are_followed() {
    let tree = toy_tree(&[
        ("t/src/lib.rs", "#[path = \"odd/place.rs\"]\npub mod a;\npub mod b;\n"),
        ("t/src/odd/place.rs", "pub fn a() { crate::b::inner::f(); }\n"),
        ("t/src/b.rs", "pub mod inner {\n    pub fn f() { crate::a::a(); }\n}\n"),
    ]);
    assert!(tree.problems.is_empty(), "{:?}", tree.problems);
    let expected: BTreeMap<(String, String), String> = [
        (edge("odd/place.rs", "b.rs"), "f (line 1)".to_owned()),
        (edge("b.rs", "odd/place.rs"), "a (line 2)".to_owned()),
    ]
    .into_iter()
    .collect();
    assert_eq!(toy_edges(&tree), expected);
}
