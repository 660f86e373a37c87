//! The SQL check that keeps a session on the read-only port read-only.
//!
//! The session itself starts with `default_transaction_read_only=on`, which
//! makes the server refuse writes. What the server will not refuse is the
//! client switching that protection off, so the proxy inspects every query
//! text before forwarding it and answers attempts to do so with an error of
//! its own. Anything that slips past this check (dynamic SQL assembled from
//! fragments, say) is still caught afterwards through the ParameterStatus
//! messages PostgreSQL 14 and later send when `default_transaction_read_only`
//! changes; this module is the first line, not the only one.
//!
//! The check runs a lexer that follows PostgreSQL's scanner closely enough to
//! agree with the server on which bytes are code and which are comments,
//! string constants or quoted identifiers. A violation hidden in a comment is
//! no violation, and one written with odd spacing, comments between tokens,
//! mixed case or a quoted name still is. Per statement it refuses:
//!
//! * `SET [SESSION | LOCAL] name` and `RESET name` for either guarded
//!   parameter, whatever the value (so even `SET default_transaction_read_only
//!   = on` is refused, which keeps the rule simple), anywhere in a statement,
//!   which also covers `ALTER ROLE ... SET` and function `SET` clauses;
//! * `READ WRITE` anywhere, which covers `BEGIN`, `START TRANSACTION`, `SET
//!   TRANSACTION` and `SET SESSION CHARACTERISTICS AS TRANSACTION`;
//! * `RESET ALL` at the start of a statement or of a PL/pgSQL statement
//!   (`DISCARD ALL` passes: pooling drivers send it, and like `RESET ALL` it
//!   can only return to the session's start-up values, which a read-only
//!   service makes read-only; it is also no reason to stop looking at the
//!   rest of the text);
//! * calls of `set_config(` unless the first argument is a single string
//!   constant naming some other parameter;
//! * `UPDATE pg_settings`, whose rewrite rule calls `set_config`;
//! * `COMMIT` and `ROLLBACK` in the body of a `DO` block, and any statement
//!   after a `COMMIT`, `END`, `ABORT`, `ROLLBACK` (not to a savepoint) or
//!   `PREPARE TRANSACTION` in the same text: either starts a new
//!   transaction before the server reports a changed default, so SQL
//!   assembled at run time (`EXECUTE 'SET default_transaction' || ...`,
//!   `query_to_xml`), which no lexer can read, could turn the default off,
//!   write, and turn it on again unnoticed;
//! * string constants and dollar-quoted bodies that mention
//!   `transaction_read_only` (which includes `default_transaction_read_only`),
//!   `set_config`, `read write` or `session characteristics`, or that contain
//!   a refused statement when read as SQL: their text can reach the server's
//!   parser through `DO` blocks, `EXECUTE` or functions such as
//!   `query_to_xml`. The one exemption is the first argument of
//!   `current_setting(`, a pure read.
//!
//! The string rule is deliberately conservative: `SELECT 'read write'`, a
//! constant beginning with `reset all`, or `WHERE name =
//! 'transaction_read_only'` on `pg_settings` are refused although harmless.
//!
//! Parameter names are compared case-insensitively even when double-quoted,
//! because PostgreSQL looks run-time parameters up case-insensitively:
//! `SET "Transaction_Read_Only" = off` does change the parameter. Function
//! and table names follow the normal identifier rules instead, so a quoted
//! `"SET_CONFIG"` is not `set_config`.
//!
//! Text that does not lex completely (an unterminated string, comment or
//! quoted identifier) is judged on what precedes it: the server rejects such
//! a query with a syntax error before executing any of it.
//!
//! Backslashes in ordinary string constants are literal unless the client
//! turned `standard_conforming_strings` off, in which case they escape the
//! next character and can move where a string ends. The check does not know
//! that setting, so when an ordinary string contains a backslash the text is
//! lexed both ways and must pass both.

use std::borrow::Cow;
use std::fmt;

use crate::sqlstate::{self, SqlState};
use crate::startup::StartupMessage;

/// Run-time parameters that decide whether transactions may write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GuardedParameter {
    /// `default_transaction_read_only`, the session default.
    DefaultTransactionReadOnly,
    /// `transaction_read_only`, the current transaction's mode.
    TransactionReadOnly,
}

impl GuardedParameter {
    /// The parameter's canonical name.
    pub fn name(self) -> &'static str {
        match self {
            GuardedParameter::DefaultTransactionReadOnly => "default_transaction_read_only",
            GuardedParameter::TransactionReadOnly => "transaction_read_only",
        }
    }

    /// The parameter a name refers to, compared as PostgreSQL compares
    /// parameter names (ASCII case-insensitively).
    pub fn lookup(name: &[u8]) -> Option<GuardedParameter> {
        [
            GuardedParameter::DefaultTransactionReadOnly,
            GuardedParameter::TransactionReadOnly,
        ]
        .into_iter()
        .find(|p| name.eq_ignore_ascii_case(p.name().as_bytes()))
    }
}

/// Which statement asked for a read-write transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReadWriteStatement {
    /// `BEGIN ... READ WRITE`.
    Begin,
    /// `START TRANSACTION ... READ WRITE`.
    StartTransaction,
    /// `SET TRANSACTION ... READ WRITE`.
    SetTransaction,
    /// `SET SESSION CHARACTERISTICS AS TRANSACTION ... READ WRITE`.
    SessionCharacteristics,
    /// `READ WRITE` in any other statement.
    Other,
}

/// The kind of statement that was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Violation {
    /// `SET` of a guarded parameter.
    SetParameter(GuardedParameter),
    /// `RESET` of a guarded parameter.
    ResetParameter(GuardedParameter),
    /// `RESET ALL`.
    ResetAll,
    /// A request for a read-write transaction.
    ReadWrite(ReadWriteStatement),
    /// A `set_config` call that may change a guarded parameter.
    SetConfig,
    /// `UPDATE pg_settings`.
    UpdatePgSettings,
    /// A string constant mentioning the given pattern.
    StringMentions(&'static str),
    /// String constants nested deeper than the check follows.
    NestingTooDeep,
    /// `COMMIT` or `ROLLBACK` in the body of a `DO` block.
    TransactionControlInDo,
    /// `client_encoding` set to an encoding whose multi-byte characters
    /// may end in an ASCII byte (SJIS, BIG5, GBK, UHC, GB18030, JOHAB):
    /// the server would read the SQL that follows otherwise than the
    /// check does.
    ClientEncoding,
    /// A `DO` block in a language other than PL/pgSQL, whose commits
    /// (`spi_commit()`, `plpy.commit()`, Tcl's `commit`) the check cannot
    /// see.
    DoLanguage,
    /// A statement after one that ends the transaction, in one Query.
    AfterTransactionEnd,
    /// A statement run after one that ended the transaction, in one
    /// extended-protocol batch (before its Sync).
    AfterTransactionEndInBatch,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::SetParameter(p) => write!(f, "SET {}", p.name()),
            Violation::ResetParameter(p) => write!(f, "RESET {}", p.name()),
            Violation::ResetAll => f.write_str("RESET ALL"),
            Violation::ReadWrite(s) => f.write_str(match s {
                ReadWriteStatement::Begin => "BEGIN READ WRITE",
                ReadWriteStatement::StartTransaction => "START TRANSACTION READ WRITE",
                ReadWriteStatement::SetTransaction => "SET TRANSACTION READ WRITE",
                ReadWriteStatement::SessionCharacteristics => {
                    "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE"
                }
                ReadWriteStatement::Other => "READ WRITE",
            }),
            Violation::SetConfig => f.write_str("set_config()"),
            Violation::UpdatePgSettings => f.write_str("UPDATE pg_settings"),
            Violation::StringMentions(p) => write!(f, "string constant mentioning \"{p}\""),
            Violation::NestingTooDeep => f.write_str("too deeply nested string constants"),
            Violation::TransactionControlInDo => f.write_str("COMMIT or ROLLBACK in a DO block"),
            Violation::DoLanguage => f.write_str("a DO block in a language other than plpgsql"),
            Violation::ClientEncoding => f.write_str(
                "a client_encoding whose characters may end in an ASCII byte (SJIS, BIG5, GBK, UHC, GB18030, JOHAB)",
            ),
            Violation::AfterTransactionEnd => f.write_str(
                "statements after COMMIT, ROLLBACK or PREPARE TRANSACTION in the same query",
            ),
            Violation::AfterTransactionEndInBatch => f.write_str(
                "statements run after COMMIT, ROLLBACK or PREPARE TRANSACTION before the next Sync",
            ),
        }
    }
}

/// A statement that could make a read-only session read-write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot make a read-only session read-write: {kind}")]
pub struct ReadOnlyViolation {
    /// What was refused.
    pub kind: Violation,
}

