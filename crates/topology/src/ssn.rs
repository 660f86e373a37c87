//! Parser for the `synchronous_standby_names` setting.
//!
//! The accepted language is the one of PostgreSQL's own scanner and grammar
//! (`syncrep_scanner.l`, `syncrep_gram.y`) together with the check in
//! `check_synchronous_standby_names`, so that pgwarden never disagrees with
//! the server about which standbys may be synchronous:
//!
//! ```text
//! setting := list | NUM '(' list ')' | FIRST NUM '(' list ')' | ANY NUM '(' list ')'
//! list    := name { ',' name }
//! name    := identifier | NUM | '*' | quoted
//! ```
//!
//! Points where PostgreSQL's behaviour is easy to get wrong:
//!
//! * Unquoted identifiers are kept as written, not folded: PostgreSQL stores
//!   them verbatim and compares names case-insensitively at match time, and
//!   we do the same. Quoted names are kept verbatim too (`""` is a quote).
//! * An identifier starts with an ASCII letter, `_` or any non-ASCII byte, and
//!   continues with those, digits and `$`. A run of digits is a number, which
//!   is also a valid standby name in a list (`1, 2` names standbys "1" and "2").
//! * `ANY` and `FIRST` are keywords in any case and only when standing alone;
//!   `anyone` is an identifier, while an unquoted `any` as a name is an error.
//! * The count must be greater than zero. A count larger than the list is
//!   accepted, as PostgreSQL does (commits then wait until enough standbys
//!   with matching names connect).
//! * PostgreSQL treats only the empty string as "no synchronous replication"
//!   and would reject a whitespace-only value; the server therefore never
//!   reports one, and we read it as empty rather than as an error.
//! * Counts above `i32::MAX` are rejected: PostgreSQL reads them with `atoi`,
//!   whose result is then undefined.

use std::fmt;

use serde::{Deserialize, Serialize};

/// How the primary picks synchronous standbys among the listed names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMethod {
    /// Priority-based: the first `num_sync` connected standbys in list order.
    First,
    /// Quorum-based: any `num_sync` of the listed standbys.
    Any,
}

/// A parsed, non-empty `synchronous_standby_names` value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncStandbyNames {
    /// Priority or quorum selection.
    pub method: SyncMethod,
    /// Number of synchronous standbys commits wait for; always at least 1.
    pub num_sync: u32,
    /// Standby names in the order written; `*` matches any standby.
    pub names: Vec<String>,
}

impl SyncStandbyNames {
    /// Position in the list (0-based) of the first entry matching a standby's
    /// `application_name`, or `None` if the standby is not a candidate.
    ///
    /// Like PostgreSQL, names compare ASCII case-insensitively and an entry
    /// `*` (quoted or not) matches every standby.
    pub fn matches(&self, application_name: &str) -> Option<usize> {
        self.names
            .iter()
            .position(|n| n == "*" || n.eq_ignore_ascii_case(application_name))
    }
}

impl fmt::Display for SyncStandbyNames {
    /// Renders the canonical explicit form, which parses back to the same value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let method = match self.method {
            SyncMethod::First => "FIRST",
            SyncMethod::Any => "ANY",
        };
        write!(f, "{method} {} (", self.num_sync)?;
        for (i, name) in self.names.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            if needs_quotes(name) {
                write!(f, "\"{}\"", name.replace('"', "\"\""))?;
            } else {
                f.write_str(name)?;
            }
        }
        f.write_str(")")
    }
}

fn needs_quotes(name: &str) -> bool {
    if name == "*" {
        return false;
    }
    if !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit()) {
        return false;
    }
    let mut chars = name.chars();
    match chars.next() {
        Some(c) if is_ident_start(c) => {}
        _ => return true,
    }
    !chars.all(is_ident_cont) || keyword(name).is_some()
}

/// What went wrong while parsing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SsnErrorKind {
    /// An unexpected token (or end of input) where something else was required.
    Syntax {
        /// What the grammar would have accepted here.
        expected: &'static str,
    },
    /// A double-quoted name was not closed.
    UnterminatedQuote,
    /// The standby count was zero.
    ZeroCount,
    /// The standby count does not fit PostgreSQL's integer.
    CountOutOfRange,
}

