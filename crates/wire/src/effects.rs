//! What a query's statements do to a pooled server session, read from
//! the raw query text: whether they leave state behind that outlives the
//! transaction (so the client must keep its server connection), whether
//! they drop every prepared statement of the session, and whether the
//! query is a `DEALLOCATE`.
//!
//! The check is lexical. It runs on every Query and Parse of a
//! transaction-pooled client, so it walks the bytes in place and never
//! allocates for a statement without comments. It takes raw bytes: the
//! keywords are ASCII in every client encoding PostgreSQL accepts,
//! whatever the literals around them hold. Words inside string literals
//! may pin a client needlessly, which costs pooling, never correctness.

/// Bytes that make up the words [`Effects`] looks at.
const WORD: [bool; 256] = {
    let mut t = [false; 256];
    let mut i = 0;
    while i < 256 {
        let c = i as u8;
        t[i] = c.is_ascii_alphanumeric() || c == b'_';
        i += 1;
    }
    t
};

/// `sql` from its first token on: past white space and comments (`--` to
/// the end of the line, `/* */` nested), as PostgreSQL's lexer skips them.
fn after_comments(mut sql: &[u8]) -> &[u8] {
    loop {
        let trimmed = sql.trim_ascii_start();
        if let Some(rest) = trimmed.strip_prefix(b"--") {
            let end = rest
                .iter()
                .position(|&b| b == b'\n')
                .map_or(rest.len(), |p| p + 1);
            sql = &rest[end..];
        } else if trimmed.starts_with(b"/*") {
            sql = &trimmed[block_comment_len(trimmed)..];
        } else {
            return trimmed;
        }
    }
}

/// The length of the `/* */` comment that `sql` starts with, nested as
/// PostgreSQL's lexer nests them; all of `sql` when it is unterminated.
fn block_comment_len(sql: &[u8]) -> usize {
    let (mut depth, mut i) = (0usize, 0);
    while i < sql.len() {
        if sql[i..].starts_with(b"/*") {
            depth += 1;
            i += 2;
        } else if sql[i..].starts_with(b"*/") {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    sql.len()
}

/// The words of `sql`, in place: runs of ASCII letters, digits and `_`.
pub fn words(sql: &[u8]) -> Words<'_> {
    Words {
        sql,
        base: 0,
        mask: word_mask(sql, 0),
    }
}

/// The iterator of [`words`]. It classifies 64 bytes at a time into a bit
/// mask and finds each word's ends with bit operations: every Query and
/// Parse goes through it, and a byte-at-a-time loop over the text was
/// most of the cost of [`Effects::of`].
#[derive(Clone)]
pub struct Words<'a> {
    sql: &'a [u8],
    /// Where the block that `mask` describes starts.
    base: usize,
    /// One bit per byte of the block: set for the word bytes not yet
    /// returned.
    mask: u64,
}

impl<'a> Iterator for Words<'a> {
    type Item = &'a [u8];

    #[inline(always)]
    fn next(&mut self) -> Option<&'a [u8]> {
        while self.mask == 0 {
            if self.base + 64 >= self.sql.len() {
                return None;
            }
            self.base += 64;
            self.mask = word_mask(self.sql, self.base);
        }
        let first = self.mask.trailing_zeros() as usize;
        let start = self.base + first;
        // The run of set bits from `first`; 64 - first when it reaches the
        // end of the block (the shifted-in zeros become ones).
        let run = (!(self.mask >> first)).trailing_zeros() as usize;
        if first + run < 64 {
            self.mask &= !((1u64 << (first + run)) - 1);
            return Some(&self.sql[start..start + run]);
        }
        // The word reaches the end of the block: it goes on into the next
        // blocks for as long as they start with word bytes.
        loop {
            if self.base + 64 >= self.sql.len() {
                self.mask = 0;
                return Some(&self.sql[start..]);
            }
            self.base += 64;
            let mask = word_mask(self.sql, self.base);
            let more = mask.trailing_ones() as usize;
            if more < 64 {
                self.mask = mask & !((1u64 << more) - 1);
                return Some(&self.sql[start..self.base + more]);
            }
        }
    }
}

/// The word bytes of `sql[base..base + 64]`, one bit each (bit 0 for the
/// byte at `base`); bytes past the end count as not in a word.
fn word_mask(sql: &[u8], base: usize) -> u64 {
    let rest = sql.get(base..).unwrap_or_default();
    if let Some(block) = rest.first_chunk::<64>() {
        return block_mask(block);
    }
    let mut block = [0u8; 64];
    block[..rest.len()].copy_from_slice(rest);
    block_mask(&block)
}