impl ReadOnlyViolation {
    /// The SQLSTATE to report, the one PostgreSQL uses for writes attempted
    /// in a read-only transaction.
    pub fn sqlstate(&self) -> SqlState {
        sqlstate::READ_ONLY_SQL_TRANSACTION
    }
}

/// Checks the text of a Query or Parse message; see the module docs for
/// what is refused.
pub fn check_read_only(sql: &str) -> Result<(), ReadOnlyViolation> {
    check_read_only_bytes(sql.as_bytes())
}

/// [`check_read_only`] for text in a client encoding other than UTF-8.
///
/// The lexer gives meaning to ASCII bytes only, which is exact for UTF-8 and
/// every encoding a server can use. It is not exact for the client-only
/// encodings SJIS, BIG5, GBK, UHC and GB18030, whose multi-byte characters
/// may end in a backslash byte: inside an `E''` constant such a character
/// would be read as escaping the closing quote. Sessions on the read-only
/// port should use one of the other encodings, or rely on the
/// ParameterStatus safety net alone.
pub fn check_read_only_bytes(sql: &[u8]) -> Result<(), ReadOnlyViolation> {
    check(sql, 0, false).map_err(|kind| ReadOnlyViolation { kind })
}

/// Whether `sql` holds a statement that ends the current transaction
/// (`COMMIT`, `END`, `ABORT`, `ROLLBACK` other than to a savepoint,
/// `PREPARE TRANSACTION`), read as PostgreSQL would with
/// `standard_conforming_strings` either on or off.
///
/// For the extended protocol, where a statement is prepared in one message
/// and run in another: statements run after such a one without a Sync in
/// between start a new transaction before the server reports a changed
/// default, as they do after a `COMMIT` inside one Query.
pub fn ends_transaction(sql: &[u8]) -> bool {
    let ends = |standard_strings: bool| {
        let mut lexer = Lexer::new(sql, standard_strings);
        let mut stmt = Statement::new();
        while let Some(tok) = lexer.next_token() {
            if lexer.truncated {
                break;
            }
            let class = classify(&tok);
            if class == Class::Punct(b';') {
                if stmt.ends_transaction() {
                    return (true, lexer.saw_backslash);
                }
                stmt = Statement::new();
                continue;
            }
            stmt.push_lead(class);
        }
        (stmt.ends_transaction(), lexer.saw_backslash)
    };
    match ends(true) {
        (true, _) => true,
        (false, true) => ends(false).0,
        (false, false) => false,
    }
}

/// `sql` with its comments (`--` to the end of the line, nested `/* */`)
/// overwritten with spaces, or `None` when it has none. Other bytes keep
/// their places, so positions in the result are positions in `sql`.
///
/// For checks that look at the words of a statement and must not be misled
/// by comments between them (`CREATE /* x */ TEMP TABLE`), nor mistake a
/// `--` or `/*` inside a string constant or quoted identifier for one. A
/// byte counts as comment only if it lexes as one with
/// `standard_conforming_strings` on and off alike, so whatever the
/// session's setting the server sees no code where the result has blanks.
/// From an unterminated constant or identifier on, the text is kept as it
/// is (the server refuses such a query).
pub fn blank_comments(sql: &[u8]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    let mut lexer = Lexer::new(sql, true);
    mark_comments(&mut lexer, &mut out);
    let out = out?;
    if !lexer.saw_backslash {
        return Some(out);
    }
    // The other lexing may see code where the first saw a comment: keep
    // the bytes that either one takes for code.
    let mut other = None;
    mark_comments(&mut Lexer::new(sql, false), &mut other);
    let other = other?;
    let both: Vec<u8> = sql
        .iter()
        .zip(out.iter().zip(&other))
        .map(|(&b, (&x, &y))| if x != b && y != b { b' ' } else { b })
        .collect();
    (both != sql).then_some(both)
}

/// Blanks, in a copy of the lexer's input made on the first one, the
/// comments the lexer skips between tokens.
fn mark_comments(lexer: &mut Lexer<'_>, out: &mut Option<Vec<u8>>) {
    loop {
        let from = lexer.pos;
        let to = lexer.skip_blank(from).min(lexer.src.len());
        for i in from..to {
            if !is_space(lexer.src[i]) {
                out.get_or_insert_with(|| lexer.src.to_vec())[i] = b' ';
            }
        }
        if lexer.next_token().is_none() || lexer.truncated {
            return;
        }
    }
}

/// Levels of string constants inside string constants that are followed.
/// Legitimate SQL rarely needs more than two or three, and each level may
/// double the work when both string-lexing modes have to be tried.
const MAX_DEPTH: usize = 6;

fn check(sql: &[u8], depth: usize, in_do: bool) -> Result<(), Violation> {
    let mut lexer = Lexer::new(sql, true);
    scan(&mut lexer, depth, in_do)?;
    if lexer.saw_backslash {
        scan(&mut Lexer::new(sql, false), depth, in_do)?;
    }
    Ok(())
}

/// Unquoted keywords the rules look at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kw {
    Set,
    Reset,
    Session,
    Local,
    Read,
    Write,
    All,
    Update,
    Only,
    Begin,
    Start,
    Transaction,
    Characteristics,
    Then,
    Else,
    Loop,
    Do,
    Commit,
    End,
    Abort,
    Rollback,
    Prepare,
    To,
    Language,
    Names,
}

const KEYWORDS: &[(&str, Kw)] = &[
    ("set", Kw::Set),
    ("reset", Kw::Reset),
    ("session", Kw::Session),
    ("local", Kw::Local),
    ("read", Kw::Read),
    ("write", Kw::Write),
    ("all", Kw::All),
    ("update", Kw::Update),
    ("only", Kw::Only),
    ("begin", Kw::Begin),
    ("start", Kw::Start),
    ("transaction", Kw::Transaction),
    ("characteristics", Kw::Characteristics),
    ("then", Kw::Then),
    ("else", Kw::Else),
    ("loop", Kw::Loop),
    ("do", Kw::Do),
    ("commit", Kw::Commit),
    ("end", Kw::End),
    ("abort", Kw::Abort),
    ("rollback", Kw::Rollback),
    ("prepare", Kw::Prepare),
    ("to", Kw::To),
    ("language", Kw::Language),
    ("names", Kw::Names),
];

/// A token reduced to what the rules need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Kw(Kw),
    Guarded(GuardedParameter),
    SetConfig,
    PgSettings,
    PgCatalog,
    CurrentSetting,
    ClientEncoding,
    Ident,
    Str,
    Punct(u8),
    Other,
    /// Placeholder for "no token" in the history.
    None,
}

fn classify(tok: &Token<'_>) -> Class {
    match tok.kind {
        Kind::Word => {
            let w = &tok.text[..];
            if let Some(p) = GuardedParameter::lookup(w) {
                return Class::Guarded(p);
            }
            if let Some((_, k)) = KEYWORDS
                .iter()
                .find(|(s, _)| w.eq_ignore_ascii_case(s.as_bytes()))
            {
                return Class::Kw(*k);
            }
            name_class(w, true)
        }
        Kind::QuotedIdent => {
            let w = &tok.text[..];
            match GuardedParameter::lookup(w) {
                Some(p) => Class::Guarded(p),
                None => name_class(w, false),
            }
        }
        Kind::Str => Class::Str,
        Kind::Punct(c) => Class::Punct(c),
        Kind::Other => Class::Other,
    }
}

/// Function and relation names: unquoted ones fold to lower case, quoted
/// ones must match exactly. A setting's name matches in any case, quoted
/// or not, as PostgreSQL looks settings up.
fn name_class(w: &[u8], fold: bool) -> Class {
    let is = |name: &str| {
        if fold {
            w.eq_ignore_ascii_case(name.as_bytes())
        } else {
            w == name.as_bytes()
        }
    };
    if is("set_config") {
        Class::SetConfig
    } else if is("pg_settings") {
        Class::PgSettings
    } else if is("pg_catalog") {
        Class::PgCatalog
    } else if is("current_setting") {
        Class::CurrentSetting
    } else if w.eq_ignore_ascii_case(b"client_encoding") {
        Class::ClientEncoding
    } else {
        Class::Ident
    }
}

/// Progress through `set_config ( 'name' ,`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SetConfigArg {
    Idle,
    AwaitName,
    AwaitComma,
}

/// Rule state for one statement.
struct Statement {
    /// The most recent tokens, newest first.
    hist: [Class; 4],
    /// Whether `hist[0]` stood where a command may start.
    prev_at_command: bool,
    /// The first tokens of the statement, leading parentheses skipped.
    lead: [Class; 3],
    lead_len: usize,
    set_config: SetConfigArg,
}

impl Statement {
    fn new() -> Self {
        Statement {
            hist: [Class::None; 4],
            prev_at_command: false,
            lead: [Class::None; 3],
            lead_len: 0,
            set_config: SetConfigArg::Idle,
        }
    }

