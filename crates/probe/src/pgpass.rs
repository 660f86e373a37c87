//! Passwords from the usual libpq sources.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

/// Looks a password up in `$PGPASSFILE` or `~/.pgpass`, with libpq's
/// matching rules: `host:port:database:user:password`, a field of just
/// `*` matches anything, `\` escapes `:`, `\` and `*`, first matching
/// line wins. As libpq does, a file that is not a plain file, or that its
/// group or others may read or write, is ignored with a warning.
pub fn pgpass_lookup(host: &str, port: u16, dbname: &str, user: &str) -> Option<String> {
    let path = std::env::var_os("PGPASSFILE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pgpass")))?;
    let meta = std::fs::metadata(&path).ok()?;
    if let Some(why) = unsafe_file(&meta) {
        static WARNED: AtomicBool = AtomicBool::new(false);
        if !WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!(path = %path.display(), "password file ignored: {why}");
        }
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    lookup_in(&text, host, port, dbname, user)
}

/// Why libpq would not read a password file with these attributes.
fn unsafe_file(meta: &std::fs::Metadata) -> Option<&'static str> {
    use std::os::unix::fs::PermissionsExt;
    if !meta.is_file() {
        return Some("it is not a plain file");
    }
    (meta.permissions().mode() & 0o077 != 0)
        .then_some("it has group or world access; permissions should be u=rw (0600) or less")
}

fn lookup_in(text: &str, host: &str, port: u16, dbname: &str, user: &str) -> Option<String> {
    let port = port.to_string();
    let want = [host, port.as_str(), dbname, user];
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .find_map(|line| {
            let fields = split_fields(line);
            if fields.len() != 5 {
                return None;
            }
            let matches = fields[..4]
                .iter()
                .zip(want)
                .all(|((f, any), w)| *any || f == w);
            matches.then(|| fields[4].0.clone())
        })
}

/// The fields of a line, unescaped, each with whether it is the wildcard:
/// only a bare `*` is (an escaped `\*` is the character itself).
fn split_fields(line: &str) -> Vec<(String, bool)> {
    let mut fields = vec![(String::new(), false)];
    let mut escaped = vec![false];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    fields.last_mut().expect("non-empty").0.push(n);
                    *escaped.last_mut().expect("non-empty") = true;
                }
            }
            ':' if fields.len() < 5 => {
                fields.push((String::new(), false));
                escaped.push(false);
            }
            _ => fields.last_mut().expect("non-empty").0.push(c),
        }
    }
    for (f, e) in fields.iter_mut().zip(escaped) {
        f.1 = f.0 == "*" && !e;
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_matching_line_wins_and_wildcards_match() {
        let text = "# comment\nother:5432:*:u:no\n127.0.0.1:*:*:u:p\\:w\\\\d\n*:*:*:*:last\n";
        assert_eq!(
            lookup_in(text, "127.0.0.1", 5433, "db", "u").as_deref(),
            Some("p:w\\d")
        );
        assert_eq!(lookup_in(text, "h", 1, "d", "x").as_deref(), Some("last"));
    }

    #[test]
    fn an_escaped_star_is_no_wildcard() {
        let text = "\\*:*:*:u:star\n*:*:*:*:any\n";
        assert_eq!(lookup_in(text, "h", 1, "d", "u").as_deref(), Some("any"));
        assert_eq!(lookup_in(text, "*", 1, "d", "u").as_deref(), Some("star"));
    }

    #[test]
    fn files_others_can_read_are_not_used() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pgpass");
        std::fs::write(&path, "*:*:*:*:pw\n").unwrap();
        for (mode, ok) in [(0o600, true), (0o400, true), (0o640, false), (0o604, false)] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let meta = std::fs::metadata(&path).unwrap();
            assert_eq!(unsafe_file(&meta).is_none(), ok, "{mode:o}");
        }
        assert!(unsafe_file(&std::fs::metadata(dir.path()).unwrap()).is_some());
    }

    #[test]
    fn short_lines_never_match() {
        assert_eq!(lookup_in("a:b:c\n", "a", 1, "c", "d"), None);
    }
}