/// One bit per byte of `block`, set for the bytes of [`WORD`].
#[cfg(target_arch = "x86_64")]
fn block_mask(block: &[u8; 64]) -> u64 {
    use std::arch::x86_64::*;
    let mut mask = 0u64;
    for (i, part) in block.chunks_exact(16).enumerate() {
        #[allow(unsafe_code)]
        // SAFETY: SSE2 is part of every x86_64 CPU, and `part` holds the
        // 16 bytes the unaligned load reads.
        let bits = unsafe {
            let v = _mm_loadu_si128(part.as_ptr().cast());
            // Signed compares: bytes of 0x80 and up are negative, below
            // every range here, as they are outside WORD.
            let lower = _mm_or_si128(v, _mm_set1_epi8(0x20));
            let letter = _mm_and_si128(
                _mm_cmpgt_epi8(lower, _mm_set1_epi8(b'a' as i8 - 1)),
                _mm_cmpgt_epi8(_mm_set1_epi8(b'z' as i8 + 1), lower),
            );
            let digit = _mm_and_si128(
                _mm_cmpgt_epi8(v, _mm_set1_epi8(b'0' as i8 - 1)),
                _mm_cmpgt_epi8(_mm_set1_epi8(b'9' as i8 + 1), v),
            );
            let under = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'_' as i8));
            _mm_movemask_epi8(_mm_or_si128(_mm_or_si128(letter, digit), under)) as u16
        };
        mask |= u64::from(bits) << (16 * i);
    }
    mask
}

/// One bit per byte of `block`, set for the bytes of [`WORD`].
#[cfg(not(target_arch = "x86_64"))]
fn block_mask(block: &[u8; 64]) -> u64 {
    block
        .iter()
        .enumerate()
        .fold(0, |m, (i, &b)| m | (u64::from(WORD[b as usize]) << i))
}

/// What a query's statements do to the session, as far as the pool must
/// know. Runs on every Query and Parse: one walk of the words serves all
/// three answers.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Effects {
    /// Some statement leaves state in the session that outlives its
    /// transaction ([`pins_statement`]).
    pub pins: bool,
    /// Some statement drops every prepared statement of the session:
    /// `DISCARD ALL` or `DEALLOCATE [PREPARE] ALL` (which may follow other
    /// statements in one query).
    pub drops: bool,
    /// The query starts with `DEALLOCATE`.
    pub deallocate: bool,
    /// Some statement is `DISCARD ALL`, which also returns every setting
    /// to the session's defaults (`DEALLOCATE ALL` keeps them).
    pub discards: bool,
    /// Some statement is a `RESET` other than of a tracked parameter
    /// (which the server reports): it returns settings to the session's
    /// defaults, start-up settings included.
    pub resets: bool,
    /// Some statement is `LOAD`: the module stays loaded in the server
    /// process, which no reset (`DISCARD ALL`) undoes.
    pub loads: bool,
}

impl Effects {
    /// The effects of the query `sql`. Takes raw bytes: the keywords are
    /// ASCII in every client encoding PostgreSQL accepts, whatever the
    /// literals around them hold.
    pub fn of(sql: &[u8]) -> Effects {
        // Most queries are one statement, perhaps with a closing
        // semicolon: those skip the split, which has to follow quotes and
        // comments.
        let several =
            memchr::memchr(b';', sql).is_some_and(|i| !sql[i + 1..].trim_ascii().is_empty());
        if !several {
            return Effects::of_statement(sql);
        }
        // The query's first word, wherever its first statement starts.
        let mut all = Effects {
            deallocate: words(after_comments(sql))
                .next()
                .is_some_and(|w| w.eq_ignore_ascii_case(b"DEALLOCATE")),
            ..Effects::default()
        };
        // A backslash reads differently with standard_conforming_strings
        // off, which a client may have set: both readings count, so a
        // statement one of them hides in a string is still seen.
        let readings: &[bool] = if memchr::memchr(b'\\', sql).is_some() {
            &[false, true]
        } else {
            &[false]
        };
        for &backslash in readings {
            for e in statements_lexed(sql, backslash).map(Effects::of_statement) {
                all.pins |= e.pins;
                all.drops |= e.drops;
                all.discards |= e.discards;
                all.resets |= e.resets;
                all.loads |= e.loads;
            }
        }
        all
    }