    fn feed(
        &mut self,
        class: Class,
        tok: &Token<'_>,
        depth: usize,
        in_do: bool,
    ) -> Result<(), Violation> {
        let h = self.hist;
        let at_command = self.lead_len == 0
            || matches!(h[0], Class::Kw(Kw::Then | Kw::Else | Kw::Loop | Kw::Begin));
        // A top-level DO block may commit, and the transaction it starts
        // next takes the session's default, which code before the COMMIT
        // may have turned off through SQL assembled at run time (invisible
        // here), and turned on again before the end, so that the server
        // never reports the change.
        if in_do && at_command && matches!(class, Class::Kw(Kw::Commit | Kw::Rollback)) {
            return Err(Violation::TransactionControlInDo);
        }
        // `SET client_encoding TO x`, `SET NAMES x` (also SESSION, LOCAL):
        // the value of x, literal here (set_config and strings naming the
        // parameter are refused elsewhere).
        let set = Class::Kw(Kw::Set);
        let set_scope = |i: usize| {
            h[i] == set
                || (matches!(h[i], Class::Kw(Kw::Session | Kw::Local))
                    && h.get(i + 1) == Some(&set))
        };
        // `=` lexes as an operator (Other); no other operator fits there.
        let encoding_value = (matches!(h[0], Class::Kw(Kw::To) | Class::Other)
            && h[1] == Class::ClientEncoding
            && set_scope(2))
            || (h[0] == Class::Kw(Kw::Names) && set_scope(1));
        if encoding_value
            && matches!(tok.kind, Kind::Word | Kind::QuotedIdent | Kind::Str)
            && client_only_encoding(&tok.text)
        {
            return Err(Violation::ClientEncoding);
        }
        // Other languages commit through calls the lexer cannot tell from
        // any other (PL/Perl's `spi_commit()`), and their string syntax is
        // not SQL's: only PL/pgSQL, the default, is let through.
        if h[0] == Class::Kw(Kw::Language) && self.lead[0] == Class::Kw(Kw::Do) {
            let plpgsql = match tok.kind {
                Kind::Word => tok.text.eq_ignore_ascii_case(b"plpgsql"),
                Kind::QuotedIdent | Kind::Str => tok.text[..] == *b"plpgsql",
                _ => false,
            };
            if !plpgsql {
                return Err(Violation::DoLanguage);
            }
        }

        match self.set_config {
            SetConfigArg::Idle => {}
            SetConfigArg::AwaitName => {
                if class != Class::Str
                    || GuardedParameter::lookup(&tok.text).is_some()
                    || tok.text.eq_ignore_ascii_case(b"client_encoding")
                {
                    return Err(Violation::SetConfig);
                }
                self.set_config = SetConfigArg::AwaitComma;
            }
            SetConfigArg::AwaitComma => {
                if !matches!(class, Class::Punct(b',' | b')')) {
                    return Err(Violation::SetConfig);
                }
                self.set_config = SetConfigArg::Idle;
            }
        }
        if class == Class::Punct(b'(') && h[0] == Class::SetConfig {
            self.set_config = SetConfigArg::AwaitName;
        }

        let set = Class::Kw(Kw::Set);
        let update = Class::Kw(Kw::Update);
        let only = Class::Kw(Kw::Only);
        match class {
            Class::Guarded(p) => {
                if h[0] == set
                    || (matches!(h[0], Class::Kw(Kw::Session | Kw::Local)) && h[1] == set)
                {
                    return Err(Violation::SetParameter(p));
                }
                if h[0] == Class::Kw(Kw::Reset) {
                    return Err(Violation::ResetParameter(p));
                }
            }
            Class::Kw(Kw::All) if self.prev_at_command && h[0] == Class::Kw(Kw::Reset) => {
                return Err(Violation::ResetAll);
            }
            Class::Kw(Kw::Write) if h[0] == Class::Kw(Kw::Read) => {
                return Err(Violation::ReadWrite(self.read_write_statement()));
            }
            Class::PgSettings => {
                let updated = |i: usize| h[i] == update || (h[i] == only && h[i + 1] == update);
                if updated(0)
                    || (h[0] == Class::Punct(b'.') && h[1] == Class::PgCatalog && updated(2))
                {
                    return Err(Violation::UpdatePgSettings);
                }
            }
            Class::Str => {
                let exempt = h[0] == Class::Punct(b'(') && h[1] == Class::CurrentSetting;
                if !exempt {
                    let in_do = in_do || self.lead[0] == Class::Kw(Kw::Do);
                    check_constant(&tok.text, depth, in_do)?;
                }
            }
            _ => {}
        }

        self.push_lead(class);
        self.hist = [class, h[0], h[1], h[2]];
        self.prev_at_command = at_command;
        Ok(())
    }

    /// Records `class` among the statement's first tokens.
    fn push_lead(&mut self, class: Class) {
        if !(self.lead_len == 0 && class == Class::Punct(b'(')) {
            if let Some(slot) = self.lead.get_mut(self.lead_len) {
                *slot = class;
            }
            self.lead_len = self.lead_len.saturating_add(1);
        }
    }

    fn finish(&self) -> Result<(), Violation> {
        // An unfinished `set_config(` cannot run, but refusing it costs
        // nothing and keeps the rule free of special cases.
        if self.set_config != SetConfigArg::Idle {
            return Err(Violation::SetConfig);
        }
        Ok(())
    }

    /// Whether the statement ends the current transaction: `COMMIT`,
    /// `END`, `ABORT`, `ROLLBACK` other than to a savepoint, `PREPARE
    /// TRANSACTION`.
    fn ends_transaction(&self) -> bool {
        match self.lead {
            [Class::Kw(Kw::Commit | Kw::End | Kw::Abort), ..] => true,
            [Class::Kw(Kw::Rollback), a, b] => a != Class::Kw(Kw::To) && b != Class::Kw(Kw::To),
            [Class::Kw(Kw::Prepare), Class::Kw(Kw::Transaction), _] => true,
            _ => false,
        }
    }

    fn read_write_statement(&self) -> ReadWriteStatement {
        match self.lead {
            [Class::Kw(Kw::Begin), ..] => ReadWriteStatement::Begin,
            [Class::Kw(Kw::Start), ..] => ReadWriteStatement::StartTransaction,
            [Class::Kw(Kw::Set), Class::Kw(Kw::Transaction), _] => {
                ReadWriteStatement::SetTransaction
            }
            [Class::Kw(Kw::Set), Class::Kw(Kw::Session), Class::Kw(Kw::Characteristics)] => {
                ReadWriteStatement::SessionCharacteristics
            }
            _ => ReadWriteStatement::Other,
        }
    }
}

fn scan(lexer: &mut Lexer<'_>, depth: usize, in_do: bool) -> Result<(), Violation> {
    let mut stmt = Statement::new();
    // The statements of one Query after a COMMIT run in a new transaction,
    // which takes the session's default: code before the COMMIT may have
    // turned it off through SQL assembled at run time (invisible here),
    // and code after the writes may turn it on again before the server
    // would report the change. Only the top level runs that way.
    let mut ended = false;
    while let Some(tok) = lexer.next_token() {
        if lexer.truncated {
            // Everything from here on is inside an unterminated constant,
            // identifier or comment: a syntax error, so nothing runs.
            break;
        }
        let class = classify(&tok);
        if class == Class::Punct(b';') {
            stmt.finish()?;
            ended |= depth == 0 && stmt.ends_transaction();
            stmt = Statement::new();
            continue;
        }
        if ended {
            return Err(Violation::AfterTransactionEnd);
        }
        stmt.feed(class, &tok, depth, in_do)?;
    }
    stmt.finish()
}

/// Checks the contents of a string constant or dollar-quoted body.
fn check_constant(text: &[u8], depth: usize, in_do: bool) -> Result<(), Violation> {
    if depth + 1 >= MAX_DEPTH {
        return Err(Violation::NestingTooDeep);
    }
    // As SQL first: it names the refused statement more precisely.
    check(text, depth + 1, in_do)?;
    match mentions(text) {
        Some(p) => Err(Violation::StringMentions(p)),
        None => Ok(()),
    }
}

/// The first suspicious phrase in `text`, matched ASCII case-insensitively;
/// two-word phrases match with any run of whitespace between the words.
fn mentions(text: &[u8]) -> Option<&'static str> {
    const PHRASES: &[(&str, &str, &str)] = &[
        ("transaction_read_only", "", "transaction_read_only"),
        ("set_config", "", "set_config"),
        ("read", "write", "read write"),
        ("session", "characteristics", "session characteristics"),
        ("client_encoding", "", "client_encoding"),
    ];
    for i in 0..text.len() {
        let rest = &text[i..];
        for (first, second, name) in PHRASES {
            let Some(after) = strip_prefix_ci(rest, first.as_bytes()) else {
                continue;
            };
            if second.is_empty() {
                return Some(name);
            }
            let gap = after.iter().take_while(|b| is_space(**b)).count();
            if gap > 0 && strip_prefix_ci(&after[gap..], second.as_bytes()).is_some() {
                return Some(name);
            }
        }
    }
    None
}

