//! Naming the key a TOML error is about.
//!
//! The TOML parser reports where an error is but not which key it belongs
//! to, and its excerpt shows only one line: for an item in the middle of a
//! multi-line array, that line holds no key at all. This module reparses the
//! text into a tree of key positions and maps the error's position back to
//! a dotted path such as `cluster.hosts[1]`.

use std::fmt;
use std::ops::Range;

use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use toml::Spanned;

/// Only as much of a document as locating keys needs.
enum Tree {
    Leaf,
    Table(Vec<(Spanned<String>, Tree)>),
    Array(Vec<Spanned<Tree>>),
}

impl<'de> Deserialize<'de> for Tree {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TreeVisitor)
    }
}

struct TreeVisitor;

macro_rules! leaf {
    ($($name:ident: $t:ty),*) => {
        $(fn $name<E>(self, _: $t) -> Result<Tree, E> { Ok(Tree::Leaf) })*
    };
}

impl<'de> Visitor<'de> for TreeVisitor {
    type Value = Tree;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any TOML value")
    }

    leaf!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_f64: f64, visit_str: &str);

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Tree, M::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Spanned<String>>()? {
            entries.push((key, map.next_value::<Tree>()?));
        }
        Ok(Tree::Table(entries))
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Tree, S::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Spanned<Tree>>()? {
            items.push(item);
        }
        Ok(Tree::Array(items))
    }
}

/// The dotted path of the key that the byte range `at` belongs to, or
/// `None` when the text cannot be reparsed or `at` is outside every key.
pub(crate) fn key_at(text: &str, at: &Range<usize>) -> Option<String> {
    let tree: Tree = toml::from_str(text).ok()?;
    // Errors about a whole table cover it from its `[header]` on; the
    // header's last key is the table's name, so look from the `]`.
    let rest = text.get(at.start..).unwrap_or_default();
    let anchor = match rest.strip_prefix('[') {
        Some(_) => rest.find(']').map_or(at.start, |i| at.start + i),
        None => at.start,
    };
    let mut path = String::new();
    let mut node = &tree;
    loop {
        match node {
            Tree::Leaf => break,
            // A value follows its key, and a table's keys follow its
            // header, so the owner is the last key starting at or before
            // the error.
            Tree::Table(entries) => {
                let Some((key, child)) = entries
                    .iter()
                    .filter(|(k, _)| k.span().start <= anchor)
                    .max_by_key(|(k, _)| k.span().start)
                else {
                    break;
                };
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(&segment(key.get_ref()));
                node = child;
            }
            Tree::Array(items) => {
                let Some((i, item)) = items
                    .iter()
                    .enumerate()
                    .find(|(_, item)| item.span().start <= anchor && anchor < item.span().end)
                else {
                    break;
                };
                path.push_str(&format!("[{i}]"));
                node = item.get_ref();
            }
        }
    }
    (!path.is_empty()).then_some(path)
}

/// The dotted path of the key written on the line holding byte `at`, from
/// the line's `key =` and the table header above it: for errors that stop
/// the text from being reparsed (a number too large for any integer type).
/// `None` when the line assigns no key.
pub(crate) fn key_on_line(text: &str, at: usize) -> Option<String> {
    let at = (0..=at.min(text.len()))
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let line = text[start..].lines().next().unwrap_or_default();
    let (key, _) = line.split_once('=')?;
    let key = dotted(key.trim())?;
    let table = text[..start]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('[') && !l.contains('=') && !l.contains(','))
        .and_then(|h| {
            let h = h.split('#').next().unwrap_or_default().trim();
            let h = h.trim_start_matches('[').trim_end_matches(']');
            dotted(h.trim())
        });
    Some(match table {
        Some(t) => format!("{t}.{key}"),
        None => key,
    })
}

/// A TOML key as written (bare, quoted or dotted) as a dotted path; `None`
/// if it is not one.
fn dotted(written: &str) -> Option<String> {
    let mut parts = Vec::new();
    for part in written.split('.') {
        let p = part.trim();
        let p = p
            .strip_prefix('"')
            .and_then(|q| q.strip_suffix('"'))
            .or_else(|| p.strip_prefix('\'').and_then(|q| q.strip_suffix('\'')))
            .unwrap_or(p);
        let bare_ok = !p.is_empty()
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        let t = part.trim();
        let quoted = t.len() >= 2
            && ((t.starts_with('"') && t.ends_with('"'))
                || (t.starts_with('\'') && t.ends_with('\'')));
        if !bare_ok && !quoted {
            return None;
        }
        parts.push(segment(p));
    }
    (!parts.is_empty()).then(|| parts.join("."))
}

/// A key as it must be written in a dotted path.
pub(crate) fn segment(name: &str) -> String {
    let bare = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare {
        name.to_string()
    } else {
        format!("{name:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(text: &str, needle: &str) -> Option<String> {
        let start = text.find(needle).unwrap();
        key_at(text, &(start..start + needle.len()))
    }

    #[test]
    fn paths() {
        let text = "top = 1\n[cluster]\nhosts = [\n  \"a:1\",\n  { addr = \"b:1\", tags = [\"x\", \"y\"] },\n  \"c\",\n]\nuser = \"u\"\n\
                    [services.\"a b\"]\nlisten = \"l\"\n[services.s]\nsel.ect = 3\n";
        assert_eq!(key(text, "1\n[").as_deref(), Some("top"));
        assert_eq!(key(text, "[cluster]").as_deref(), Some("cluster"));
        assert_eq!(key(text, "\"a:1\"").as_deref(), Some("cluster.hosts[0]"));
        assert_eq!(
            key(text, "\"b:1\"").as_deref(),
            Some("cluster.hosts[1].addr")
        );
        assert_eq!(
            key(text, "\"y\"").as_deref(),
            Some("cluster.hosts[1].tags[1]")
        );
        assert_eq!(key(text, "\"c\"").as_deref(), Some("cluster.hosts[2]"));
        assert_eq!(key(text, "\"u\"").as_deref(), Some("cluster.user"));
        assert_eq!(
            key(text, "\"l\"").as_deref(),
            Some("services.\"a b\".listen")
        );
        assert_eq!(key(text, "3").as_deref(), Some("services.s.sel.ect"));
        // A whole table, as in "missing field" errors.
        let start = text.find("[services.s]").unwrap();
        assert_eq!(
            key_at(text, &(start..text.len())).as_deref(),
            Some("services.s")
        );
        assert_eq!(key_at("x = [", &(0..1)), None);
    }
}