    fn of_statement(sql: &[u8]) -> Effects {
        let sql = after_comments(sql);
        // A comment between two words would stand between the words the
        // rules look at as pairs (`CREATE /* x */ TEMP`) and lend its own
        // words to them: such statements are read with their comments
        // blanked out by the lexer that knows where they are. Most have
        // none, and keep the word scan in place.
        let blanked = has_comment(sql)
            .then(|| crate::blank_comments(sql))
            .flatten();
        let sql = blanked.as_deref().unwrap_or(sql);
        let mut words = words(sql);
        let Some(first) = words.next() else {
            return Effects::default();
        };
        let is = |w: Option<&[u8]>, k: &[u8]| w.is_some_and(|w| w.eq_ignore_ascii_case(k));
        let (mut drops, mut deallocate, mut discards) = (false, false, false);
        if first.eq_ignore_ascii_case(b"DISCARD") {
            drops = is(words.clone().next(), b"ALL");
            discards = drops;
        } else if first.eq_ignore_ascii_case(b"DEALLOCATE") {
            deallocate = true;
            let mut w = words.clone();
            let mut next = w.next();
            if is(next, b"PREPARE") {
                next = w.next();
            }
            // `"ALL"` quoted is a statement of that name, not every one.
            let quoted = |w: &[u8]| {
                let at = w.as_ptr() as usize - sql.as_ptr() as usize;
                at > 0 && sql[at - 1] == b'"'
            };
            drops = is(next, b"ALL") && !next.is_some_and(quoted);
        }
        let resets = first.eq_ignore_ascii_case(b"RESET") && !resets_replayed(words.clone());
        Effects {
            pins: pins_statement(sql, first, words),
            drops,
            deallocate,
            discards,
            resets,
            loads: first.eq_ignore_ascii_case(b"LOAD"),
        }
    }
}

/// Whether the query `sql` leaves state in the session that outlives its
/// transaction, in any of its statements.
#[cfg(test)]
fn pins_session(sql: &[u8]) -> bool {
    Effects::of(sql).pins
}

/// Whether `sql` may hold a comment (`--` or `/*`, quoted or not): one
/// pass over the statement, which runs for every query.
#[inline]
fn has_comment(sql: &[u8]) -> bool {
    memchr::memchr2_iter(b'-', b'/', sql).any(|i| {
        let next = sql.get(i + 1).copied();
        matches!((sql[i], next), (b'-', Some(b'-')) | (b'/', Some(b'*')))
    })
}

/// Whether running the query `sql` drops every prepared statement of the
/// session.
#[cfg(test)]
fn drops_statements(sql: &[u8]) -> bool {
    Effects::of(sql).drops
}

/// Names a `SET` or `RESET` may change without pinning: the tracked
/// parameters, whose new values the server reports and pgwarden replays
/// on every server the client lands on, and `SET LOCAL`, `SET
/// TRANSACTION` and `SET CONSTRAINTS`, which end with the transaction.
const REPLAYED: [&str; 11] = [
    "LOCAL",
    "TRANSACTION",
    "CONSTRAINTS",
    "STANDARD_CONFORMING_STRINGS",
    "APPLICATION_NAME",
    "CLIENT_ENCODING",
    "DATESTYLE",
    "TIMEZONE",
    "TIME",
    "INTERVALSTYLE",
    "NAMES",
];

/// Whether a `RESET` followed by `words` resets only a tracked
/// parameter, whose new value the server reports and pgwarden replays.
fn resets_replayed<'a>(mut words: impl Iterator<Item = &'a [u8]>) -> bool {
    let name = words.next();
    name.is_some_and(|n| {
        REPLAYED
            .iter()
            .filter(|k| !matches!(**k, "LOCAL" | "TRANSACTION" | "CONSTRAINTS"))
            .any(|k| n.eq_ignore_ascii_case(k.as_bytes()))
    })
}

/// Whether one statement, `sql` from its first word on, leaves state in
/// the server session that the next transaction of the same client would
/// expect, so the client must keep its server connection; `words` are the
/// words after `first`. A lexical check: words inside string literals may
/// pin needlessly, which costs pooling, never correctness.
fn pins_statement<'a>(
    sql: &'a [u8],
    first: &'a [u8],
    words: impl Iterator<Item = &'a [u8]> + Clone,
) -> bool {
    // Runs on every Query and Parse, so it walks the words in place (no
    // upper-cased copy, no list of words) and compares a word only with
    // the keywords of its length.
    let is = |w: &[u8], k: &str| w.eq_ignore_ascii_case(k.as_bytes());
    // SQL-level PREPARE (protocol-level statements follow the client);
    // a module LOADed stays loaded in the server process.
    if is(first, "PREPARE") || is(first, "LOAD") {
        return true;
    }
    // A session-level SET outlives the transaction. A RESET only returns
    // to the session's defaults, which pooling keeps for clients without
    // start-up settings ([`Effects::resets`]).
    if is(first, "SET") {
        let mut rest = words.clone();
        let mut name = rest.next();
        if name.is_some_and(|n| is(n, "SESSION")) {
            name = rest.next();
        }
        if !name.is_some_and(|n| REPLAYED.iter().any(|k| is(n, k))) {
            return true;
        }
    }
    let mut prev: &[u8] = b"";
    let mut updates = false;
    for w in std::iter::once(first).chain(words) {
        let hit = match w.len() {
            4 => (is(w, "TEMP") && makes_temp(prev)) || (is(w, "HOLD") && is(prev, "WITH")),
            6 => {
                is(w, "LISTEN") || {
                    // `UPDATE pg_settings SET setting = ...` is a session SET.
                    updates |= is(w, "UPDATE");
                    false
                }
            }
            9 => is(w, "TEMPORARY") && makes_temp(prev),
            // A session-level set_config is a SET; PostgREST and row-level
            // security set theirs with is_local = true, which ends with
            // the transaction.
            10 => {
                is(w, "SET_CONFIG") && {
                    let at = w.as_ptr() as usize - sql.as_ptr() as usize + w.len();
                    !set_config_is_local(&sql[at..])
                }
            }
            11 => updates && is(w, "PG_SETTINGS"),
            13 => is(w, "AUTHORIZATION") && is(prev, "SESSION"),
            16 => is(w, "PG_ADVISORY_LOCK"),
            20 => is(w, "PG_TRY_ADVISORY_LOCK"),
            23 => is(w, "PG_ADVISORY_LOCK_SHARED"),
            27 => is(w, "PG_TRY_ADVISORY_LOCK_SHARED"),
            _ => false,
        };
        if hit || temp_schema(sql, w) {
            return true;
        }
        prev = w;
    }
    false
}

