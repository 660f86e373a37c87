//! Passwords from the usual libpq sources.

use std::path::PathBuf;

/// Looks a password up in `$PGPASSFILE` or `~/.pgpass`, with libpq's
/// matching rules: `host:port:database:user:password`, `*` matches
/// anything, `\` escapes `:` and `\`, first matching line wins.
pub fn pgpass_lookup(host: &str, port: u16, dbname: &str, user: &str) -> Option<String> {
    let path = std::env::var_os("PGPASSFILE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pgpass")))?;
    let text = std::fs::read_to_string(path).ok()?;
    lookup_in(&text, host, port, dbname, user)
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
                .all(|(f, w)| f == "*" || f == w);
            matches.then(|| fields[4].clone())
        })
}

fn split_fields(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    fields.last_mut().expect("non-empty").push(n);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            _ => fields.last_mut().expect("non-empty").push(c),
        }
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
    fn short_lines_never_match() {
        assert_eq!(lookup_in("a:b:c\n", "a", 1, "c", "d"), None);
    }
}