fn strip_prefix_ci<'a>(s: &'a [u8], prefix: &[u8]) -> Option<&'a [u8]> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

// ---------------------------------------------------------------------------
// Lexer

/// PostgreSQL's `space` class (the vertical tab counts since PostgreSQL 16;
/// treating it as space everywhere only exposes more code, never less).
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)
}

fn is_horiz_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | 0x0c)
}

fn is_newline(b: u8) -> bool {
    matches!(b, b'\n' | b'\r')
}

fn is_ident_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b >= 0x80
}

fn is_ident_cont(b: u8) -> bool {
    is_ident_start(b) || b.is_ascii_digit() || b == b'$'
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Unquoted identifier or keyword, as written.
    Word,
    /// Double-quoted identifier, with escapes resolved.
    QuotedIdent,
    /// String constant or dollar-quoted body, with escapes resolved.
    Str,
    /// `(`, `)`, `,`, `;` or `.`.
    Punct(u8),
    /// Numbers, parameters, operators and anything else.
    Other,
}

#[derive(Debug)]
struct Token<'a> {
    kind: Kind,
    text: Cow<'a, [u8]>,
}

/// How a quoted string treats its contents.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Quoting {
    /// `''` stands for a quote.
    Doubled,
    /// As `Doubled`, and backslash escapes a character (`E''`).
    Escaped,
    /// Bit strings: the first quote ends the string.
    Plain,
}

/// Accumulates string contents, borrowing while they are one contiguous
/// run of the input.
struct Contents<'a> {
    src: &'a [u8],
    start: usize,
    owned: Option<Vec<u8>>,
}

impl<'a> Contents<'a> {
    fn new(src: &'a [u8], start: usize) -> Self {
        Contents {
            src,
            start,
            owned: None,
        }
    }

    /// Ends the current run at `end`, switching to an owned buffer.
    fn cut(&mut self, end: usize) -> &mut Vec<u8> {
        let run = self.src.get(self.start..end).unwrap_or(&[]);
        let owned = self.owned.get_or_insert_with(Vec::new);
        owned.extend_from_slice(run);
        owned
    }

    /// Starts a new run at `start`.
    fn resume(&mut self, start: usize) {
        self.start = start;
    }

    fn finish(self, end: usize) -> Cow<'a, [u8]> {
        let run = self.src.get(self.start..end).unwrap_or(&[]);
        match self.owned {
            None => Cow::Borrowed(run),
            Some(mut v) => {
                v.extend_from_slice(run);
                Cow::Owned(v)
            }
        }
    }
}

struct Lexer<'a> {
    src: &'a [u8],
    pos: usize,
    /// `standard_conforming_strings`: whether backslash is literal in `''`.
    standard_strings: bool,
    /// A backslash appeared in an ordinary string constant, so the other
    /// setting of `standard_conforming_strings` would lex differently.
    saw_backslash: bool,
    /// The last token ran into the end of the input unterminated.
    truncated: bool,
}

impl<'a> Lexer<'a> {
    fn new(src: &'a [u8], standard_strings: bool) -> Self {
        Lexer {
            src,
            pos: 0,
            standard_strings,
            saw_backslash: false,
            truncated: false,
        }
    }

    fn at(&self, i: usize) -> Option<u8> {
        self.src.get(i).copied()
    }

    /// Position after whitespace and comments starting at `i`.
    fn skip_blank(&self, mut i: usize) -> usize {
        loop {
            match (self.at(i), self.at(i + 1)) {
                (Some(b), _) if is_space(b) => i += 1,
                (Some(b'-'), Some(b'-')) => i = self.line_end(i),
                (Some(b'/'), Some(b'*')) => i = self.comment_end(i),
                _ => return i,
            }
        }
    }

    /// Position of the newline ending the `--` comment at `i`, or the end.
    fn line_end(&self, i: usize) -> usize {
        self.src
            .get(i..)
            .and_then(|s| s.iter().position(|b| is_newline(*b)))
            .map_or(self.src.len(), |n| i + n)
    }

    /// Position after the (nested) `/* */` comment at `i`, or the end.
    fn comment_end(&self, mut i: usize) -> usize {
        let mut depth = 0usize;
        while let Some(b) = self.at(i) {
            match (b, self.at(i + 1)) {
                (b'/', Some(b'*')) => {
                    depth += 1;
                    i += 2;
                }
                (b'*', Some(b'/')) => {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        return i;
                    }
                }
                _ => i += 1,
            }
        }
        self.src.len()
    }

    fn next_token(&mut self) -> Option<Token<'a>> {
        let start = self.skip_blank(self.pos);
        let b = self.at(start)?;
        let next = self.at(start + 1);
        let next2 = self.at(start + 2);
        let (kind, text, end) = match (b, next) {
            (b'\'', _) => self.string(start + 1, self.ordinary_quoting()),
            (b'e' | b'E', Some(b'\'')) => self.string(start + 2, Quoting::Escaped),
            (b'n' | b'N', Some(b'\'')) => self.string(start + 2, self.ordinary_quoting()),
            (b'b' | b'B' | b'x' | b'X', Some(b'\'')) => self.string(start + 2, Quoting::Plain),
            (b'u' | b'U', Some(b'&')) if next2 == Some(b'\'') => {
                let (kind, text, end) = self.string(start + 3, Quoting::Doubled);
                self.unicode(kind, text, end)
            }
            (b'u' | b'U', Some(b'&')) if next2 == Some(b'"') => {
                let (kind, text, end) = self.quoted_ident(start + 3);
                self.unicode(kind, text, end)
            }
            (b'"', _) => self.quoted_ident(start + 1),
            (b'$', Some(d)) if d.is_ascii_digit() => {
                let end = self.span(start + 1, |c| c.is_ascii_digit());
                (Kind::Other, Cow::Borrowed(&self.src[start..end]), end)
            }
            (b'$', _) => self.dollar(start),
            _ if is_ident_start(b) => {
                let end = self.span(start + 1, is_ident_cont);
                (Kind::Word, Cow::Borrowed(&self.src[start..end]), end)
            }
            _ if b.is_ascii_digit() || (b == b'.' && next.is_some_and(|d| d.is_ascii_digit())) => {
                let end = self.number(start);
                (Kind::Other, Cow::Borrowed(&self.src[start..end]), end)
            }
            (b'(' | b')' | b',' | b';' | b'.', _) => (
                Kind::Punct(b),
                Cow::Borrowed(&self.src[start..start + 1]),
                start + 1,
            ),
            _ => (
                Kind::Other,
                Cow::Borrowed(&self.src[start..start + 1]),
                start + 1,
            ),
        };
        self.pos = end.max(start + 1);
        Some(Token { kind, text })
    }

    fn ordinary_quoting(&self) -> Quoting {
        if self.standard_strings {
            Quoting::Doubled
        } else {
            Quoting::Escaped
        }
    }

    /// End of the run of bytes satisfying `f` from `i`.
    fn span(&self, i: usize, f: impl Fn(u8) -> bool) -> usize {
        self.src
            .get(i..)
            .and_then(|s| s.iter().position(|b| !f(*b)))
            .map_or(self.src.len(), |n| i + n)
    }

    /// A numeric literal; trailing letters are left to become a separate
    /// word, which is how PostgreSQL before 16 lexed them.
    fn number(&self, start: usize) -> usize {
        let digits = |c: u8| c.is_ascii_digit() || c == b'_';
        let mut i = self.span(start, digits);
        if self.at(i) == Some(b'.') && self.at(i + 1) != Some(b'.') {
            i = self.span(i + 1, digits);
        }
        if matches!(self.at(i), Some(b'e' | b'E')) {
            let sign = usize::from(matches!(self.at(i + 1), Some(b'+' | b'-')));
            if self.at(i + 1 + sign).is_some_and(|d| d.is_ascii_digit()) {
                i = self.span(i + 1 + sign, |c| c.is_ascii_digit());
            }
        }
        i
    }

    /// A single-quoted string whose contents start at `i`.
    fn string(&mut self, mut i: usize, quoting: Quoting) -> (Kind, Cow<'a, [u8]>, usize) {
        let mut contents = Contents::new(self.src, i);
        loop {
            let Some(b) = self.at(i) else {
                self.truncated = true;
                return (Kind::Str, contents.finish(i), i);
            };
            if b == b'\'' {
                if quoting != Quoting::Plain && self.at(i + 1) == Some(b'\'') {
                    // Keep the first quote of the pair, drop the second.
                    contents.cut(i + 1);
                    i += 2;
                    contents.resume(i);
                    continue;
                }
                if let Some(q) = self.continuation(i + 1) {
                    contents.cut(i);
                    i = q + 1;
                    contents.resume(i);
                    continue;
                }
                return (Kind::Str, contents.finish(i), i + 1);
            }
            if b == b'\\' {
                if quoting == Quoting::Escaped {
                    let out = contents.cut(i);
                    i = unescape(self.src, i + 1, out);
                    contents.resume(i);
                    continue;
                }
                if quoting == Quoting::Doubled {
                    self.saw_backslash = true;
                }
            }
            i += 1;
        }
    }

    /// If a string constant ending before `i` continues with another one
    /// (separated by whitespace that includes a newline, which SQL treats
    /// as one constant), the position of the opening quote of the next part.
    fn continuation(&self, mut i: usize) -> Option<usize> {
        loop {
            match (self.at(i), self.at(i + 1)) {
                (Some(b), _) if is_horiz_space(b) => i += 1,
                (Some(b'-'), Some(b'-')) => i = self.line_end(i),
                _ => break,
            }
        }
        if !is_newline(self.at(i)?) {
            return None;
        }
        i += 1;
        loop {
            match (self.at(i), self.at(i + 1)) {
                (Some(b), _) if is_space(b) => i += 1,
                (Some(b'-'), Some(b'-')) => {
                    i = self.line_end(i);
                    // The comment must end with a newline for the string
                    // to continue; the loop consumes it as space.
                    self.at(i)?;
                }
                (Some(b'\''), _) => return Some(i),
                _ => return None,
            }
        }
    }

    /// A double-quoted identifier whose contents start at `i`.
    fn quoted_ident(&mut self, mut i: usize) -> (Kind, Cow<'a, [u8]>, usize) {
        let mut contents = Contents::new(self.src, i);
        loop {
            match (self.at(i), self.at(i + 1)) {
                (None, _) => {
                    self.truncated = true;
                    return (Kind::QuotedIdent, contents.finish(i), i);
                }
                (Some(b'"'), Some(b'"')) => {
                    contents.cut(i + 1);
                    i += 2;
                    contents.resume(i);
                }
                (Some(b'"'), _) => return (Kind::QuotedIdent, contents.finish(i), i + 1),
                _ => i += 1,
            }
        }
    }

    /// Resolves the escapes of a `U&` string or identifier ending at `end`,
    /// honouring a following `UESCAPE 'c'` clause.
    fn unicode(&self, kind: Kind, text: Cow<'a, [u8]>, end: usize) -> (Kind, Cow<'a, [u8]>, usize) {
        let mut escape = b'\\';
        let mut end_after = end;
        let i = self.skip_blank(end);
        let word_end = self.span(i, is_ident_cont);
        if self.src[i.min(word_end)..word_end].eq_ignore_ascii_case(b"uescape") {
            // Any string constant may follow, as PostgreSQL's parser takes
            // it: '!', E'!', $$!$$, after comments. Read past it with a
            // lexer of its own; a constant that is not one character is an
            // error for the server, so nothing runs then.
            let mut after = Lexer {
                src: self.src,
                pos: word_end,
                standard_strings: self.standard_strings,
                saw_backslash: false,
                truncated: false,
            };
            if let Some(tok) = after.next_token() {
                if tok.kind == Kind::Str && tok.text.len() == 1 && !after.truncated {
                    escape = tok.text[0];
                    end_after = after.pos;
                }
            }
        }
        (kind, decode_unicode(text, escape), end_after)
    }

    /// A dollar-quoted string, or a lone `$` if `start` opens no tag.
    fn dollar(&mut self, start: usize) -> (Kind, Cow<'a, [u8]>, usize) {
        let lone = (
            Kind::Other,
            Cow::Borrowed(&self.src[start..start + 1]),
            start + 1,
        );
        let tag_end = match self.at(start + 1) {
            Some(b'$') => start + 1,
            Some(c) if is_ident_start(c) => self.span(start + 1, |c| is_ident_cont(c) && c != b'$'),
            _ => return lone,
        };
        if self.at(tag_end) != Some(b'$') {
            return lone;
        }
        let delim = &self.src[start..=tag_end];
        let body = tag_end + 1;
        let rest = &self.src[body..];
        match memchr::memmem::find(rest, delim) {
            Some(n) => (Kind::Str, Cow::Borrowed(&rest[..n]), body + n + delim.len()),
            None => {
                self.truncated = true;
                (Kind::Str, Cow::Borrowed(rest), self.src.len())
            }
        }
    }
}