/// A rejected `synchronous_standby_names` value, with where it went wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SsnError {
    /// What went wrong.
    pub kind: SsnErrorKind,
    /// Byte offset in the input of the offending token.
    pub offset: usize,
    /// The offending token's text; `None` means end of input.
    pub near: Option<String>,
}

impl fmt::Display for SsnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            SsnErrorKind::Syntax { expected } => {
                write!(f, "syntax error, expected {expected}")?;
            }
            SsnErrorKind::UnterminatedQuote => f.write_str("unterminated quoted name")?,
            SsnErrorKind::ZeroCount => {
                f.write_str("number of synchronous standbys must be greater than zero")?;
            }
            SsnErrorKind::CountOutOfRange => {
                f.write_str("number of synchronous standbys is out of range")?;
            }
        }
        match &self.near {
            Some(tok) => write!(f, " at or near \"{tok}\" (byte {})", self.offset),
            None => write!(f, " at end of input (byte {})", self.offset),
        }
    }
}

impl std::error::Error for SsnError {}

/// Parses a `synchronous_standby_names` value.
///
/// `Ok(None)` means synchronous replication is off (empty or blank value).
pub fn parse(s: &str) -> Result<Option<SyncStandbyNames>, SsnError> {
    if s.chars().all(is_space) {
        return Ok(None);
    }
    let tokens = lex(s)?;
    Parser {
        tokens: &tokens,
        pos: 0,
        end: s.len(),
    }
    .setting()
    .map(Some)
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Name(String),
    Num(String),
    Any,
    First,
    Comma,
    LParen,
    RParen,
    Junk,
}

#[derive(Debug)]
struct Token {
    tok: Tok,
    offset: usize,
    text: String,
}

fn is_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r' | '\x0b' | '\x0c')
}

// The scanner works on bytes and takes every byte >= 0x80 as a letter; for
// UTF-8 text that is the same as taking every non-ASCII char as one.
fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || !c.is_ascii()
}

fn is_ident_cont(c: char) -> bool {
    is_ident_start(c) || c.is_ascii_digit() || c == '$'
}

fn keyword(word: &str) -> Option<Tok> {
    if word.eq_ignore_ascii_case("any") {
        Some(Tok::Any)
    } else if word.eq_ignore_ascii_case("first") {
        Some(Tok::First)
    } else {
        None
    }
}

fn lex(s: &str) -> Result<Vec<Token>, SsnError> {
    let mut out = Vec::new();
    let mut it = s.char_indices().peekable();
    while let Some((start, c)) = it.next() {
        let tok = if is_space(c) {
            continue;
        } else if c == '"' {
            let mut name = String::new();
            loop {
                match it.next() {
                    None => {
                        return Err(SsnError {
                            kind: SsnErrorKind::UnterminatedQuote,
                            offset: start,
                            near: Some(s[start..].to_string()),
                        });
                    }
                    Some((_, '"')) => {
                        if it.next_if(|&(_, c)| c == '"').is_some() {
                            name.push('"');
                        } else {
                            break;
                        }
                    }
                    Some((_, ch)) => name.push(ch),
                }
            }
            Tok::Name(name)
        } else if is_ident_start(c) {
            while it.next_if(|&(_, c)| is_ident_cont(c)).is_some() {}
            let end = it.peek().map_or(s.len(), |&(i, _)| i);
            let word = &s[start..end];
            keyword(word).unwrap_or_else(|| Tok::Name(word.to_string()))
        } else if c.is_ascii_digit() {
            while it.next_if(|&(_, c)| c.is_ascii_digit()).is_some() {}
            let end = it.peek().map_or(s.len(), |&(i, _)| i);
            Tok::Num(s[start..end].to_string())
        } else {
            match c {
                '*' => Tok::Name("*".to_string()),
                ',' => Tok::Comma,
                '(' => Tok::LParen,
                ')' => Tok::RParen,
                _ => Tok::Junk,
            }
        };
        let end = it.peek().map_or(s.len(), |&(i, _)| i);
        out.push(Token {
            tok,
            offset: start,
            text: s[start..end].to_string(),
        });
    }
    Ok(out)
}