/// Whether the word `w` of `sql` names the session's temporary schema
/// (`pg_temp`, or its real name `pg_temp_N`) as the schema of an object:
/// `CREATE TABLE pg_temp.t`, `CREATE FUNCTION "pg_temp" . f()` make
/// temporary objects as `TEMP` does. Quoted or not, whatever the case: a
/// quoted `"PG_TEMP"` is another schema, but pinning for it costs only
/// pooling.
#[inline(always)]
fn temp_schema(sql: &[u8], w: &[u8]) -> bool {
    let Some(head) = w.get(..7) else {
        return false;
    };
    if !head.eq_ignore_ascii_case(b"PG_TEMP") {
        return false;
    }
    let number = &w[7..];
    if let Some(digits) = number.strip_prefix(b"_") {
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return false;
        }
    } else if !number.is_empty() {
        return false;
    }
    let after = &sql[w.as_ptr() as usize - sql.as_ptr() as usize + w.len()..];
    let after = after.strip_prefix(b"\"").unwrap_or(after);
    after.trim_ascii_start().starts_with(b".")
}

/// Whether `TEMP`/`TEMPORARY` after this word makes a temporary object:
/// `CREATE [OR REPLACE] [GLOBAL | LOCAL] TEMP ...`, `SELECT ... INTO TEMP`.
fn makes_temp(prev: &[u8]) -> bool {
    ["CREATE", "REPLACE", "GLOBAL", "LOCAL", "INTO"]
        .iter()
        .any(|k| prev.eq_ignore_ascii_case(k.as_bytes()))
}