/// Decodes the backslash escape whose first character is at `i` into `out`,
/// returning the position after it. Malformed escapes make the server
/// reject the query, so any reasonable reading of them will do.
fn unescape(src: &[u8], i: usize, out: &mut Vec<u8>) -> usize {
    let Some(&c) = src.get(i) else {
        return i;
    };
    let hex_run = |from: usize, max: usize| {
        let n = src
            .get(from..)
            .unwrap_or(&[])
            .iter()
            .take(max)
            .take_while(|b| b.is_ascii_hexdigit())
            .count();
        let value = src[from..from + n]
            .iter()
            .fold(0u32, |v, b| (v << 4) | hex_value(*b));
        (n, value)
    };
    match c {
        b'b' => out.push(0x08),
        b'f' => out.push(0x0c),
        b'n' => out.push(b'\n'),
        b'r' => out.push(b'\r'),
        b't' => out.push(b'\t'),
        b'0'..=b'7' => {
            let n = src[i..]
                .iter()
                .take(3)
                .take_while(|b| matches!(b, b'0'..=b'7'))
                .count();
            let v = src[i..i + n]
                .iter()
                .fold(0u32, |v, b| (v << 3) | u32::from(b - b'0'));
            out.push(v as u8);
            return i + n;
        }
        b'x' => {
            let (n, v) = hex_run(i + 1, 2);
            if n == 0 {
                out.push(b'x');
                return i + 1;
            }
            out.push(v as u8);
            return i + 1 + n;
        }
        b'u' | b'U' => {
            let want = if c == b'u' { 4 } else { 8 };
            let (n, v) = hex_run(i + 1, want);
            if n == want {
                push_char(out, v);
                return i + 1 + n;
            }
            out.push(c);
        }
        _ => out.push(c),
    }
    i + 1
}

fn hex_value(b: u8) -> u32 {
    match b {
        b'0'..=b'9' => u32::from(b - b'0'),
        b'a'..=b'f' => u32::from(b - b'a' + 10),
        b'A'..=b'F' => u32::from(b - b'A' + 10),
        _ => 0,
    }
}

fn push_char(out: &mut Vec<u8>, code: u32) {
    let c = char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER);
    let mut buf = [0u8; 4];
    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
}

/// Resolves `\XXXX`, `\+XXXXXX` and `\\` (with `escape` in place of the
/// backslash) in the contents of a `U&` constant or identifier.
fn decode_unicode(text: Cow<'_, [u8]>, escape: u8) -> Cow<'_, [u8]> {
    if !text.contains(&escape) {
        return text;
    }
    let src = &text[..];
    let mut out = Vec::with_capacity(src.len());
    let mut i = 0;
    while let Some(&b) = src.get(i) {
        if b != escape {
            out.push(b);
            i += 1;
            continue;
        }
        let hex = |from: usize, n: usize| {
            let digits = src.get(from..from + n)?;
            digits
                .iter()
                .all(u8::is_ascii_hexdigit)
                .then(|| digits.iter().fold(0u32, |v, b| (v << 4) | hex_value(*b)))
        };
        if src.get(i + 1) == Some(&escape) {
            out.push(escape);
            i += 2;
        } else if let (Some(b'+'), Some(v)) = (src.get(i + 1), hex(i + 2, 6)) {
            push_char(&mut out, v);
            i += 8;
        } else if let Some(v) = hex(i + 1, 4) {
            push_char(&mut out, v);
            i += 5;
        } else {
            out.push(b);
            i += 1;
        }
    }
    Cow::Owned(out)
}

// ---------------------------------------------------------------------------
// Startup options

/// Whether a startup `options` value (server command-line switches) sets
/// `default_transaction_read_only` or `transaction_read_only`.
///
/// The value is split and interpreted as the server does: words separated
/// by unescaped whitespace, a backslash taking the next character
/// literally; `-c name=value`, `-cname=value` and `--name=value` set a
/// parameter, with `-` in the name read as `_`. Switches may be bundled
/// (`-ec name=value`), as with `getopt`.
pub fn options_set_read_only_guc(options: &str) -> bool {
    option_settings(options.as_bytes())
        .iter()
        .any(|value| names_guarded(value))
}

/// The `name=value` settings of an `options` string: the arguments of its
/// `-c` and `--` switches, split and unescaped as the server does.
fn option_settings(options: &[u8]) -> Vec<Vec<u8>> {
    // Switches of the server's getopt string that take an argument.
    const WITH_ARG: &[u8] = b"BcCDdfhkNprStvW-";
    let args = split_options(options);
    let mut out = Vec::new();
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        let Some(switches) = arg.strip_prefix(b"-") else {
            continue;
        };
        for (i, &s) in switches.iter().enumerate() {
            if !WITH_ARG.contains(&s) {
                continue;
            }
            let inline = &switches[i + 1..];
            let value: &[u8] = if inline.is_empty() {
                rest.next().map_or(&[], Vec::as_slice)
            } else {
                inline
            };
            if s == b'c' || s == b'-' {
                out.push(value.to_vec());
            }
            break;
        }
    }
    out
}