struct Parser<'a> {
    tokens: &'a [Token],
    pos: usize,
    end: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<&Tok> {
        self.tokens.get(self.pos).map(|t| &t.tok)
    }

    fn error(&self, kind: SsnErrorKind) -> SsnError {
        match self.tokens.get(self.pos) {
            Some(t) => SsnError {
                kind,
                offset: t.offset,
                near: Some(t.text.clone()),
            },
            None => SsnError {
                kind,
                offset: self.end,
                near: None,
            },
        }
    }

    fn expect(&mut self, want: &Tok, expected: &'static str) -> Result<(), SsnError> {
        if self.peek() == Some(want) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.error(SsnErrorKind::Syntax { expected }))
        }
    }

    fn setting(mut self) -> Result<SyncStandbyNames, SsnError> {
        let method = match self.peek() {
            Some(Tok::First) => Some(SyncMethod::First),
            Some(Tok::Any) => Some(SyncMethod::Any),
            _ => None,
        };
        let explicit_count = method.is_some()
            || (matches!(self.peek(), Some(Tok::Num(_)))
                && matches!(self.tokens.get(self.pos + 1), Some(t) if t.tok == Tok::LParen));
        let result = if explicit_count {
            if method.is_some() {
                self.pos += 1;
            }
            let num_sync = self.count()?;
            self.expect(&Tok::LParen, "\"(\"")?;
            let names = self.list()?;
            self.expect(&Tok::RParen, "\",\" or \")\"")?;
            SyncStandbyNames {
                method: method.unwrap_or(SyncMethod::First),
                num_sync,
                names,
            }
        } else {
            // The original comma-list form means "the first one connected".
            SyncStandbyNames {
                method: SyncMethod::First,
                num_sync: 1,
                names: self.list()?,
            }
        };
        if self.pos < self.tokens.len() {
            let expected = if explicit_count {
                "end of input"
            } else {
                "\",\" or end of input"
            };
            return Err(self.error(SsnErrorKind::Syntax { expected }));
        }
        Ok(result)
    }

    fn count(&mut self) -> Result<u32, SsnError> {
        let Some(Tok::Num(digits)) = self.peek() else {
            return Err(self.error(SsnErrorKind::Syntax {
                expected: "a number of standbys",
            }));
        };
        let n = match digits.parse::<u32>() {
            Ok(n) if n <= i32::MAX as u32 => n,
            _ => return Err(self.error(SsnErrorKind::CountOutOfRange)),
        };
        if n == 0 {
            return Err(self.error(SsnErrorKind::ZeroCount));
        }
        self.pos += 1;
        Ok(n)
    }

    fn list(&mut self) -> Result<Vec<String>, SsnError> {
        let mut names = vec![self.name()?];
        while self.peek() == Some(&Tok::Comma) {
            self.pos += 1;
            names.push(self.name()?);
        }
        Ok(names)
    }

    fn name(&mut self) -> Result<String, SsnError> {
        match self.peek() {
            Some(Tok::Name(n) | Tok::Num(n)) => {
                let n = n.clone();
                self.pos += 1;
                Ok(n)
            }
            _ => Err(self.error(SsnErrorKind::Syntax {
                expected: "a standby name",
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> SyncStandbyNames {
        match parse(s) {
            Ok(Some(v)) => v,
            other => panic!("{s:?} gave {other:?}"),
        }
    }

    fn ssn(method: SyncMethod, n: u32, names: &[&str]) -> SyncStandbyNames {
        SyncStandbyNames {
            method,
            num_sync: n,
            names: names.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn empty_means_off() {
        for s in ["", " ", "\t\n \r\x0b\x0c"] {
            assert_eq!(parse(s), Ok(None), "{s:?}");
        }
    }

    #[test]
    fn accepted_forms() {
        use SyncMethod::*;
        let table: &[(&str, SyncStandbyNames)] = &[
            ("*", ssn(First, 1, &["*"])),
            ("a", ssn(First, 1, &["a"])),
            ("a, b ,c", ssn(First, 1, &["a", "b", "c"])),
            ("2 (a, b)", ssn(First, 2, &["a", "b"])),
            ("2(a,b)", ssn(First, 2, &["a", "b"])),
            ("FIRST 1 (s1)", ssn(First, 1, &["s1"])),
            ("first 3 (a,b)", ssn(First, 3, &["a", "b"])),
            ("ANY 2 (s1, s2, s3)", ssn(Any, 2, &["s1", "s2", "s3"])),
            ("aNy 1 (*)", ssn(Any, 1, &["*"])),
            ("  ANY\n2\t(\ta ,\nb )  ", ssn(Any, 2, &["a", "b"])),
            // Numbers are names inside lists, and a lone number is a list.
            ("1", ssn(First, 1, &["1"])),
            ("1, 2", ssn(First, 1, &["1", "2"])),
            ("2 (1, 007)", ssn(First, 2, &["1", "007"])),
            ("01 (a)", ssn(First, 1, &["a"])),
            // Keywords only when standing alone.
            (
                "anyone, first_standby",
                ssn(First, 1, &["anyone", "first_standby"]),
            ),
            ("_x$1, ÄBC, naïve", ssn(First, 1, &["_x$1", "ÄBC", "naïve"])),
            ("2147483647 (a)", ssn(First, 2147483647, &["a"])),
        ];
        for (input, want) in table {
            assert_eq!(&ok(input), want, "{input:?}");
        }
    }

    #[test]
    fn quoting_and_case() {
        // Unquoted names keep their spelling; matching ignores case anyway.
        let v = ok("FIRST 1 (Alpha, \"Beta\", \"with space\", \"a\"\"b\", \"\", \"any\", \"*\")");
        assert_eq!(
            v.names,
            ["Alpha", "Beta", "with space", "a\"b", "", "any", "*"]
        );
        assert_eq!(v.matches("alpha"), Some(0));
        assert_eq!(v.matches("BETA"), Some(1));
        assert_eq!(v.matches("With Space"), Some(2));
        assert_eq!(v.matches("a\"b"), Some(3));
        assert_eq!(v.matches("ANY"), Some(5));
        // The quoted star still matches everything, as in PostgreSQL.
        assert_eq!(v.matches("zzz"), Some(6));
        assert_eq!(ok("\"multi\nline\"").names, ["multi\nline"]);
        // Non-ASCII letters are not case-folded by the comparison.
        assert_eq!(ok("Ä").matches("ä"), None);
    }

    #[test]
    fn matches_priority() {
        let v = ok("FIRST 2 (s1, s2, *)");
        assert_eq!(v.matches("s1"), Some(0));
        assert_eq!(v.matches("S2"), Some(1));
        assert_eq!(v.matches("other"), Some(2));
        assert_eq!(ok("a, b").matches("c"), None);
        assert_eq!(ok("*, a").matches("a"), Some(0));
    }

    #[test]
    fn rejected_values() {
        use SsnErrorKind::*;
        let syntax = |_: &str| Syntax { expected: "" };
        let table: &[(&str, SsnErrorKind, Option<&str>)] = &[
            ("FIRST", syntax(""), None),
            ("ANY", syntax(""), None),
            ("any", syntax(""), None),
            ("first, a", syntax(""), Some(",")),
            ("a, any", syntax(""), Some("any")),
            ("ANY 0 (a)", ZeroCount, Some("0")),
            ("0 (a)", ZeroCount, Some("0")),
            ("FIRST 00 (a)", ZeroCount, Some("00")),
            ("ANY 2147483648 (a)", CountOutOfRange, Some("2147483648")),
            ("ANY 99999999999999999999 (a)", CountOutOfRange, None),
            ("2 (a", syntax(""), None),
            ("(a)", syntax(""), Some("(")),
            ("a,,b", syntax(""), Some(",")),
            ("a,", syntax(""), None),
            (",a", syntax(""), Some(",")),
            ("\"unterminated", UnterminatedQuote, Some("\"unterminated")),
            ("a, \"b\"\"", UnterminatedQuote, None),
            ("FIRST 1 a", syntax(""), Some("a")),
            ("ANY (a)", syntax(""), Some("(")),
            ("ANY x (a)", syntax(""), Some("x")),
            ("FIRST 1 (a) b", syntax(""), Some("b")),
            ("1 (a) (b)", syntax(""), Some("(")),
            ("a b", syntax(""), Some("b")),
            ("a)", syntax(""), Some(")")),
            ("1a", syntax(""), Some("a")),
            ("a-b", syntax(""), Some("-")),
            ("$a", syntax(""), Some("$")),
            ("a*", syntax(""), Some("*")),
            ("2 ()", syntax(""), Some(")")),
            ("a;", syntax(""), Some(";")),
            ("a\0", syntax(""), Some("\0")),
        ];
        for (input, kind, near) in table {
            let err = parse(input).expect_err(input);
            let same_kind = match (kind, &err.kind) {
                (Syntax { .. }, Syntax { .. }) => true,
                (k, e) => k == e,
            };
            assert!(same_kind, "{input:?}: {err:?}");
            if let Some(near) = near {
                assert_eq!(err.near.as_deref(), Some(*near), "{input:?}");
                assert_eq!(&input[err.offset..err.offset + near.len()], *near);
            }
            assert!(!err.to_string().is_empty());
        }
    }

    #[test]
    fn error_display() {
        let e = parse("FIRST 1 a").unwrap_err();
        assert_eq!(
            e.to_string(),
            "syntax error, expected \"(\" at or near \"a\" (byte 8)"
        );
        let e = parse("2 (a").unwrap_err();
        assert_eq!(
            e.to_string(),
            "syntax error, expected \",\" or \")\" at end of input (byte 4)"
        );
        let e = parse("ANY 0 (a)").unwrap_err();
        assert!(e.to_string().contains("greater than zero"), "{e}");
    }

    #[test]
    fn display_round_trips() {
        for s in [
            "a",
            "*, \"*\"",
            "ANY 2 (x, \"Y z\", \"q\"\"\", \"any\", \"\", 12, \"1a\", \"ä-b\")",
            "3 (a$, _b)",
        ] {
            let v = ok(s);
            let shown = v.to_string();
            assert_eq!(ok(&shown), v, "{s:?} -> {shown:?}");
        }
    }

    fn check_no_panic(input: &str) {
        if let Ok(Some(v)) = parse(input) {
            assert!(v.num_sync >= 1 && !v.names.is_empty());
            assert_eq!(parse(&v.to_string()), Ok(Some(v)), "{input:?}");
        }
    }

    /// Calls `f` on every concatenation of up to `depth` pieces.
    fn for_all(pieces: &[&str], depth: usize, buf: &mut String, f: &mut impl FnMut(&str)) {
        f(buf);
        if depth == 0 {
            return;
        }
        for p in pieces {
            let len = buf.len();
            buf.push_str(p);
            for_all(pieces, depth - 1, buf, f);
            buf.truncate(len);
        }
    }

    /// Every string over a small alphabet up to length 6, and every sequence
    /// of up to 5 grammar-shaped tokens, parses or fails without panicking;
    /// every success round-trips through Display.
    #[test]
    fn never_panics() {
        let chars = ["a", "1", "0", ",", "(", ")", "\"", "*", " ", "é"];
        let mut count = 0u64;
        for_all(&chars, 6, &mut String::new(), &mut |s| {
            count += 1;
            check_no_panic(s);
        });
        assert!(count > 1_000_000);
        let tokens = [
            "ANY", "first", "2", "0", "(", ")", ",", "\"x\"", "\"", "a", " ",
        ];
        for_all(&tokens, 5, &mut String::new(), &mut check_no_panic);
        for s in [
            "FIRST 1 (",
            "ANY",
            "any 1 (\"",
            "\"\"\"",
            "first1(a)",
            "ANY1(a)",
        ] {
            let _ = parse(s);
        }
        // Keywords glued to a count are identifiers, not keywords.
        assert!(parse("first1(a)").is_err());
    }
}