/// Whether the call whose arguments start at `args` (just after the name
/// `set_config`) passes a literal true as its third argument. Anything
/// else, a parameter (`$3`) included, counts as possibly session-level.
fn set_config_is_local(args: &[u8]) -> bool {
    let Some(args) = after_comments(args).strip_prefix(b"(") else {
        return false;
    };
    let (mut depth, mut commas, mut third) = (0usize, 0, 0);
    let mut i = 0;
    while i < args.len() {
        match args[i] {
            b'\'' | b'"' | b'$' | b'-' | b'/' => {
                i = skip_quoted(args, i, false);
                continue;
            }
            b'(' | b'[' => depth += 1,
            b')' | b']' if depth > 0 => depth -= 1,
            b')' => {
                if commas != 2 {
                    return false;
                }
                let v = args[third..i].trim_ascii();
                return [&b"true"[..], b"'t'", b"'true'", b"'on'", b"'yes'", b"'1'"]
                    .iter()
                    .any(|t| v.eq_ignore_ascii_case(t));
            }
            b',' if depth == 0 => {
                commas += 1;
                third = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    false
}

/// Whether `b` may be part of an identifier or a dollar quote's tag:
/// PostgreSQL takes every byte from 0x80 up as a letter.
fn ident_byte(b: u8) -> bool {
    WORD[b as usize] || b >= 0x80
}

/// Past the quoted string, quoted identifier, dollar-quoted string or
/// comment that may start at `sql[i]`; `i + 1` when none does there. An
/// unterminated one runs to the end. `backslash`: plain strings take
/// backslash escapes too (`standard_conforming_strings` off).
fn skip_quoted(sql: &[u8], i: usize, backslash: bool) -> usize {
    let rest = &sql[i..];
    let end = |close: &[u8], from: usize| {
        rest[from..]
            .windows(close.len())
            .position(|w| w == close)
            .map_or(sql.len(), |p| i + from + p + close.len())
    };
    match rest[0] {
        b'\'' => {
            // E'...' strings take backslash escapes; in others a doubled
            // quote is a quote, which the loop sees as two strings.
            let escapes = backslash
                || (i > 0
                    && sql[i - 1].eq_ignore_ascii_case(&b'e')
                    && (i < 2 || !(ident_byte(sql[i - 2]) || sql[i - 2] == b'$')));
            let mut j = 1;
            while j < rest.len() {
                match rest[j] {
                    b'\\' if escapes => j += 2,
                    b'\'' => return i + j + 1,
                    _ => j += 1,
                }
            }
            sql.len()
        }
        b'"' => end(b"\"", 1),
        b'-' if rest.starts_with(b"--") => end(b"\n", 2),
        b'/' if rest.starts_with(b"/*") => i + block_comment_len(rest),
        // $tag$ ... $tag$, the tag empty or an identifier; not $1, and
        // not a $ inside an identifier (a$b, é$b).
        b'$' if i == 0 || !(ident_byte(sql[i - 1]) || sql[i - 1] == b'$') => {
            let tag_len = rest[1..]
                .iter()
                .position(|&b| !ident_byte(b))
                .unwrap_or(rest.len() - 1);
            let tag_ok = rest.get(1 + tag_len) == Some(&b'$')
                && rest.get(1).map_or(true, |b| !b.is_ascii_digit());
            if !tag_ok {
                return i + 1;
            }
            let tag = &rest[..tag_len + 2];
            end(tag, tag.len())
        }
        _ => i + 1,
    }
}

/// The statements of a query: its text split at the semicolons outside
/// quotes and comments.
pub fn statements(sql: &[u8]) -> impl Iterator<Item = &[u8]> {
    statements_lexed(sql, false)
}

/// [`statements`], with backslash escapes in plain strings if
/// `backslash` (`standard_conforming_strings` off).
fn statements_lexed(sql: &[u8], backslash: bool) -> impl Iterator<Item = &[u8]> {
    let mut start = 0;
    let mut i = 0;
    std::iter::from_fn(move || {
        while i < sql.len() {
            match sql[i] {
                b'\'' | b'"' | b'$' | b'-' | b'/' => i = skip_quoted(sql, i, backslash),
                b';' => {
                    let s = &sql[start..i];
                    i += 1;
                    start = i;
                    return Some(s);
                }
                _ => i += 1,
            }
        }
        (start < sql.len()).then(|| {
            let s = &sql[start..];
            start = sql.len();
            s
        })
    })
}

#[cfg(test)]
mod tests {
    use super::pins_session;

    /// A statement after a string or dollar quote is found wherever
    /// PostgreSQL's lexer finds it: `$` after a non-ASCII letter is part
    /// of the identifier, a tag may hold such letters, and a backslash
    /// may escape a quote (`standard_conforming_strings` off).
    #[test]
    fn statements_are_split_as_postgres_lexes_them() {
        let loads = |sql: &str| super::Effects::of(sql.as_bytes()).loads;
        assert!(loads("LOAD 'auto_explain'"));
        assert!(loads("SELECT 1; /* x */ load 'auto_explain'"));
        assert!(!loads("SELECT 'LOAD'"));
        let pins = |sql: &str| super::Effects::of(sql.as_bytes()).pins;
        assert!(pins("SELECT 1 AS é$a$; SET search_path TO x"));
        assert!(pins("SELECT $é$ ' $é$; SET search_path TO x"));
        assert!(pins("SELECT '\\''; SET search_path TO x"));
        assert!(pins("SELECT 'a\\'; SET search_path TO x"));
        assert!(!pins("SELECT 1 AS é$a$; SELECT 2"));
        assert!(!pins("SELECT $é$ ; SET x $é$; SELECT 2"));
    }

    /// The words of `sql` found one byte at a time, as [`super::words`]
    /// must find them.
    fn words_bytewise(sql: &[u8]) -> Vec<&[u8]> {
        sql.split(|&b| !super::WORD[b as usize])
            .filter(|w| !w.is_empty())
            .collect()
    }

    #[test]
    fn words_are_found_across_blocks_of_any_length() {
        // Words that end at, start at and span the 64-byte block edges, a
        // word longer than two blocks, bytes above 0x7f and every ASCII
        // byte next to the ranges of word bytes.
        let mut cases: Vec<Vec<u8>> = vec![
            b"".to_vec(),
            b" ".to_vec(),
            b"a".to_vec(),
            b"@AZ[`az{/09:_".to_vec(),
            b"SELECT abalance FROM pgbench_accounts WHERE aid = 1;".to_vec(),
            "caf\u{e9} na\u{ef}ve_\u{4e2d}x".as_bytes().to_vec(),
            vec![b'x'; 200],
        ];
        for len in [62, 63, 64, 65, 127, 128, 129, 191, 192, 193] {
            for word in [1, 2, 63, 64, 65, 130] {
                let mut v = vec![b' '; len];
                for at in [0, len.saturating_sub(word), len / 2] {
                    for b in v.iter_mut().skip(at).take(word) {
                        *b = b'w';
                    }
                }
                cases.push(v);
            }
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..3000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let len = (seed % 300) as usize;
            let mut v = Vec::with_capacity(len);
            let mut r = seed;
            for _ in 0..len {
                r = r
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                // Mostly word bytes and spaces, some of everything else.
                let b = (r >> 33) as u8;
                v.push(match b % 8 {
                    0..=3 => b"aZ_9"[(b as usize >> 3) % 4],
                    4 | 5 => b' ',
                    _ => b,
                });
            }
            cases.push(v);
        }
        for case in &cases {
            let found: Vec<&[u8]> = super::words(case).collect();
            assert_eq!(found, words_bytewise(case), "in {case:?}");
            // A clone goes on from where the original stands.
            let mut it = super::words(case);
            it.next();
            let rest: Vec<&[u8]> = it.clone().collect();
            assert_eq!(rest, it.collect::<Vec<_>>());
        }
    }

    #[test]
    fn session_state_pins_and_transaction_state_does_not() {
        for s in [
            "LISTEN ch",
            "select pg_advisory_lock(1)",
            "CREATE TEMP TABLE t (x int)",
            "create temporary table t (x int)",
            "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
            "SET search_path TO x",
            "PREPARE p AS SELECT 1",
            // Temporary objects, however the statement spells them.
            "CREATE TABLE pg_temp.tt3(x int)",
            "CREATE /*x*/ TEMP TABLE tt2(x int)",
            "CREATE -- c\nTEMPORARY TABLE t (x int)",
            "create /* a /* nested */ one */ local temp table t (x int)",
            "CREATE TABLE \"pg_temp\".t (x int)",
            "CREATE TABLE pg_temp . t (x int)",
            "create table PG_TEMP_3.t (x int)",
            "CREATE SEQUENCE pg_temp /* x */ . s",
            "CREATE VIEW pg_temp.v AS SELECT 1",
            "CREATE FUNCTION pg_temp.f() RETURNS int AS 'select 1' LANGUAGE sql",
            "DECLARE c CURSOR WITH /*x*/ HOLD FOR SELECT 1",
            "SET /* LOCAL */ search_path TO x",
            "LOAD 'auto_explain'",
            "/* a */ load 'auto_explain'",
        ] {
            assert!(pins_session(s.as_bytes()), "{s}");
        }
        for s in [
            "SELECT 1",
            "SET LOCAL search_path TO x",
            "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            // Ends with its transaction (Django's check_constraints).
            "SET CONSTRAINTS ALL IMMEDIATE",
            "set constraints all deferred",
            // Tracked and replayed, as application_name is.
            "SET standard_conforming_strings = off",
            "SET application_name = 'x'",
            "SET TIME ZONE 'UTC'",
            "select pg_advisory_xact_lock(1)",
            "BEGIN",
            "RESET application_name",
            "RESET TIME ZONE",
            // Pinned only for clients with start-up settings ([`Effects::resets`]).
            "RESET ALL",
            "reset search_path",
            "RESET ROLE",
            "-- comment\nRESET work_mem",
            "SELECT 1; RESET ALL",
            "SELECT set_config('request.jwt.claims', $1, true)",
            "select pg_catalog.set_config('app.tenant', '42', TRUE)",
            "SELECT set_config('a', 'it''s, (x)', 'on')",
            "SELECT set_config(E'a\\'', $$b,$$, true)",
            "BEGIN; SELECT 1; COMMIT;",
            "SELECT ';SET search_path TO x'",
            "SELECT 1 -- ; SET search_path TO x",
            "SELECT $q$ ; SET search_path TO x $q$",
            // Words in comments are not the statement's.
            "SELECT 1 /* CREATE TEMP TABLE t */",
            "SELECT 1 -- LISTEN x",
            "SELECT '--', 1",
            "SELECT pg_temporary.x FROM pg_temp_x.t",
            "SELECT 'pg_temp'",
        ] {
            assert!(!pins_session(s.as_bytes()), "{s}");
        }
        for s in [
            "CREATE GLOBAL TEMPORARY TABLE t (x int)",
            "create local temp table t (x int)",
            "CREATE OR REPLACE TEMP VIEW v AS SELECT 1",
            "SELECT 1 AS x INTO TEMP t",
            "select * into temporary table t from pg_class",
            "/* by the ORM */ SET search_path TO x",
            "SELECT set_config('search_path', 'x', false)",
            "SELECT set_config('search_path', 'x', $3)",
            "SELECT set_config('a', 'b')",
            "SELECT set_config",
            "BEGIN; SET search_path TO x; COMMIT",
            "SELECT ''''; SET search_path TO x",
            "SELECT $1; SET search_path TO x",
            "UPDATE pg_settings SET setting = '50' WHERE name = 'statement_timeout'",
            "update pg_catalog.pg_settings set setting = 'x' where name = 'search_path'",
            "WITH s AS (UPDATE pg_settings SET setting = '1' RETURNING 1) SELECT 1",
        ] {
            assert!(pins_session(s.as_bytes()), "{s}");
        }
        assert!(!pins_session(b"SELECT setting FROM pg_settings"));
        for (s, discards) in [
            ("DISCARD ALL", true),
            ("SELECT 1; discard all", true),
            ("DEALLOCATE ALL", false),
            ("SELECT 1; DEALLOCATE PREPARE ALL", false),
            ("DISCARD PLANS", false),
            ("SELECT 'DISCARD ALL'", false),
        ] {
            assert_eq!(super::Effects::of(s.as_bytes()).discards, discards, "{s}");
        }
        for (s, resets) in [
            ("RESET ALL", true),
            ("reset search_path", true),
            ("-- c\nRESET work_mem", true),
            ("SELECT 1; RESET ALL", true),
            ("RESET ROLE", true),
            ("RESET TIME ZONE", false),
            ("reset application_name", false),
            ("RESET DateStyle", false),
            ("SELECT 'RESET ALL'", false),
            ("DISCARD ALL", false),
        ] {
            assert_eq!(super::Effects::of(s.as_bytes()).resets, resets, "{s}");
        }
        assert!(super::drops_statements(b"discard  ALL;"));
        assert!(super::drops_statements(b"/* pool */ DEALLOCATE ALL"));
        assert!(super::drops_statements(b"deallocate prepare all"));
        assert!(!super::drops_statements(b"DEALLOCATE \"ALL\""));
        assert!(!super::drops_statements(b"deallocate prepare \"all\""));
        assert!(!super::drops_statements(b"DEALLOCATE s1"));
        assert!(!super::drops_statements(b"DISCARD PLANS"));
        assert!(!super::drops_statements(b"SELECT 'DISCARD ALL'"));
        assert!(!super::drops_statements(b"/* DISCARD ALL */ SELECT 1"));
        assert!(super::drops_statements(
            b"-- DISCARD\n/* a /* b */ c */DISCARD ALL"
        ));
        assert!(!super::drops_statements(b"/* unterminated DISCARD ALL"));
        assert!(super::drops_statements(b"SELECT 1; DEALLOCATE ALL"));
        assert!(!super::drops_statements(b"SELECT ';DEALLOCATE ALL'"));
        // Literals in a client encoding other than UTF-8 (LATIN1 'é').
        assert!(pins_session(b"SET search_path TO '\xe9'"));
        assert!(pins_session(b"LISTEN \"ch\xe9\""));
        assert!(!pins_session(b"SELECT '\xe9'"));
    }

    /// The straightforward statement of the rule: split into statements at
    /// semicolons outside quotes and comments; per statement, past leading
    /// comments, upper-case, split into words, look at pairs and at the
    /// first words.
    fn reference(sql: &str) -> bool {
        let mut statements = vec![String::new()];
        let (mut quote, mut line_comment, mut depth) = (None, false, 0);
        let chars: Vec<char> = sql.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            let (c, next) = (chars[i], chars.get(i + 1).copied());
            let cur = statements.last_mut().unwrap();
            i += 1;
            // Comments become spaces.
            if line_comment {
                line_comment = c != '\n';
                cur.push(if line_comment { ' ' } else { c });
                continue;
            }
            if depth > 0 || (quote.is_none() && c == '/' && next == Some('*')) {
                match (c, next) {
                    ('/', Some('*')) => depth += 1,
                    ('*', Some('/')) => depth -= 1,
                    _ => {
                        cur.push(' ');
                        continue;
                    }
                }
                i += 1;
                cur.push_str("  ");
                continue;
            }
            if let Some(q) = quote {
                if c == q {
                    quote = None;
                }
            } else if c == '\'' || c == '"' {
                quote = Some(c);
            } else if c == '-' && next == Some('-') {
                line_comment = true;
                cur.push(' ');
                continue;
            } else if c == ';' {
                statements.push(String::new());
                continue;
            }
            cur.push(c);
        }
        statements.iter().any(|s| reference_statement(s))
    }

    /// `s` past white space and `--` comments.
    fn skip_comments(mut s: &str) -> &str {
        loop {
            s = s.trim_start();
            match s.strip_prefix("--") {
                Some(rest) => s = rest.find('\n').map_or("", |i| &rest[i + 1..]),
                None => return s,
            }
        }
    }

    fn reference_statement(sql: &str) -> bool {
        let sql = skip_comments(sql);
        let upper = sql.to_ascii_uppercase();
        // `pg_temp` (or `pg_temp_N`) as a schema: before a dot, perhaps
        // quoted, spaces between.
        let temp_schema = upper.match_indices("PG_TEMP").any(|(at, _)| {
            let word_start = at == 0 || {
                let b = upper.as_bytes()[at - 1];
                !(b.is_ascii_alphanumeric() || b == b'_')
            };
            let mut rest = &upper[at + 7..];
            if let Some(n) = rest.strip_prefix('_') {
                let digits = n.bytes().take_while(u8::is_ascii_digit).count();
                if digits == 0 {
                    return false;
                }
                rest = &n[digits..];
            }
            let rest = rest.strip_prefix('"').unwrap_or(rest);
            word_start && rest.trim_start().starts_with('.')
        });
        if temp_schema {
            return true;
        }
        let mut words: Vec<(usize, &str)> = Vec::new();
        let mut start = None;
        for (i, c) in upper.char_indices().chain([(upper.len(), ' ')]) {
            let word = c.is_ascii_alphanumeric() || c == '_';
            match (word, start) {
                (true, None) => start = Some(i),
                (false, Some(b)) => {
                    words.push((b, &upper[b..i]));
                    start = None;
                }
                _ => {}
            }
        }
        let names: Vec<&str> = words.iter().map(|w| w.1).collect();
        let pair = names.windows(2).any(|w| {
            matches!(
                (w[0], w[1]),
                (
                    "CREATE" | "REPLACE" | "GLOBAL" | "LOCAL" | "INTO",
                    "TEMP" | "TEMPORARY"
                ) | ("WITH", "HOLD")
                    | ("SESSION", "AUTHORIZATION")
            )
        });
        let replayed = |name: Option<&&str>| {
            matches!(
                name,
                Some(
                    &"APPLICATION_NAME"
                        | &"CLIENT_ENCODING"
                        | &"DATESTYLE"
                        | &"TIMEZONE"
                        | &"TIME"
                        | &"INTERVALSTYLE"
                        | &"NAMES"
                )
            ) || matches!(name, Some(&"LOCAL" | &"TRANSACTION"))
        };
        pair || words.iter().enumerate().any(|(i, (at, w))| match *w {
            "LISTEN"
            | "PG_ADVISORY_LOCK"
            | "PG_ADVISORY_LOCK_SHARED"
            | "PG_TRY_ADVISORY_LOCK"
            | "PG_TRY_ADVISORY_LOCK_SHARED" => true,
            "PG_SETTINGS" => names[..i].contains(&"UPDATE"),
            "SET_CONFIG" => !skip_comments(&sql[at + w.len()..])
                .to_ascii_lowercase()
                .starts_with("('a','b',true)"),
            "PREPARE" | "LOAD" => i == 0,
            "SET" => {
                let name = match names.get(1) {
                    Some(&"SESSION") => names.get(2),
                    other => other,
                };
                i == 0 && !replayed(name)
            }
            _ => false,
        })
    }

    #[test]
    fn agrees_with_the_reference_on_generated_statements() {
        let vocab = [
            "set",
            "SET",
            "session",
            "Session",
            "local",
            "time",
            "zone",
            "names",
            "application_name",
            "search_path",
            "to",
            "prepare",
            "create",
            "into",
            "global",
            "replace",
            "temp",
            "temporary",
            "table",
            "with",
            "hold",
            "authorization",
            "listen",
            "pg_advisory_lock",
            "pg_try_advisory_lock_shared",
            "update",
            "pg_settings",
            "select",
            "1",
            "é",
            ";",
            "(",
            "'x'",
            "\"q\"",
            " ",
            "\n",
            "--",
            "begin",
            "reset",
            "all",
            "set_config('a','b',true)",
            "SET_CONFIG('a','b',false)",
            "set_config($1,$2,$3)",
            "pg_temp",
            "PG_TEMP_7",
            "\"pg_temp\"",
            ".",
            "load",
            "/*",
            "*/",
        ];
        // A small deterministic generator (xorshift): no test dependency.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            let mut sql = String::new();
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            for _ in 0..(x % 7) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                sql.push_str(vocab[(x % vocab.len() as u64) as usize]);
                if x & 0x100 != 0 {
                    sql.push(' ');
                }
            }
            assert_eq!(pins_session(sql.as_bytes()), reference(&sql), "{sql:?}");
        }
    }
}