/// Whether any startup parameter of `msg` would set a guarded parameter,
/// directly (a parameter named like it) or through `options`.
pub fn startup_sets_read_only_guc(msg: &StartupMessage) -> bool {
    msg.params.iter().any(|(name, value)| {
        if name == "options" {
            options_set_read_only_guc(value)
        } else {
            GuardedParameter::lookup(name.as_bytes()).is_some()
        }
    })
}

/// Whether `name` is an encoding, in any of PostgreSQL's spellings, whose
/// multi-byte characters may end in an ASCII byte (a backslash, a
/// bracket): SJIS, SHIFT_JIS_2004, BIG5, GBK, UHC, GB18030 and JOHAB,
/// which PostgreSQL allows on the client side only. The statement check
/// reads ASCII bytes as SQL; with these, the server would read such a
/// byte as part of a character, and a string or dollar quote could hide
/// SQL from the check.
pub fn client_only_encoding(name: &[u8]) -> bool {
    // As PostgreSQL compares encoding names: letters and digits only, in
    // any case.
    let clean: Vec<u8> = name
        .iter()
        .filter(|b| b.is_ascii_alphanumeric())
        .map(u8::to_ascii_lowercase)
        .collect();
    const NAMES: &[&str] = &[
        "sjis",
        "mskanji",
        "shiftjis",
        "win932",
        "windows932",
        "shiftjis2004",
        "big5",
        "win950",
        "windows950",
        "gbk",
        "win936",
        "windows936",
        "cp936",
        "uhc",
        "win949",
        "windows949",
        "gb18030",
        "johab",
    ];
    NAMES.iter().any(|n| clean == n.as_bytes())
}

/// The client-only encoding (see [`client_only_encoding`]) a startup
/// packet asks for, through `client_encoding` or `options`, if any.
pub fn startup_client_only_encoding(msg: &StartupMessage) -> Option<String> {
    msg.params.iter().find_map(|(name, value)| {
        // Start-up parameter names are setting names: any case.
        let asked: Vec<Vec<u8>> = if name.eq_ignore_ascii_case("client_encoding") {
            vec![value.as_bytes().to_vec()]
        } else if name == "options" {
            option_settings(value.as_bytes())
                .into_iter()
                .filter_map(|s| {
                    let (n, v) = s.split_at(s.iter().position(|b| *b == b'=')?);
                    let n: Vec<u8> = n
                        .iter()
                        .map(|b| if *b == b'-' { b'_' } else { *b })
                        .collect();
                    n.eq_ignore_ascii_case(b"client_encoding")
                        .then(|| v[1..].to_vec())
                })
                .collect()
        } else {
            Vec::new()
        };
        asked
            .into_iter()
            .find(|v| client_only_encoding(v))
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    })
}

/// Whether the `name[=value]` of a `-c` switch names a guarded parameter.
fn names_guarded(setting: &[u8]) -> bool {
    let name = setting.split(|b| *b == b'=').next().unwrap_or(&[]);
    let name: Vec<u8> = name
        .iter()
        .map(|b| if *b == b'-' { b'_' } else { *b })
        .collect();
    GuardedParameter::lookup(&name).is_some()
}

fn split_options(s: &[u8]) -> Vec<Vec<u8>> {
    let mut args = Vec::new();
    let mut i = 0;
    while i < s.len() {
        while s
            .get(i)
            .is_some_and(|b| b.is_ascii_whitespace() || *b == 0x0b)
        {
            i += 1;
        }
        if i >= s.len() {
            break;
        }
        let mut arg = Vec::new();
        let mut escaped = false;
        while let Some(&b) = s.get(i) {
            if !escaped && (b.is_ascii_whitespace() || b == 0x0b) {
                break;
            }
            if !escaped && b == b'\\' {
                escaped = true;
            } else {
                escaped = false;
                arg.push(b);
            }
            i += 1;
        }
        args.push(arg);
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(sql: &str) -> Violation {
        match check_read_only(sql) {
            Err(e) => e.kind,
            Ok(()) => panic!("should be refused: {sql:?}"),
        }
    }

    fn allowed(sql: &str) {
        if let Err(e) = check_read_only(sql) {
            panic!("should be allowed: {sql:?}: {e}");
        }
    }

    /// Upper, lower and alternating case of an ASCII text.
    fn cases(sql: &str) -> [String; 3] {
        let mixed = sql
            .chars()
            .enumerate()
            .map(|(i, c)| {
                if i % 2 == 0 {
                    c.to_ascii_uppercase()
                } else {
                    c.to_ascii_lowercase()
                }
            })
            .collect();
        [sql.to_ascii_uppercase(), sql.to_ascii_lowercase(), mixed]
    }

    const DTRO: Violation = Violation::SetParameter(GuardedParameter::DefaultTransactionReadOnly);
    const TRO: Violation = Violation::SetParameter(GuardedParameter::TransactionReadOnly);

    #[test]
    fn comments_are_blanked_and_nothing_else() {
        let blank = |s: &str| blank_comments(s.as_bytes()).map(|b| String::from_utf8(b).unwrap());
        assert_eq!(blank("SELECT 1").as_deref(), None);
        assert_eq!(
            blank("CREATE /*x*/ TEMP").as_deref(),
            Some("CREATE       TEMP")
        );
        assert_eq!(
            blank("a /* b /* c */ d */ e -- f\ng").as_deref(),
            Some("a                   e     \ng")
        );
        // Not comments: inside constants, quoted identifiers, dollar quotes.
        assert_eq!(blank("SELECT '--', \"/*\", $$ -- $$").as_deref(), None);
        // A backslash: with standard_conforming_strings off the constant
        // ends later and the comment is inside it, so it stays.
        assert_eq!(blank("SELECT 'a\\' /* ', 1").as_deref(), None);
        assert_eq!(
            blank("SELECT E'a\\'' /* x */").as_deref(),
            Some("SELECT E'a\\''        ")
        );
    }

    #[test]
    fn set_of_guarded_parameters_in_every_spelling() {
        let forms = [
            ("SET default_transaction_read_only = off", DTRO),
            ("set default_transaction_read_only to on", DTRO),
            ("SET SESSION default_transaction_read_only TO DEFAULT", DTRO),
            ("SET LOCAL transaction_read_only = false", TRO),
            ("SET transaction_read_only TO 0", TRO),
            ("SET/**/default_transaction_read_only=off", DTRO),
            ("SET -- c\n default_transaction_read_only=off", DTRO),
            (
                "SET /* a /* nested */ b */ SESSION transaction_read_only = off",
                TRO,
            ),
            ("  \n\t SET default_transaction_read_only=off  ", DTRO),
            ("SELECT 1; SET default_transaction_read_only = off", DTRO),
            ("SELECT 1;SET transaction_read_only=off;SELECT 2", TRO),
            (
                "ALTER ROLE me SET default_transaction_read_only = off",
                DTRO,
            ),
        ];
        for (sql, want) in forms {
            for s in cases(sql) {
                assert_eq!(refused(&s), want, "{s}");
            }
        }
        // Parameter names are case-insensitive even when quoted.
        assert_eq!(
            refused(r#"SET "default_transaction_read_only" = off"#),
            DTRO
        );
        assert_eq!(refused(r#"SET "Transaction_Read_Only" = off"#), TRO);
        assert_eq!(refused(r#"SET U&"transaction\005fread_only" = off"#), TRO);
        assert_eq!(
            refused(r#"SET U&"transaction!005fread_only" UESCAPE '!' = off"#),
            TRO
        );
        // The escape character may come in any string constant.
        for clause in [
            "UESCAPE $$!$$",
            "UESCAPE $q$!$q$",
            "UESCAPE E'!'",
            "UESCAPE /* c */ '!'",
            "uescape\n-- c\n'!'",
        ] {
            let sql = format!(
                r#"SET U&"default!005ftransaction!005fread!005fonly" {clause} = off; COMMIT"#
            );
            assert_eq!(refused(&sql), DTRO, "{sql}");
        }
        assert_eq!(
            refused("SET default_transaction_read_only = on").to_string(),
            "SET default_transaction_read_only"
        );
    }

    #[test]
    fn client_only_encodings_at_login() {
        let with = |params: &[(&str, &str)]| {
            StartupMessage::new(
                params
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        assert_eq!(
            startup_client_only_encoding(&with(&[("client_encoding", "SJIS")])),
            Some("SJIS".into())
        );
        assert_eq!(
            startup_client_only_encoding(&with(&[("Client_Encoding", "SJIS")])),
            Some("SJIS".into())
        );
        assert_eq!(
            startup_client_only_encoding(&with(&[("options", "-c client-encoding=big5")])),
            Some("big5".into())
        );
        assert_eq!(
            startup_client_only_encoding(&with(&[("options", "--client_encoding=Windows-936")])),
            Some("Windows-936".into())
        );
        for ok in ["UTF8", "utf-8", "LATIN1", "EUC_JP", "SQL_ASCII"] {
            assert_eq!(
                startup_client_only_encoding(&with(&[("client_encoding", ok)])),
                None,
                "{ok}"
            );
        }
    }

    #[test]
    fn reset_forms() {
        for s in cases("RESET ALL") {
            assert_eq!(refused(&s), Violation::ResetAll);
        }
        for s in cases("discard all") {
            allowed(&s);
        }
        // A new transaction within one message takes the session default,
        // which SQL assembled at run time may have switched off and on.
        for sql in [
            "DO $$BEGIN EXECUTE 'SET default_transaction' || '_read_only = off'; COMMIT; \
             INSERT INTO t VALUES (1); END$$",
            "do language plpgsql $$ begin perform 1; rollback; end $$",
            "DO $$ BEGIN IF x THEN COMMIT; END IF; END $$",
            "SELECT query_to_xml('DO $x$BEGIN COMMIT; END$x$', true, false, '')",
        ] {
            assert_eq!(refused(sql), Violation::TransactionControlInDo, "{sql}");
        }
        for sql in [
            "SELECT f(); COMMIT; INSERT INTO t VALUES (1)",
            "SELECT 1; end; SELECT 2",
            "BEGIN; SELECT 1; ROLLBACK; INSERT INTO t VALUES (1)",
            "SELECT 1; ABORT; SELECT 2",
            "PREPARE TRANSACTION 'x'; SELECT 1",
            "COMMIT AND CHAIN; SELECT 1",
        ] {
            assert_eq!(refused(sql), Violation::AfterTransactionEnd, "{sql}");
        }
        for sql in [
            "BEGIN; SELECT 1; COMMIT",
            "BEGIN READ ONLY; SELECT 1; COMMIT; ; -- done",
            "SAVEPOINT a; SELECT 1; ROLLBACK TO SAVEPOINT a; SELECT 2",
            "ROLLBACK WORK TO a; SELECT 1; ROLLBACK TRANSACTION TO a; SELECT 2",
            "SELECT * FROM t WHERE status = 'rollback' OR status = 'commit'",
            "DO $$BEGIN PERFORM 1; END$$",
            "PREPARE q AS SELECT 1; EXECUTE q",
            "SELECT query_to_xml('COMMIT', true, false, ''); SELECT 1",
            "DO LANGUAGE plpgsql $$BEGIN PERFORM 1; END$$",
            "DO $$BEGIN PERFORM 1; END$$ LANGUAGE PLpgSQL",
            "DO LANGUAGE \"plpgsql\" $$BEGIN PERFORM 1; END$$",
            "SELECT language FROM t; SELECT 1 AS language",
        ] {
            allowed(sql);
        }
        // Encodings whose characters may end in an ASCII byte would make
        // the server read what follows otherwise than the check does.
        for sql in [
            "SET client_encoding = 'SJIS'",
            "SET client_encoding TO sjis",
            "set session client_encoding to \"BIG5\"",
            "SET LOCAL client_encoding = 'Shift_JIS'",
            "SET NAMES 'gbk'",
            "SET SESSION NAMES win936",
            "SELECT 1; SET CLIENT_ENCODING TO 'GB18030'",
            "SET \"CLIENT_ENCODING\" TO 'SJIS'",
            "SET U&\"Client_Encoding\" = 'big5'",
        ] {
            assert_eq!(refused(sql), Violation::ClientEncoding, "{sql}");
        }
        for sql in [
            "SELECT set_config('client_encoding', 'sjis', false)",
            "DO $$BEGIN EXECUTE 'SET client_encoding = ' || 'sjis'; END$$",
        ] {
            assert!(check_read_only(sql).is_err(), "{sql}");
        }
        for sql in [
            "SET client_encoding = 'UTF8'",
            "SET NAMES 'LATIN1'",
            "SET client_encoding TO DEFAULT",
            "RESET client_encoding",
            "SELECT current_setting('client_encoding')",
        ] {
            allowed(sql);
        }
        // Other languages commit through calls the check cannot see.
        for sql in [
            "DO LANGUAGE plperl $$ spi_exec_query('SELECT 1'); spi_commit(); $$",
            "DO $$ spi_commit $$ LANGUAGE \"pltcl\"",
            "DO LANGUAGE 'plperl' $$ spi_commit(); $$",
            "do language PLPYTHON3U $$plpy.commit()$$",
            "DO LANGUAGE \"PLPGSQL\" $$BEGIN PERFORM 1; END$$",
        ] {
            assert_eq!(refused(sql), Violation::DoLanguage, "{sql}");
        }
        // Passing DISCARD ALL is no reason to stop looking: what follows it,
        // in a string or as the next statement, is checked all the same.
        for sql in [
            "DISCARD ALL; BEGIN READ WRITE",
            "SELECT 'discard all'; COMMIT; BEGIN READ WRITE; INSERT INTO t VALUES (1); COMMIT",
            "SELECT 'discard all', set_config('default_transaction_read_only', 'off', false)",
            "DO $$BEGIN EXECUTE 'DISCARD ALL'; EXECUTE 'SET default_transaction_read_only = off'; END$$",
        ] {
            refused(sql);
        }
        assert_eq!(
            refused("reset Default_Transaction_Read_Only"),
            Violation::ResetParameter(GuardedParameter::DefaultTransactionReadOnly)
        );
        assert_eq!(
            refused("SELECT 1; RESET transaction_read_only"),
            Violation::ResetParameter(GuardedParameter::TransactionReadOnly)
        );
        assert_eq!(
            refused("SELECT 1 ; /* x */ RESET /* y */ ALL"),
            Violation::ResetAll
        );
        allowed("RESET SESSION AUTHORIZATION");
        allowed("RESET search_path");
        allowed("RESET ROLE; DISCARD PLANS; DISCARD TEMP");
        allowed("SELECT reset, all FROM t");
    }

    #[test]
    fn read_write_transactions() {
        let forms = [
            ("BEGIN READ WRITE", ReadWriteStatement::Begin),
            ("begin work read write", ReadWriteStatement::Begin),
            (
                "BEGIN TRANSACTION ISOLATION LEVEL SERIALIZABLE, READ WRITE",
                ReadWriteStatement::Begin,
            ),
            (
                "START TRANSACTION READ WRITE",
                ReadWriteStatement::StartTransaction,
            ),
            (
                "SET TRANSACTION READ WRITE",
                ReadWriteStatement::SetTransaction,
            ),
            (
                "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ WRITE",
                ReadWriteStatement::SetTransaction,
            ),
            (
                "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE",
                ReadWriteStatement::SessionCharacteristics,
            ),
            (
                "SET SESSION CHARACTERISTICS AS TRANSACTION DEFERRABLE, READ/**/WRITE",
                ReadWriteStatement::SessionCharacteristics,
            ),
        ];
        for (sql, want) in forms {
            for s in cases(sql) {
                assert_eq!(refused(&s), Violation::ReadWrite(want), "{s}");
            }
        }
        assert_eq!(
            refused("SELECT 1; begin read\n--x\nwrite").to_string(),
            "BEGIN READ WRITE"
        );
        assert_eq!(
            ReadOnlyViolation {
                kind: refused("SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE")
            }
            .to_string(),
            "cannot make a read-only session read-write: \
             SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE"
        );
    }

    #[test]
    fn set_config_calls() {
        for s in cases("SELECT set_config('default_transaction_read_only', 'off', false)") {
            assert_eq!(refused(&s), Violation::SetConfig, "{s}");
        }
        assert_eq!(
            refused("select pg_catalog.set_config('transaction_read_only','off',true)"),
            Violation::SetConfig
        );
        assert_eq!(
            refused("SELECT set_config('Transaction_Read_Only','off',true)"),
            Violation::SetConfig
        );
        assert_eq!(
            refused("SELECT set_config(name_col, 'off', false) FROM t"),
            Violation::SetConfig
        );
        // Constants separated by a newline are one constant.
        allowed("SELECT set_config('search_' \n 'path', 'x', false)");
        assert_eq!(
            refused("SELECT set_config('transaction_' -- c\n 'read_only', 'x', false)"),
            Violation::SetConfig
        );
        assert_eq!(
            refused("SELECT set_config('search_' 'path', 'x', false)"),
            Violation::SetConfig
        );
        assert_eq!(
            refused("SELECT set_config('search_path'::text, 'x', false)"),
            Violation::SetConfig
        );
        assert_eq!(
            refused(r#"SELECT pg_catalog."set_config"(E'transaction\137read_only', 'off', false)"#),
            Violation::SetConfig
        );
        assert_eq!(
            refused(r"SELECT set_config(U&'transaction\005fread_only', 'off', false)"),
            Violation::SetConfig
        );
        assert_eq!(refused("SELECT set_config /* x */ ("), Violation::SetConfig);
        allowed("SELECT set_config('search_path', 'x', false)");
        allowed("SELECT pg_catalog.set_config('application_name', 'app', true), 1");
        allowed("SELECT set_config($$work_mem$$, '64MB', false)");
        allowed(r#"SELECT "set_config" FROM t"#);
        allowed(r#"SELECT "SET_CONFIG"(1)"#);
        allowed("SELECT set_config_x('default')");
    }

    #[test]
    fn string_constants_are_inspected() {
        let forms = [
            "DO $$BEGIN EXECUTE 'SET default_transaction_read_only = off'; END$$",
            "DO $body$ BEGIN PERFORM pg_catalog.set_config('x', 'y', false); END $body$",
            "DO 'BEGIN EXECUTE ''RESET ALL''; END'",
            "DO $$ BEGIN EXECUTE 'RESET ALL'; END $$",
            "DO $$ BEGIN IF true THEN RESET ALL; END IF; END $$",
            "DO $$ BEGIN EXECUTE 'BEGIN READ/**/WRITE'; END $$",
            "DO $$ BEGIN EXECUTE 'SET SESSION CHARACTERISTICS AS TRANSACTION ' || x; END $$",
            "SELECT query_to_xml('set transaction_read_only = off', true, false, '')",
            "SELECT E'default\\137transaction\\x5fread_only'",
            r"SELECT U&'set\005fconfig'",
            "SELECT 'transaction_' \n 'read_only'",
            "SELECT $a$ $b$ inner $b$ ; SET default_transaction_read_only = off $a$",
            "SELECT 'read write'",
            "SELECT 'READ\n\tWRITE'",
            "SELECT 'Reset all filters'",
        ];
        for sql in forms {
            refused(sql);
        }
        assert_eq!(
            refused("SELECT 'a set_config b'"),
            Violation::StringMentions("set_config")
        );
        allowed("SELECT current_setting('transaction_read_only')");
        allowed("SELECT pg_catalog.current_setting('default_transaction_read_only', true)");
        allowed("SELECT 'read-only', 'write', 'all done', 'please reset'");
        allowed("SELECT $$ ; $$, $x$ read $x$, 'a;b'");
    }

    #[test]
    fn update_pg_settings() {
        for s in cases("UPDATE pg_settings SET setting = 'off' WHERE name = x") {
            assert_eq!(refused(&s), Violation::UpdatePgSettings, "{s}");
        }
        assert_eq!(
            refused("update only pg_catalog.pg_settings set setting = 1"),
            Violation::UpdatePgSettings
        );
        allowed("SELECT name, setting FROM pg_settings WHERE name LIKE 'log%'");
    }

    #[test]
    fn allowed_statements() {
        for sql in [
            "SELECT 1",
            "(SELECT 1) UNION (SELECT 2)",
            "  ((SELECT * FROM t WHERE a = $1))",
            "SET search_path TO x",
            "SET SESSION search_path = 'a', b",
            "SET TRANSACTION READ ONLY",
            "SET TRANSACTION ISOLATION LEVEL READ COMMITTED",
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ UNCOMMITTED",
            "BEGIN READ ONLY",
            "BEGIN ISOLATION LEVEL SERIALIZABLE",
            "START TRANSACTION READ ONLY, DEFERRABLE",
            "SHOW transaction_read_only",
            "SHOW default_transaction_read_only",
            "SELECT transaction_read_only FROM t",
            "-- SET default_transaction_read_only = off\nSELECT 1",
            "SELECT 1 /* RESET ALL; BEGIN READ WRITE; set_config( */",
            "SELECT 1 /* nested /* SET transaction_read_only=off */ still comment */",
            r#"SELECT "default_transaction_read_only" FROM t"#,
            r#"SELECT 1 AS "read", 2 AS "write""#,
            "SELECT read, write FROM t",
            "SELECT 'it''s', E'\\'', U&'\\0041'",
            "",
            ";;;",
            "SELECT $1, $2::text",
            "COMMIT",
        ] {
            allowed(sql);
        }
    }

    #[test]
    fn quoting_edge_cases() {
        // A semicolon inside a constant does not end the statement, so the
        // SET is still inside the string (and, mentioning the parameter, is
        // refused by the string rule rather than the SET rule).
        assert!(matches!(
            refused("SELECT 'x; SET default_transaction_read_only = off'"),
            Violation::SetParameter(_)
        ));
        // `$1` is a parameter, not a dollar quote, so the SET is code.
        assert_eq!(
            refused("SELECT $1; SET transaction_read_only = off; SELECT $1"),
            TRO
        );
        // An identifier may contain `$`, so this is no dollar quote either.
        assert_eq!(
            refused("SELECT a$$; SET transaction_read_only = off; SELECT $$"),
            TRO
        );
        // E-string escapes keep the string open past `\'`.
        allowed(r"SELECT E'\'; RESET ALL; --'");
        // Without E, the backslash is literal with standard_conforming_strings
        // on, so the SET is code; and it is also code when it is off.
        assert_eq!(
            refused(r"SELECT 'a\'; SET transaction_read_only = off; --'"),
            TRO
        );
        // With standard_conforming_strings on this ends in an unterminated
        // constant, a syntax error; with it off the server sees the SET as
        // code, so it must be refused.
        assert_eq!(
            refused(r"SELECT 'a\'' ; SET transaction_read_only = off"),
            TRO
        );
        assert_eq!(refused(r"SELECT 'a\'' ; RESET ALL"), Violation::ResetAll);
        // Bit strings end at the first quote; what follows is an ordinary
        // constant whose text is checked as SQL.
        assert_eq!(
            refused("SELECT B'1'' ; SET transaction_read_only = off; --'"),
            TRO
        );
        allowed("SELECT B'1', X'1F', N'x', b'0' 'x'");
    }

    #[test]
    fn unterminated_input_is_not_code() {
        allowed("SELECT 'abc; SET transaction_read_only = off");
        allowed("SELECT $q$ SET transaction_read_only = off");
        allowed("SELECT 1 /* SET transaction_read_only = off");
        allowed("SELECT \"x; SET transaction_read_only = off");
        allowed("SELECT E'\\");
        assert_eq!(
            refused("SET transaction_read_only = 'off"),
            TRO,
            "code before the constant is still checked"
        );
    }

    #[test]
    fn nesting_limit() {
        let mut sql = String::from("SELECT 1");
        for _ in 0..MAX_DEPTH + 1 {
            sql = format!("SELECT '{}'", sql.replace('\'', "''"));
        }
        assert_eq!(refused(&sql), Violation::NestingTooDeep);
        allowed("SELECT 'SELECT ''SELECT ''''x'''' '' '");
    }

    #[test]
    fn non_utf8_bytes_are_identifier_characters() {
        assert!(check_read_only_bytes(b"SELECT \xff\xfe FROM t").is_ok());
        assert!(check_read_only_bytes(b"SET \xe9transaction_read_only = off").is_ok());
        assert!(check_read_only_bytes(b"SELECT \xe9; SET transaction_read_only=1").is_err());
    }

    #[test]
    fn startup_options() {
        for opts in [
            "-c default_transaction_read_only=off",
            "-cdefault_transaction_read_only=off",
            "--default_transaction_read_only=off",
            "--default-transaction-read-only=off",
            "-c search_path=x -c Transaction_Read_Only=off",
            "-c search_path=a\\ b -c transaction_read_only=off",
            "-ec transaction_read_only=off",
            "  -c\ttransaction_read_only ",
        ] {
            assert!(options_set_read_only_guc(opts), "{opts}");
        }
        for opts in [
            "",
            "-c search_path=default_transaction_read_only",
            "-c application_name=x\\ -c\\ transaction_read_only=off",
            "-p transaction_read_only=off",
            "transaction_read_only=off",
            "-c",
        ] {
            assert!(!options_set_read_only_guc(opts), "{opts}");
        }
    }

    #[test]
    fn startup_parameters() {
        let mut m = StartupMessage::new(vec![
            ("user".into(), "u".into()),
            ("options".into(), "-c geqo=off".into()),
        ]);
        assert!(!startup_sets_read_only_guc(&m));
        m.set("Default_Transaction_Read_Only", "off");
        assert!(startup_sets_read_only_guc(&m));
        m.remove("Default_Transaction_Read_Only");
        m.set("options", "--transaction-read-only=0");
        assert!(startup_sets_read_only_guc(&m));
    }
}
