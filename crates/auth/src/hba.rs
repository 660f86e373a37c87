//! `pg_hba.conf`: parsing and first-match rule lookup, as in PostgreSQL 15
//! (`src/backend/libpq/hba.c`).
//!
//! The tokenizer reproduces PostgreSQL's: `#` comments, backslash line
//! continuation, blank- and comma-separated tokens, double quotes (`""` is a
//! literal quote, and a quoted keyword is a plain name: `"all"` is a database
//! called all), and `@file` inclusion of a token list relative to the
//! including file. Include files are read through a caller-supplied function
//! so that parsing stays free of IO; [`Hba::load`] is the convenience that
//! uses the file system.
//!
//! pgwarden implements a subset of PostgreSQL's methods and address forms,
//! and refuses the rest when parsing, with the file and line, rather than
//! matching differently from PostgreSQL at connection time:
//!
//! * methods `trust`, `reject`, `password`, `md5`, `scram-sha-256`,
//!   `cert` and `peer` (on `local` lines); `ident`, `gss`, `sspi`, `pam`,
//!   `bsd`, `ldap` and `radius` are refused;
//! * addresses in CIDR or address-and-mask form, `all`, `samehost` and
//!   `samenet`; host names are refused;
//! * options `clientcert` and `clientname=CN`; `clientname=DN` (matching
//!   the whole subject), `map` (user name maps) and the options of the
//!   refused methods are refused;
//! * regular expressions (`/...` database or user entries, a PostgreSQL 16
//!   feature) are refused rather than taken as literal names.
//!
//! Two deliberate differences in matching: a client address that is an
//! IPv4-mapped IPv6 address is matched as the IPv4 address (PostgreSQL
//! listens per address family and sees the IPv4 address, while pgwarden may
//! listen dual-stack), and `hostgssenc` rows never match because pgwarden
//! does not offer GSSAPI encryption.

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

/// Deepest nesting of `@file` includes, as PostgreSQL 16 limits it
/// (PostgreSQL 15 has no limit and overflows its stack on a cycle).
pub const MAX_INCLUDE_DEPTH: usize = 10;

/// A `pg_hba.conf` problem, located by file and line.
///
/// `Display` is `origin:line: message`, or `origin: message` for problems
/// with the file as a whole (`line` 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HbaError {
    /// The file containing the problem: the main file, or an included one.
    pub origin: PathBuf,
    /// 1-based line number (of the first physical line of a continued
    /// line); 0 when the problem is not on a particular line.
    pub line: usize,
    /// What is wrong, worded like PostgreSQL's messages where it has one.
    pub message: String,
}

impl fmt::Display for HbaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}: {}", self.origin.display(), self.message)
        } else {
            write!(
                f,
                "{}:{}: {}",
                self.origin.display(),
                self.line,
                self.message
            )
        }
    }
}

impl std::error::Error for HbaError {}

/// The connection types a rule applies to (its first field).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuleConnType {
    /// `local`: Unix-domain socket connections.
    Local,
    /// `host`: TCP connections, with or without SSL.
    Host,
    /// `hostssl`: TCP connections using SSL.
    HostSsl,
    /// `hostnossl`: TCP connections not using SSL.
    HostNoSsl,
    /// `hostgssenc`: TCP connections using GSSAPI encryption; never matches
    /// in pgwarden.
    HostGssEnc,
    /// `hostnogssenc`: TCP connections not using GSSAPI encryption, which
    /// in pgwarden is all of them.
    HostNoGssEnc,
}

/// One entry of a rule's database list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DatabaseSpec {
    /// `all`: any database, except for physical replication connections.
    All,
    /// `sameuser`: the database named like the user.
    SameUser,
    /// `samerole` (or `samegroup`): a database named like a role the user
    /// is a member of.
    SameRole,
    /// `replication`: physical replication connections, and only those.
    Replication,
    /// A database name (a quoted keyword lands here too).
    Name(String),
}

/// One entry of a rule's user list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UserSpec {
    /// `all`: any user.
    All,
    /// `+role`: members of the role, directly or indirectly.
    Group(String),
    /// A user name (a quoted keyword or `"+name"` lands here too).
    Name(String),
}

/// A rule's client address field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddressSpec {
    /// `all`: any address.
    All,
    /// `samehost`: any of the server's own addresses.
    SameHost,
    /// `samenet`: any address on a network the server is directly on.
    SameNet,
    /// An address range: client addresses of the same family with
    /// `(client ^ addr) & mask == 0`. CIDR entries become a prefix mask;
    /// a separate mask field is used as written, contiguous or not, as in
    /// PostgreSQL.
    Net {
        /// The address as written (host bits are not cleared).
        addr: IpAddr,
        /// The mask, of the same family as `addr`.
        mask: IpAddr,
    },
}

/// The authentication methods pgwarden implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthMethod {
    /// Accept without a password.
    Trust,
    /// Refuse (see [`reject_message`]).
    Reject,
    /// Cleartext password.
    Password,
    /// md5 challenge, or SCRAM if the role's secret is a SCRAM one.
    Md5,
    /// SCRAM-SHA-256.
    ScramSha256,
    /// TLS client certificate, whose name must be the user's.
    Cert,
    /// On a Unix-domain socket: the client process's operating-system
    /// user, as the kernel reports it, must be the user it logs in as.
    Peer,
}

impl AuthMethod {
    /// The keyword, as written in `pg_hba.conf`.
    pub fn as_str(self) -> &'static str {
        match self {
            AuthMethod::Trust => "trust",
            AuthMethod::Reject => "reject",
            AuthMethod::Password => "password",
            AuthMethod::Md5 => "md5",
            AuthMethod::ScramSha256 => "scram-sha-256",
            AuthMethod::Cert => "cert",
            AuthMethod::Peer => "peer",
        }
    }
}

/// The `clientcert` option: the client must present a certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientCert {
    /// `verify-ca`: signed by a trusted CA.
    VerifyCa,
    /// `verify-full`: signed by a trusted CA, and the subject's common
    /// name is the user's. Implied by the `cert` method.
    VerifyFull,
}

/// One parsed `pg_hba.conf` record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HbaRule {
    /// Line number in the main file (the first line of a continued line).
    pub line: usize,
    /// The line as written, continuations joined, for logs.
    pub text: String,
    /// Connection types the rule applies to.
    pub conn_type: RuleConnType,
    /// Databases the rule applies to; any entry may match.
    pub databases: Vec<DatabaseSpec>,
    /// Users the rule applies to; any entry may match.
    pub users: Vec<UserSpec>,
    /// Client addresses the rule applies to; `None` for `local` rules.
    pub address: Option<AddressSpec>,
    /// How to authenticate a matching connection.
    pub method: AuthMethod,
    /// Client certificate requirement: `VerifyFull` for `cert`, otherwise
    /// as set by the `clientcert` option (`None` when not required).
    pub client_cert: Option<ClientCert>,
}

/// How the client is connected, as far as rule matching cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnType {
    /// Unix-domain socket.
    Local,
    /// TCP, with or without SSL.
    Host {
        /// Whether the connection is encrypted with SSL.
        ssl: bool,
    },
}

/// What [`Hba::find`] matches rules against.
#[derive(Clone, Copy)]
pub struct HbaContext<'a> {
    /// Socket type and encryption.
    pub conn_type: ConnType,
    /// Requested database (after defaulting to the user name).
    pub database: &'a str,
    /// Requested user.
    pub user: &'a str,
    /// Client address for TCP connections.
    pub addr: Option<IpAddr>,
    /// A physical replication connection (`replication=true` in the startup
    /// packet): such a connection matches only `replication` database
    /// entries. Logical replication (`replication=database`) is a normal
    /// connection here.
    pub physical_replication: bool,
    /// The roles `user` is a member of, directly or indirectly (looked up
    /// by the caller on the primary). Called at most once per
    /// [`Hba::find`], and only if a `+role` or `samerole` entry is reached.
    /// An empty list means there is no such role: it is a member of
    /// nothing, not even of a role of its own name, as in PostgreSQL.
    /// Otherwise the user counts as a member of its own role.
    pub roles_of_user: &'a dyn Fn(&str) -> Vec<String>,
    /// The server's own addresses with their network prefix lengths, for
    /// `samehost` and `samenet`.
    pub local_addrs: &'a [(IpAddr, u8)],
}

impl<'a> HbaContext<'a> {
    /// A context with no role memberships, no local addresses and no
    /// replication; override fields with struct update syntax as needed.
    pub fn new(
        conn_type: ConnType,
        database: &'a str,
        user: &'a str,
        addr: Option<IpAddr>,
    ) -> Self {
        HbaContext {
            conn_type,
            database,
            user,
            addr,
            physical_replication: false,
            roles_of_user: &no_roles,
            local_addrs: &[],
        }
    }
}

impl fmt::Debug for HbaContext<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HbaContext")
            .field("conn_type", &self.conn_type)
            .field("database", &self.database)
            .field("user", &self.user)
            .field("addr", &self.addr)
            .field("physical_replication", &self.physical_replication)
            .field("local_addrs", &self.local_addrs)
            .finish_non_exhaustive()
    }
}

fn no_roles(_: &str) -> Vec<String> {
    Vec::new()
}

/// A parsed `pg_hba.conf`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hba {
    rules: Vec<HbaRule>,
}

impl Hba {
    /// Parses `text`, the contents of the file at `origin`. `origin` names
    /// the file in errors and anchors relative `@file` includes, which are
    /// read with `read` (given the joined path).
    ///
    /// Like PostgreSQL, a file without any rule is an error.
    pub fn parse(
        text: &str,
        origin: &Path,
        read: &dyn Fn(&Path) -> io::Result<String>,
    ) -> Result<Hba, HbaError> {
        let lines = tokenize(text, origin, read, 0)?;
        let rules = lines
            .into_iter()
            .map(|line| parse_line(line, origin))
            .collect::<Result<Vec<_>, _>>()?;
        if rules.is_empty() {
            return Err(HbaError {
                origin: origin.to_owned(),
                line: 0,
                message: "configuration file contains no entries".into(),
            });
        }
        Ok(Hba { rules })
    }

    /// Reads and parses the file at `path`, and its includes, from the file
    /// system. This is the crate's only IO.
    pub fn load(path: impl AsRef<Path>) -> Result<Hba, HbaError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| HbaError {
            origin: path.to_owned(),
            line: 0,
            message: format!("could not open configuration file: {e}"),
        })?;
        Hba::parse(&text, path, &|p| std::fs::read_to_string(p))
    }

    /// The rules, in file order.
    pub fn rules(&self) -> &[HbaRule] {
        &self.rules
    }

    /// Whether a rule names `samehost` or `samenet`, whose matching needs
    /// the server's own addresses ([`HbaContext::local_addrs`]).
    pub fn needs_local_addrs(&self) -> bool {
        self.rules.iter().any(|r| {
            matches!(
                r.address,
                Some(AddressSpec::SameHost | AddressSpec::SameNet)
            )
        })
    }

    /// The first rule matching `ctx`, as PostgreSQL's `check_hba` picks it.
    /// `None` means the connection is refused with [`no_match_message`].
    pub fn find(&self, ctx: &HbaContext<'_>) -> Option<&HbaRule> {
        let addr = ctx.addr.map(|a| a.to_canonical());
        let mut roles: Option<Vec<String>> = None;
        let mut member_of = |role: &str| {
            let roles = roles.get_or_insert_with(|| (ctx.roles_of_user)(ctx.user));
            (role == ctx.user && !roles.is_empty()) || roles.iter().any(|r| r == role)
        };
        self.rules
            .iter()
            .find(|rule| rule_matches(rule, ctx, addr, &mut member_of))
    }
}

/// PostgreSQL 15's message for a connection no rule matches (SQLSTATE 28000,
/// invalid_authorization_specification), from `ClientAuthentication`.
pub fn no_match_message(ctx: &HbaContext<'_>) -> String {
    let (host, enc) = (host_info(ctx), encryption_state(ctx));
    if ctx.physical_replication {
        format!(
            "no pg_hba.conf entry for replication connection from host \"{host}\", user \"{}\", {enc}",
            ctx.user
        )
    } else {
        format!(
            "no pg_hba.conf entry for host \"{host}\", user \"{}\", database \"{}\", {enc}",
            ctx.user, ctx.database
        )
    }
}

/// PostgreSQL 15's message for a connection matched by a `reject` rule
/// (SQLSTATE 28000, invalid_authorization_specification).
pub fn reject_message(ctx: &HbaContext<'_>) -> String {
    let (host, enc) = (host_info(ctx), encryption_state(ctx));
    if ctx.physical_replication {
        format!(
            "pg_hba.conf rejects replication connection for host \"{host}\", user \"{}\", {enc}",
            ctx.user
        )
    } else {
        format!(
            "pg_hba.conf rejects connection for host \"{host}\", user \"{}\", database \"{}\", {enc}",
            ctx.user, ctx.database
        )
    }
}

/// The client address as `getnameinfo(NI_NUMERICHOST)` prints it.
fn host_info(ctx: &HbaContext<'_>) -> String {
    match (ctx.conn_type, ctx.addr) {
        (ConnType::Local, _) => "[local]".into(),
        (ConnType::Host { .. }, Some(addr)) => addr.to_canonical().to_string(),
        // What PostgreSQL prints when it cannot format the address.
        (ConnType::Host { .. }, None) => "???".into(),
    }
}

fn encryption_state(ctx: &HbaContext<'_>) -> &'static str {
    match ctx.conn_type {
        ConnType::Host { ssl: true } => "SSL encryption",
        _ => "no encryption",
    }
}

fn rule_matches(
    rule: &HbaRule,
    ctx: &HbaContext<'_>,
    addr: Option<IpAddr>,
    member_of: &mut dyn FnMut(&str) -> bool,
) -> bool {
    let conn_ok = match (rule.conn_type, ctx.conn_type) {
        (RuleConnType::Local, ConnType::Local) => true,
        (RuleConnType::Local, _) | (_, ConnType::Local) => false,
        (RuleConnType::Host | RuleConnType::HostNoGssEnc, _) => true,
        (RuleConnType::HostSsl, ConnType::Host { ssl }) => ssl,
        (RuleConnType::HostNoSsl, ConnType::Host { ssl }) => !ssl,
        (RuleConnType::HostGssEnc, _) => false,
    };
    if !conn_ok {
        return false;
    }
    if let Some(spec) = rule.address {
        if !address_matches(spec, addr, ctx.local_addrs) {
            return false;
        }
    }
    let db_ok = rule.databases.iter().any(|spec| {
        if ctx.physical_replication {
            return *spec == DatabaseSpec::Replication;
        }
        match spec {
            DatabaseSpec::All => true,
            DatabaseSpec::SameUser => ctx.database == ctx.user,
            DatabaseSpec::SameRole => member_of(ctx.database),
            DatabaseSpec::Replication => false,
            DatabaseSpec::Name(name) => name == ctx.database,
        }
    });
    db_ok
        && rule.users.iter().any(|spec| match spec {
            UserSpec::All => true,
            UserSpec::Group(role) => member_of(role),
            UserSpec::Name(name) => name == ctx.user,
        })
}

fn address_matches(spec: AddressSpec, addr: Option<IpAddr>, local: &[(IpAddr, u8)]) -> bool {
    match spec {
        AddressSpec::All => true,
        AddressSpec::Net { addr: net, mask } => addr.is_some_and(|a| in_range(a, net, mask)),
        AddressSpec::SameHost => {
            addr.is_some_and(|a| local.iter().any(|&(l, _)| l.to_canonical() == a))
        }
        AddressSpec::SameNet => addr.is_some_and(|a| {
            local.iter().any(|&(l, prefix)| {
                let l = l.to_canonical();
                prefix_mask(l, prefix).is_some_and(|mask| in_range(a, l, mask))
            })
        }),
    }
}

/// `(a ^ net) & mask == 0`, for addresses of one family.
fn in_range(a: IpAddr, net: IpAddr, mask: IpAddr) -> bool {
    match (a, net, mask) {
        (IpAddr::V4(a), IpAddr::V4(n), IpAddr::V4(m)) => {
            (u32::from(a) ^ u32::from(n)) & u32::from(m) == 0
        }
        (IpAddr::V6(a), IpAddr::V6(n), IpAddr::V6(m)) => {
            (u128::from(a) ^ u128::from(n)) & u128::from(m) == 0
        }
        _ => false,
    }
}

/// The mask of a `prefix`-bit network in `family`'s address family, or
/// `None` if the prefix is too long for it.
fn prefix_mask(family: IpAddr, prefix: u8) -> Option<IpAddr> {
    match family {
        IpAddr::V4(_) => {
            let bits = u32::MAX.checked_shl(32 - u32::from(prefix.min(32)));
            (prefix <= 32).then(|| IpAddr::V4(Ipv4Addr::from(bits.unwrap_or(0))))
        }
        IpAddr::V6(_) => {
            let bits = u128::MAX.checked_shl(128 - u32::from(prefix.min(128)));
            (prefix <= 128).then(|| IpAddr::V6(Ipv6Addr::from(bits.unwrap_or(0))))
        }
    }
}

// ---------------------------------------------------------------------------
// Tokenizer

/// One token: its text with quotes removed, and whether it began with a
/// quote (which takes away any keyword meaning).
#[derive(Clone, Debug)]
struct Token {
    text: String,
    quoted: bool,
}

impl Token {
    fn is_keyword(&self, keyword: &str) -> bool {
        !self.quoted && self.text == keyword
    }
}

/// A logical line split into fields, each a comma-separated token list.
struct TokLine {
    line: usize,
    text: String,
    fields: Vec<Vec<Token>>,
}

/// PostgreSQL's `pg_isblank`.
fn is_blank(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\r')
}

/// Splits `text` into logical lines (joining backslash continuations, as
/// `tokenize_auth_file` does) and tokenizes them, expanding `@file`
/// references. Lines without fields are dropped.
fn tokenize(
    text: &str,
    origin: &Path,
    read: &dyn Fn(&Path) -> io::Result<String>,
    depth: usize,
) -> Result<Vec<TokLine>, HbaError> {
    let mut out = Vec::new();
    let mut physical = text.split('\n');
    let mut next_line = 1usize;
    while let Some(first) = physical.next() {
        let line = next_line;
        next_line += 1;
        let mut buf = first.trim_end_matches('\r').to_owned();
        // A continuation backslash must lie beyond the previous one, so an
        // empty line after a continuation ends the record.
        let mut last_backslash = 0;
        while buf.len() > last_backslash && buf.ends_with('\\') {
            buf.pop();
            last_backslash = buf.len();
            let Some(more) = physical.next() else { break };
            next_line += 1;
            buf.push_str(more.trim_end_matches('\r'));
        }

        let mut cursor = Cursor {
            s: buf.as_bytes(),
            pos: 0,
        };
        let mut fields = Vec::new();
        while !cursor.at_end() {
            let field = next_field(&mut cursor, origin, line, read, depth)?;
            if !field.is_empty() {
                fields.push(field);
            }
        }
        if !fields.is_empty() {
            out.push(TokLine {
                line,
                text: buf.trim().to_owned(),
                fields,
            });
        }
    }
    Ok(out)
}

struct Cursor<'a> {
    s: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn at_end(&self) -> bool {
        self.pos >= self.s.len()
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    /// PostgreSQL's `next_token`: the next token and whether a comma ended
    /// it, or `None` at the end of the line or at a comment.
    fn next_token(&mut self) -> Option<(Token, bool)> {
        while self.peek().is_some_and(|c| is_blank(c) || c == b',') {
            self.pos += 1;
        }
        let mut buf = Vec::new();
        let (mut in_quote, mut was_quote, mut saw_quote) = (false, false, false);
        let (mut initial_quote, mut comma) = (false, false);
        while let Some(c) = self.peek() {
            if is_blank(c) && !in_quote {
                break;
            }
            if c == b'#' && !in_quote {
                self.pos = self.s.len();
                break;
            }
            if c == b',' && !in_quote {
                // Left in place: the next call skips it with the blanks.
                comma = true;
                break;
            }
            if c != b'"' || was_quote {
                buf.push(c);
            }
            // Two quotes inside quotes are a literal quote.
            was_quote = in_quote && c == b'"' && !was_quote;
            if c == b'"' {
                in_quote = !in_quote;
                saw_quote = true;
                if buf.is_empty() {
                    initial_quote = true;
                }
            }
            self.pos += 1;
        }
        if !saw_quote && buf.is_empty() {
            return None;
        }
        // Only ASCII quote bytes were dropped, so the UTF-8 is intact.
        let text = String::from_utf8_lossy(&buf).into_owned();
        Some((
            Token {
                text,
                quoted: initial_quote,
            },
            comma,
        ))
    }
}

/// PostgreSQL's `next_field_expand`: one field's tokens, with `@file`
/// references replaced by every token of the file.
fn next_field(
    cursor: &mut Cursor<'_>,
    origin: &Path,
    line: usize,
    read: &dyn Fn(&Path) -> io::Result<String>,
    depth: usize,
) -> Result<Vec<Token>, HbaError> {
    let mut tokens = Vec::new();
    while let Some((token, comma)) = cursor.next_token() {
        match token.text.strip_prefix('@') {
            Some(file) if !token.quoted && !file.is_empty() => {
                tokens.extend(include(file, origin, line, read, depth)?);
            }
            _ => tokens.push(token),
        }
        if !comma {
            break;
        }
    }
    Ok(tokens)
}

fn include(
    file: &str,
    origin: &Path,
    line: usize,
    read: &dyn Fn(&Path) -> io::Result<String>,
    depth: usize,
) -> Result<Vec<Token>, HbaError> {
    let path = match origin.parent() {
        Some(dir) => dir.join(file),
        None => PathBuf::from(file),
    };
    let err = |message: String| HbaError {
        origin: origin.to_owned(),
        line,
        message,
    };
    if depth + 1 > MAX_INCLUDE_DEPTH {
        return Err(err(format!(
            "could not open file \"{}\": maximum nesting depth exceeded",
            path.display()
        )));
    }
    let text = read(&path).map_err(|e| {
        err(format!(
            "could not open secondary authentication file \"@{file}\" as \"{}\": {e}",
            path.display()
        ))
    })?;
    Ok(tokenize(&text, &path, read, depth + 1)?
        .into_iter()
        .flat_map(|l| l.fields)
        .flatten()
        .collect())
}

// ---------------------------------------------------------------------------
// Line parser

/// Options that exist in PostgreSQL 15 but only for methods pgwarden does
/// not implement.
const FOREIGN_OPTIONS: &[&str] = &[
    "pamservice",
    "pam_use_hostname",
    "ldapurl",
    "ldaptls",
    "ldapscheme",
    "ldapserver",
    "ldapport",
    "ldapbinddn",
    "ldapbindpasswd",
    "ldapsearchattribute",
    "ldapsearchfilter",
    "ldapbasedn",
    "ldapprefix",
    "ldapsuffix",
    "krb_realm",
    "include_realm",
    "compat_realm",
    "upn_username",
    "radiusservers",
    "radiussecrets",
    "radiusidentifiers",
    "radiusports",
];

/// Methods PostgreSQL 15 knows that pgwarden does not implement.
const FOREIGN_METHODS: &[&str] = &["ident", "gss", "sspi", "pam", "bsd", "ldap", "radius"];

/// PostgreSQL's `parse_hba_line`, restricted to what pgwarden supports.
fn parse_line(tok: TokLine, origin: &Path) -> Result<HbaRule, HbaError> {
    let line = tok.line;
    let err = |message: String| HbaError {
        origin: origin.to_owned(),
        line,
        message,
    };
    let mut fields = tok.fields.into_iter();

    let conn_field = fields.next().unwrap_or_default();
    let conn = single(&conn_field, || {
        err("multiple values specified for connection type".into())
    })?
    .ok_or_else(|| err("missing connection type".into()))?;
    let conn_type = match conn.text.as_str() {
        "local" => RuleConnType::Local,
        "host" => RuleConnType::Host,
        "hostssl" => RuleConnType::HostSsl,
        "hostnossl" => RuleConnType::HostNoSsl,
        "hostgssenc" => RuleConnType::HostGssEnc,
        "hostnogssenc" => RuleConnType::HostNoGssEnc,
        other => return Err(err(format!("invalid connection type \"{other}\""))),
    };

    let databases = fields
        .next()
        .ok_or_else(|| err("end-of-line before database specification".into()))?
        .into_iter()
        .map(|t| {
            reject_regex(&t, "database").map_err(&err)?;
            Ok(if t.is_keyword("all") {
                DatabaseSpec::All
            } else if t.is_keyword("sameuser") {
                DatabaseSpec::SameUser
            } else if t.is_keyword("samerole") || t.is_keyword("samegroup") {
                DatabaseSpec::SameRole
            } else if t.is_keyword("replication") {
                DatabaseSpec::Replication
            } else {
                DatabaseSpec::Name(t.text)
            })
        })
        .collect::<Result<Vec<_>, HbaError>>()?;

    let users = fields
        .next()
        .ok_or_else(|| err("end-of-line before role specification".into()))?
        .into_iter()
        .map(|t| {
            reject_regex(&t, "role").map_err(&err)?;
            Ok(if t.is_keyword("all") {
                UserSpec::All
            } else if let Some(group) = t.text.strip_prefix('+').filter(|_| !t.quoted) {
                UserSpec::Group(group.to_owned())
            } else {
                UserSpec::Name(t.text)
            })
        })
        .collect::<Result<Vec<_>, HbaError>>()?;

    let address = if conn_type == RuleConnType::Local {
        None
    } else {
        let field = fields
            .next()
            .ok_or_else(|| err("end-of-line before IP address specification".into()))?;
        let token = single(&field, || {
            err("multiple values specified for host address".into())
        })?
        .ok_or_else(|| err("end-of-line before IP address specification".into()))?;
        Some(parse_address(token, &mut fields).map_err(&err)?)
    };

    let method_field = fields
        .next()
        .ok_or_else(|| err("end-of-line before authentication method".into()))?;
    let method_token = single(&method_field, || {
        err("multiple values specified for authentication type".into())
    })?
    .ok_or_else(|| err("end-of-line before authentication method".into()))?;
    // Methods are compared as plain strings: quoting does not matter.
    let method = match method_token.text.as_str() {
        "trust" => AuthMethod::Trust,
        "reject" => AuthMethod::Reject,
        "password" => AuthMethod::Password,
        "md5" => AuthMethod::Md5,
        "scram-sha-256" => AuthMethod::ScramSha256,
        "cert" => AuthMethod::Cert,
        "peer" => AuthMethod::Peer,
        other if FOREIGN_METHODS.contains(&other) => {
            return Err(err(format!(
                "unsupported authentication method \"{other}\""
            )))
        }
        other => return Err(err(format!("invalid authentication method \"{other}\""))),
    };
    if method == AuthMethod::Cert && conn_type != RuleConnType::HostSsl {
        return Err(err(
            "cert authentication is only supported on hostssl connections".into(),
        ));
    }
    // PostgreSQL's words: the kernel knows the peer only on a local socket.
    if method == AuthMethod::Peer && conn_type != RuleConnType::Local {
        return Err(err(
            "peer authentication is only supported on local sockets".into(),
        ));
    }

    let mut client_cert = None;
    for token in fields.flatten() {
        let Some((name, value)) = token.text.split_once('=') else {
            return Err(err(format!(
                "authentication option not in name=value format: {}",
                token.text
            )));
        };
        match name {
            "clientcert" => {
                if conn_type != RuleConnType::HostSsl {
                    return Err(err(
                        "clientcert can only be configured for \"hostssl\" rows".into()
                    ));
                }
                client_cert = Some(match value {
                    "verify-full" => ClientCert::VerifyFull,
                    "verify-ca" if method == AuthMethod::Cert => {
                        return Err(err("clientcert can only be set to \"verify-full\" when using \"cert\" authentication".into()));
                    }
                    "verify-ca" => ClientCert::VerifyCa,
                    _ => return Err(err(format!("invalid value for clientcert: \"{value}\""))),
                });
            }
            "clientname" => {
                if conn_type != RuleConnType::HostSsl {
                    return Err(err(
                        "clientname can only be configured for \"hostssl\" rows".into()
                    ));
                }
                match value {
                    // The common name is what is compared anyway.
                    "CN" => {}
                    // PostgreSQL prints the subject with OpenSSL's RFC 2253
                    // formatter; a look-alike that differs in an escape would
                    // silently refuse or admit the wrong certificates.
                    "DN" => {
                        return Err(err(
                            "unsupported value for clientname: \"DN\": only the common name (CN) is compared with the user name".into(),
                        ))
                    }
                    _ => return Err(err(format!("invalid value for clientname: \"{value}\""))),
                }
            }
            "map" => {
                return Err(err(
                    "unsupported authentication option \"map\": user name maps are not supported"
                        .into(),
                ))
            }
            _ if FOREIGN_OPTIONS.contains(&name) => {
                return Err(err(format!(
                    "unsupported authentication option \"{name}\": it belongs to an unsupported authentication method"
                )))
            }
            _ => {
                return Err(err(format!(
                    "unrecognized authentication option name: \"{name}\""
                )))
            }
        }
    }
    if method == AuthMethod::Cert {
        // The cert method always checks the certificate fully.
        client_cert = Some(ClientCert::VerifyFull);
    }

    Ok(HbaRule {
        line,
        text: tok.text,
        conn_type,
        databases,
        users,
        address,
        method,
        client_cert,
    })
}

/// The field's only token; `multiple` builds the error for a list.
fn single(
    field: &[Token],
    multiple: impl FnOnce() -> HbaError,
) -> Result<Option<&Token>, HbaError> {
    match field {
        [] => Ok(None),
        [t] => Ok(Some(t)),
        _ => Err(multiple()),
    }
}

/// PostgreSQL 16 reads `/...` as a regular expression; taking it as a
/// literal name, as PostgreSQL 15 does, would silently match nothing.
fn reject_regex(t: &Token, what: &str) -> Result<(), String> {
    if t.text.starts_with('/') {
        return Err(format!(
            "regular expressions are not supported in {what} entries: \"{}\"",
            t.text
        ));
    }
    Ok(())
}

/// A CIDR prefix length the way `pg_sockaddr_cidr_mask` reads it with
/// `strtol`: an optional sign, then digits (so `+8` and `-0` are valid).
fn parse_prefix(bits: &str) -> Option<u8> {
    let (negative, digits) = match bits.as_bytes().first() {
        Some(b'+') => (false, bits.get(1..)?),
        Some(b'-') => (true, bits.get(1..)?),
        _ => (false, bits),
    };
    if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    // Long runs of digits overflow the parse and are rejected, as they are
    // out of range anyway.
    let value = digits.parse::<u8>().ok()?;
    (!negative || value == 0).then_some(value)
}

/// The address field (and, for a bare address, the mask field after it).
fn parse_address(
    token: &Token,
    fields: &mut impl Iterator<Item = Vec<Token>>,
) -> Result<AddressSpec, String> {
    if token.is_keyword("all") {
        return Ok(AddressSpec::All);
    }
    if token.is_keyword("samehost") {
        return Ok(AddressSpec::SameHost);
    }
    if token.is_keyword("samenet") {
        return Ok(AddressSpec::SameNet);
    }
    let text = token.text.as_str();
    let (host, cidr) = match text.split_once('/') {
        Some((host, bits)) => (host, Some(bits)),
        None => (text, None),
    };
    let Ok(addr) = host.parse::<IpAddr>() else {
        if cidr.is_some() {
            return Err(format!(
                "specifying both host name and CIDR mask is invalid: \"{text}\""
            ));
        }
        return Err(format!(
            "host names are not supported, only IP addresses: \"{text}\""
        ));
    };
    let mask = match cidr {
        Some(bits) => parse_prefix(bits)
            .and_then(|p| prefix_mask(addr, p))
            .ok_or_else(|| format!("invalid CIDR mask in address \"{text}\""))?,
        None => {
            let field = fields
                .next()
                .ok_or_else(|| "end-of-line before netmask specification".to_owned())?;
            let mask_token = match field.as_slice() {
                [t] => t,
                [] => return Err("end-of-line before netmask specification".into()),
                _ => return Err("multiple values specified for netmask".into()),
            };
            let mask = mask_token
                .text
                .parse::<IpAddr>()
                .map_err(|_| format!("invalid IP mask \"{}\"", mask_token.text))?;
            if mask.is_ipv4() != addr.is_ipv4() {
                return Err("IP address and mask do not match".into());
            }
            mask
        }
    };
    Ok(AddressSpec::Net { addr, mask })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn no_files(p: &Path) -> io::Result<String> {
        Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no such file: {}", p.display()),
        ))
    }

    fn parse(text: &str) -> Result<Hba, HbaError> {
        Hba::parse(text, Path::new("/etc/pg/pg_hba.conf"), &no_files)
    }

    fn parse_err(text: &str) -> HbaError {
        match parse(text) {
            Ok(hba) => panic!("parsed {text:?} as {:?}", hba.rules()),
            Err(e) => e,
        }
    }

    fn v4(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    fn host<'a>(db: &'a str, user: &'a str, addr: &str) -> HbaContext<'a> {
        HbaContext::new(ConnType::Host { ssl: false }, db, user, v4(addr))
    }

    fn ssl<'a>(db: &'a str, user: &'a str, addr: &str) -> HbaContext<'a> {
        HbaContext::new(ConnType::Host { ssl: true }, db, user, v4(addr))
    }

    fn local<'a>(db: &'a str, user: &'a str) -> HbaContext<'a> {
        HbaContext::new(ConnType::Local, db, user, None)
    }

    fn line_of(hba: &Hba, ctx: &HbaContext<'_>) -> Option<usize> {
        hba.find(ctx).map(|r| r.line)
    }

    #[test]
    fn every_field_kind() {
        let hba = parse(
            "# TYPE  DATABASE  USER  ADDRESS  METHOD\n\
             \n\
             local   all       postgres        trust\n\
             host    app       alice  10.0.0.0/8  scram-sha-256\n\
             hostssl app,other bob    192.168.1.0 255.255.255.0  md5  clientcert=verify-ca\n\
             hostnossl all     all    ::1/128  password   # trailing comment\n\
             hostssl all       carol  0.0.0.0/0  cert clientname=CN\n\
             host    all       all    all  reject\n",
        )
        .unwrap();
        let r = hba.rules();
        assert_eq!(r.len(), 6);
        assert_eq!(r[0].line, 3);
        assert_eq!(r[0].conn_type, RuleConnType::Local);
        assert_eq!(r[0].address, None);
        assert_eq!(r[0].users, vec![UserSpec::Name("postgres".into())]);
        assert_eq!(r[0].method, AuthMethod::Trust);
        assert_eq!(
            r[1].text,
            "host    app       alice  10.0.0.0/8  scram-sha-256"
        );
        assert_eq!(
            r[1].address,
            Some(AddressSpec::Net {
                addr: "10.0.0.0".parse().unwrap(),
                mask: "255.0.0.0".parse().unwrap()
            })
        );
        assert_eq!(r[1].method, AuthMethod::ScramSha256);
        assert_eq!(
            r[2].databases,
            vec![
                DatabaseSpec::Name("app".into()),
                DatabaseSpec::Name("other".into())
            ]
        );
        assert_eq!(r[2].client_cert, Some(ClientCert::VerifyCa));
        assert_eq!(r[2].method, AuthMethod::Md5);
        assert_eq!(r[3].conn_type, RuleConnType::HostNoSsl);
        assert_eq!(
            r[3].address,
            Some(AddressSpec::Net {
                addr: "::1".parse().unwrap(),
                mask: IpAddr::V6(Ipv6Addr::from(u128::MAX))
            })
        );
        assert_eq!(r[3].method, AuthMethod::Password);
        assert_eq!(r[4].method, AuthMethod::Cert);
        assert_eq!(r[4].client_cert, Some(ClientCert::VerifyFull));
        assert_eq!(r[5].address, Some(AddressSpec::All));
        assert_eq!(r[5].method, AuthMethod::Reject);
        assert_eq!(r[5].client_cert, None);

        assert_eq!(line_of(&hba, &local("x", "postgres")), Some(3));
        assert_eq!(line_of(&hba, &local("x", "alice")), None);
        assert_eq!(line_of(&hba, &host("app", "alice", "10.9.8.7")), Some(4));
        assert_eq!(line_of(&hba, &host("app", "alice", "11.0.0.1")), Some(8));
        assert_eq!(line_of(&hba, &ssl("other", "bob", "192.168.1.77")), Some(5));
        // hostssl does not match without SSL.
        assert_eq!(
            line_of(&hba, &host("other", "bob", "192.168.1.77")),
            Some(8)
        );
        let v6 = HbaContext::new(ConnType::Host { ssl: false }, "d", "u", v4("::1"));
        assert_eq!(line_of(&hba, &v6), Some(6));
        let v6_ssl = HbaContext::new(ConnType::Host { ssl: true }, "d", "u", v4("::1"));
        assert_eq!(line_of(&hba, &v6_ssl), Some(8));
        assert_eq!(line_of(&hba, &ssl("d", "carol", "1.2.3.4")), Some(7));
    }

    #[test]
    fn first_match_wins() {
        let hba = parse(
            "host all alice 127.0.0.1/32 reject\n\
             host all all   127.0.0.1/32 trust\n\
             host all alice 127.0.0.1/32 md5\n",
        )
        .unwrap();
        assert_eq!(line_of(&hba, &host("d", "alice", "127.0.0.1")), Some(1));
        assert_eq!(line_of(&hba, &host("d", "bob", "127.0.0.1")), Some(2));
        assert_eq!(line_of(&hba, &host("d", "bob", "127.0.0.2")), None);
        // Unix-socket connections never match host rules.
        assert_eq!(line_of(&hba, &local("d", "bob")), None);
    }

    #[test]
    fn quoting() {
        let hba = parse(
            "host \"all\" \"sameuser\" all trust\n\
             host \"my db\",\"a\"\"b\" \"+admins\" all md5\n\
             host all,\"replication\" \"all\" 1.2.3.4/32 password\n\
             \"host\" all all all \"reject\"\n",
        )
        .unwrap();
        let r = hba.rules();
        assert_eq!(r[0].databases, vec![DatabaseSpec::Name("all".into())]);
        assert_eq!(r[0].users, vec![UserSpec::Name("sameuser".into())]);
        assert_eq!(
            r[1].databases,
            vec![
                DatabaseSpec::Name("my db".into()),
                DatabaseSpec::Name("a\"b".into())
            ]
        );
        assert_eq!(r[1].users, vec![UserSpec::Name("+admins".into())]);
        assert_eq!(
            r[2].databases,
            vec![DatabaseSpec::All, DatabaseSpec::Name("replication".into())]
        );
        assert_eq!(r[2].users, vec![UserSpec::Name("all".into())]);
        // Connection type and method are plain strings: quotes do not matter.
        assert_eq!(r[3].conn_type, RuleConnType::Host);
        assert_eq!(r[3].method, AuthMethod::Reject);

        assert_eq!(line_of(&hba, &host("all", "sameuser", "9.9.9.9")), Some(1));
        assert_eq!(line_of(&hba, &host("d", "d", "9.9.9.9")), Some(4));
        assert_eq!(line_of(&hba, &host("my db", "+admins", "9.9.9.9")), Some(2));
        assert_eq!(line_of(&hba, &host("a\"b", "+admins", "9.9.9.9")), Some(2));
        assert_eq!(
            line_of(&hba, &host("replication", "all", "1.2.3.4")),
            Some(3)
        );
        assert_eq!(
            line_of(&hba, &host("replication", "bob", "1.2.3.4")),
            Some(4)
        );
    }

    #[test]
    fn token_and_field_separation() {
        // "a, b" is one field of two tokens; "a ,b" is two fields.
        let hba = parse("host a, b,,c u all trust\n").unwrap();
        assert_eq!(hba.rules()[0].databases.len(), 3);
        let e = parse_err("host a ,b u all trust\n");
        assert_eq!(
            e.message,
            "host names are not supported, only IP addresses: \"u\""
        );
        // A quote in the middle of a token does not make it quoted.
        let hba = parse("host a\"ll\" u all trust\n").unwrap();
        assert_eq!(hba.rules()[0].databases, vec![DatabaseSpec::All]);
        // A comment ends a list.
        let e = parse_err("host all all, # all trust\n");
        assert_eq!(e.message, "end-of-line before IP address specification");
        // A quoted '#' is text.
        let hba = parse("host \"a#b\" all all trust\n").unwrap();
        assert_eq!(
            hba.rules()[0].databases,
            vec![DatabaseSpec::Name("a#b".into())]
        );
    }

    #[test]
    fn continuation_lines() {
        let hba = parse(
            "# comment \\\n\
             swallowed by the comment\n\
             host all \\\n\
             all 10.0.0.0/8 \\\n\
             md5\r\n\
             local all all trust\n",
        )
        .unwrap();
        // The comment's backslash swallows the next line.
        assert_eq!(hba.rules().len(), 2);
        assert_eq!(hba.rules()[0].line, 3);
        assert_eq!(hba.rules()[0].method, AuthMethod::Md5);
        assert_eq!(hba.rules()[1].line, 6);
        // No space is inserted: "scram-\" + "sha-256".
        let hba = parse("local all all scram-\\\nsha-256").unwrap();
        assert_eq!(hba.rules()[0].method, AuthMethod::ScramSha256);
        // Trailing backslash at the end of the file.
        let hba = parse("local all all trust\\").unwrap();
        assert_eq!(hba.rules()[0].method, AuthMethod::Trust);
        // Errors report the first physical line.
        let e = parse_err("local all all trust\nhost all \\\nall \\\nall ldap\n");
        assert_eq!(e.line, 2);
    }

    #[test]
    fn file_includes() {
        let files: HashMap<PathBuf, &str> = [
            ("/etc/pg/dbs", "app1 app2\n# comment\n\"all\""),
            (
                "/etc/pg/sub/users",
                "alice,@more # nested, relative to sub/",
            ),
            ("/etc/pg/sub/more", "bob"),
            ("/abs/admins", "root"),
            ("/etc/pg/loop", "@loop"),
            ("/etc/pg/empty", "# nothing"),
        ]
        .into_iter()
        .map(|(p, t)| (PathBuf::from(p), t))
        .collect();
        let read = |p: &Path| {
            files
                .get(p)
                .map(|t| t.to_string())
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "not found"))
        };
        let origin = Path::new("/etc/pg/pg_hba.conf");
        let hba = Hba::parse(
            "host @dbs,extra @sub/users,@/abs/admins all md5\n\
             host \"@dbs\" all all trust\n",
            origin,
            &read,
        )
        .unwrap();
        let r = hba.rules();
        assert_eq!(
            r[0].databases,
            vec![
                DatabaseSpec::Name("app1".into()),
                DatabaseSpec::Name("app2".into()),
                DatabaseSpec::Name("all".into()),
                DatabaseSpec::Name("extra".into()),
            ]
        );
        assert_eq!(
            r[0].users,
            vec![
                UserSpec::Name("alice".into()),
                UserSpec::Name("bob".into()),
                UserSpec::Name("root".into()),
            ]
        );
        // A quoted @ is a name.
        assert_eq!(r[1].databases, vec![DatabaseSpec::Name("@dbs".into())]);
        assert_eq!(line_of(&hba, &host("app2", "bob", "1.1.1.1")), Some(1));
        assert_eq!(line_of(&hba, &host("other", "bob", "1.1.1.1")), None);

        let e = Hba::parse(
            "local all all trust\nlocal @missing all trust\n",
            origin,
            &read,
        )
        .unwrap_err();
        assert_eq!(e.origin, origin);
        assert_eq!(e.line, 2);
        assert!(e.message.starts_with(
            "could not open secondary authentication file \"@missing\" as \"/etc/pg/missing\": "
        ));
        assert!(e
            .to_string()
            .starts_with("/etc/pg/pg_hba.conf:2: could not open"));

        let e = Hba::parse("local @loop all trust\n", origin, &read).unwrap_err();
        assert!(e.message.contains("maximum nesting depth exceeded"), "{e}");
        assert_eq!(e.origin, Path::new("/etc/pg/loop"));

        // An include that yields nothing leaves no field behind, so the
        // fields after it move up (as in PostgreSQL).
        let e = Hba::parse("local @empty all trust\n", origin, &read).unwrap_err();
        assert_eq!(e.message, "end-of-line before authentication method");
        // A bare "@" is a name.
        let hba = Hba::parse("local @ all trust\n", origin, &read).unwrap();
        assert_eq!(
            hba.rules()[0].databases,
            vec![DatabaseSpec::Name("@".into())]
        );
    }

    #[test]
    fn address_and_mask() {
        let hba = parse(
            "host all all 10.1.2.3 255.255.0.0 trust\n\
             host all all 172.16.0.1 255.0.255.0 md5\n\
             host all all fe80:: ffff:ffff:ffff:ffff:: password\n\
             host all all 192.168.0.9/24 reject\n\
             host all all 0.0.0.0/-0 scram-sha-256\n\
             host all all 10.0.0.0/+8 scram-sha-256\n",
        )
        .unwrap();
        assert_eq!(line_of(&hba, &host("d", "u", "10.1.200.1")), Some(1));
        // Non-contiguous masks apply bit by bit.
        assert_eq!(line_of(&hba, &host("d", "u", "172.99.0.77")), Some(2));
        assert_eq!(line_of(&hba, &host("d", "u", "192.168.0.200")), Some(4));
        assert_eq!(line_of(&hba, &host("d", "u", "8.8.8.8")), Some(5));
        assert_eq!(line_of(&hba, &host("d", "u", "fe80::1234")), Some(3));
        assert_eq!(line_of(&hba, &host("d", "u", "fe81::1")), None);
        // Signed prefixes, as strtol reads them.
        assert_eq!(
            hba.rules()[5].address,
            Some(AddressSpec::Net {
                addr: "10.0.0.0".parse().unwrap(),
                mask: "255.0.0.0".parse().unwrap()
            })
        );
        // An IPv4-mapped IPv6 client is matched as IPv4.
        assert_eq!(line_of(&hba, &host("d", "u", "::ffff:10.1.0.1")), Some(1));
    }

    #[test]
    fn samehost_and_samenet() {
        let hba = parse(
            "host all all samehost trust\n\
             host all all samenet md5\n",
        )
        .unwrap();
        let locals: [(IpAddr, u8); 3] = [
            ("192.168.5.10".parse().unwrap(), 24),
            ("2001:db8::1".parse().unwrap(), 64),
            ("::ffff:127.0.0.1".parse().unwrap(), 8),
        ];
        let ctx = |addr: &str| HbaContext {
            local_addrs: &locals,
            ..host("d", "u", addr)
        };
        assert_eq!(line_of(&hba, &ctx("192.168.5.10")), Some(1));
        assert_eq!(line_of(&hba, &ctx("127.0.0.1")), Some(1));
        assert_eq!(line_of(&hba, &ctx("192.168.5.99")), Some(2));
        assert_eq!(line_of(&hba, &ctx("127.3.2.1")), Some(2));
        assert_eq!(line_of(&hba, &ctx("2001:db8::77")), Some(2));
        assert_eq!(line_of(&hba, &ctx("2001:db8:1::1")), None);
        assert_eq!(line_of(&hba, &ctx("192.168.6.1")), None);
        // Without local addresses nothing matches.
        assert_eq!(line_of(&hba, &host("d", "u", "192.168.5.10")), None);
        // A nonsensical prefix matches nothing rather than panicking.
        let odd: [(IpAddr, u8); 1] = [("10.0.0.1".parse().unwrap(), 200)];
        let ctx = HbaContext {
            local_addrs: &odd,
            ..host("d", "u", "10.0.0.2")
        };
        assert_eq!(line_of(&hba, &ctx), None);
    }

    #[test]
    fn groups_and_samerole() {
        let hba = parse(
            "local sameuser all password\n\
             local samerole all md5\n\
             local all +admins trust\n\
             local all \"+admins\" reject\n",
        )
        .unwrap();
        let calls = std::cell::Cell::new(0);
        let roles = |user: &str| {
            calls.set(calls.get() + 1);
            match user {
                "alice" => vec!["admins".to_owned(), "staff".to_owned()],
                _ => vec!["staff".to_owned()],
            }
        };
        let ctx = |db: &'static str, user: &'static str| HbaContext {
            roles_of_user: &roles,
            ..local(db, user)
        };
        assert_eq!(line_of(&hba, &ctx("bob", "bob")), Some(1));
        assert_eq!(line_of(&hba, &ctx("staff", "bob")), Some(2));
        assert_eq!(line_of(&hba, &ctx("app", "alice")), Some(3));
        assert_eq!(line_of(&hba, &ctx("app", "+admins")), Some(4));
        assert_eq!(line_of(&hba, &ctx("app", "bob")), None);
        // A role is a member of itself.
        assert_eq!(line_of(&hba, &ctx("app", "admins")), Some(3));
        // A role that does not exist is a member of nothing, not even of
        // the role of its own name.
        let none = |_: &str| Vec::new();
        let ghost = |db: &'static str, user: &'static str| HbaContext {
            roles_of_user: &none,
            ..local(db, user)
        };
        assert_eq!(line_of(&hba, &ghost("app", "admins")), None);
        // Memberships are looked up at most once per find.
        calls.set(0);
        hba.find(&ctx("app", "bob"));
        assert_eq!(calls.get(), 1);
        let hba = parse("local all all trust\n").unwrap();
        hba.find(&ctx("app", "bob"));
        assert_eq!(calls.get(), 1);
    }

    #[test]
    fn replication_keyword() {
        let hba = parse(
            "host replication repl 10.0.0.0/8 scram-sha-256\n\
             host all all 10.0.0.0/8 md5\n",
        )
        .unwrap();
        // A database named replication is a normal database.
        assert_eq!(
            line_of(&hba, &host("replication", "repl", "10.0.0.1")),
            Some(2)
        );
        assert_eq!(line_of(&hba, &host("app", "repl", "10.0.0.1")), Some(2));
        let walsender = HbaContext {
            physical_replication: true,
            ..host("app", "repl", "10.0.0.1")
        };
        assert_eq!(line_of(&hba, &walsender), Some(1));
        // `all` does not cover physical replication.
        let walsender = HbaContext {
            physical_replication: true,
            ..host("app", "other", "10.0.0.1")
        };
        assert_eq!(line_of(&hba, &walsender), None);
        assert_eq!(
            no_match_message(&walsender),
            "no pg_hba.conf entry for replication connection from host \"10.0.0.1\", user \"other\", no encryption"
        );
    }

    #[test]
    fn gssenc_rows() {
        let hba = parse(
            "hostgssenc all all all trust\n\
             hostnogssenc all all all md5\n",
        )
        .unwrap();
        assert_eq!(line_of(&hba, &host("d", "u", "1.1.1.1")), Some(2));
        assert_eq!(line_of(&hba, &ssl("d", "u", "1.1.1.1")), Some(2));
        assert_eq!(line_of(&hba, &local("d", "u")), None);
    }

    #[test]
    fn messages() {
        assert_eq!(
            no_match_message(&host("d", "u", "127.0.0.1")),
            "no pg_hba.conf entry for host \"127.0.0.1\", user \"u\", database \"d\", no encryption"
        );
        assert_eq!(
            no_match_message(&ssl("d", "u", "::ffff:10.0.0.1")),
            "no pg_hba.conf entry for host \"10.0.0.1\", user \"u\", database \"d\", SSL encryption"
        );
        assert_eq!(
            no_match_message(&HbaContext::new(
                ConnType::Host { ssl: true },
                "d",
                "u",
                v4("::1")
            )),
            "no pg_hba.conf entry for host \"::1\", user \"u\", database \"d\", SSL encryption"
        );
        assert_eq!(
            no_match_message(&local("d", "u")),
            "no pg_hba.conf entry for host \"[local]\", user \"u\", database \"d\", no encryption"
        );
        assert_eq!(
            reject_message(&host("d", "u", "10.1.1.1")),
            "pg_hba.conf rejects connection for host \"10.1.1.1\", user \"u\", database \"d\", no encryption"
        );
    }

    #[test]
    fn unsupported_methods_and_options() {
        for method in FOREIGN_METHODS {
            let e = parse_err(&format!(
                "local all all trust\n\nhost all all all {method}\n"
            ));
            assert_eq!(e.line, 3);
            assert_eq!(
                e.message,
                format!("unsupported authentication method \"{method}\"")
            );
        }
        let e = parse_err("# x\nlocal all all ldap ldapserver=x\n");
        assert_eq!(
            e.to_string(),
            "/etc/pg/pg_hba.conf:2: unsupported authentication method \"ldap\""
        );
        assert_eq!(
            parse_err("local all all crypt").message,
            "invalid authentication method \"crypt\""
        );
        // peer: local sockets only, and without a user name map.
        let hba = parse("local all postgres peer\nlocal all all peer\n").unwrap();
        assert_eq!(hba.rules()[0].method, AuthMethod::Peer);
        assert_eq!(
            parse_err("local all all trust\nhost all all all peer").to_string(),
            "/etc/pg/pg_hba.conf:2: peer authentication is only supported on local sockets"
        );
        assert_eq!(
            parse_err("local all all peer map=omicron").message,
            "unsupported authentication option \"map\": user name maps are not supported"
        );
        assert_eq!(
            parse_err("host all all all md5 map=m").message,
            "unsupported authentication option \"map\": user name maps are not supported"
        );
        assert!(parse_err("host all all all md5 ldapserver=x")
            .message
            .starts_with("unsupported authentication option \"ldapserver\""));
        assert_eq!(
            parse_err("host all all all md5 frob=1").message,
            "unrecognized authentication option name: \"frob\""
        );
        assert_eq!(
            parse_err("host all all all md5 clientcert").message,
            "authentication option not in name=value format: clientcert"
        );
        assert_eq!(
            parse_err("host all all all md5 clientcert=verify-full").message,
            "clientcert can only be configured for \"hostssl\" rows"
        );
        assert_eq!(
            parse_err("hostssl all all all md5 clientcert=1").message,
            "invalid value for clientcert: \"1\""
        );
        assert_eq!(
            parse_err("hostssl all all all cert clientcert=verify-ca").message,
            "clientcert can only be set to \"verify-full\" when using \"cert\" authentication"
        );
        assert_eq!(
            parse_err("host all all all cert").message,
            "cert authentication is only supported on hostssl connections"
        );
        assert_eq!(
            parse_err("host all all all md5 clientname=CN").message,
            "clientname can only be configured for \"hostssl\" rows"
        );
        assert_eq!(
            parse_err("hostssl all all all md5 clientname=cn").message,
            "invalid value for clientname: \"cn\""
        );
        assert!(parse_err("host /^db all all md5")
            .message
            .starts_with("regular expressions are not supported"));
        assert!(parse_err("host all \"/^u\" all md5")
            .message
            .starts_with("regular expressions are not supported"));
        // Options may be comma lists and span fields.
        let hba = parse("hostssl all all all md5 clientcert=verify-full,clientname=CN").unwrap();
        assert_eq!(hba.rules()[0].client_cert, Some(ClientCert::VerifyFull));
        assert_eq!(
            parse_err("hostssl all all all cert clientname=DN").message,
            "unsupported value for clientname: \"DN\": only the common name (CN) is compared with the user name"
        );
    }

    #[test]
    fn malformed_lines() {
        let cases: &[(&str, &str)] = &[
            ("local", "end-of-line before database specification"),
            ("local all", "end-of-line before role specification"),
            ("local all all", "end-of-line before authentication method"),
            (
                "host all all",
                "end-of-line before IP address specification",
            ),
            (
                "host all all 10.0.0.0/8",
                "end-of-line before authentication method",
            ),
            (
                "host all all 10.0.0.1",
                "end-of-line before netmask specification",
            ),
            ("host all all 10.0.0.1 md5", "invalid IP mask \"md5\""),
            (
                "host all all 10.0.0.1 ffff:: md5",
                "IP address and mask do not match",
            ),
            (
                "host all all 10.0.0.1 255.0.0.0,255.0.0.0 md5",
                "multiple values specified for netmask",
            ),
            (
                "host all all 10.0.0.0/33 md5",
                "invalid CIDR mask in address \"10.0.0.0/33\"",
            ),
            (
                "host all all ::/129 md5",
                "invalid CIDR mask in address \"::/129\"",
            ),
            (
                "host all all 10.0.0.0/ md5",
                "invalid CIDR mask in address \"10.0.0.0/\"",
            ),
            (
                "host all all 10.0.0.0/-1 md5",
                "invalid CIDR mask in address \"10.0.0.0/-1\"",
            ),
            (
                "host all all 10.0.0.0/++8 md5",
                "invalid CIDR mask in address \"10.0.0.0/++8\"",
            ),
            (
                "host all all 10.0.0.0/8x md5",
                "invalid CIDR mask in address \"10.0.0.0/8x\"",
            ),
            (
                "host all all 300.0.0.0/8 md5",
                "specifying both host name and CIDR mask is invalid: \"300.0.0.0/8\"",
            ),
            (
                "host all all db.example.com md5",
                "host names are not supported, only IP addresses: \"db.example.com\"",
            ),
            (
                "host all all \"all\" md5",
                "host names are not supported, only IP addresses: \"all\"",
            ),
            (
                "host all all 1.1.1.1/32,2.2.2.2/32 md5",
                "multiple values specified for host address",
            ),
            (
                "host,local all all all md5",
                "multiple values specified for connection type",
            ),
            ("hosts all all all md5", "invalid connection type \"hosts\""),
            ("include other.conf", "invalid connection type \"include\""),
            (
                "local all all md5,trust",
                "multiple values specified for authentication type",
            ),
        ];
        for (line, message) in cases {
            let e = parse_err(&format!("\n{line}\n"));
            assert_eq!(&e.message, message, "{line:?}");
            assert_eq!(e.line, 2, "{line:?}");
        }
        let e = parse_err("# only comments\n\n");
        assert_eq!(e.line, 0);
        assert_eq!(
            e.to_string(),
            "/etc/pg/pg_hba.conf: configuration file contains no entries"
        );
    }

    #[test]
    fn load_from_disk() {
        let dir = std::env::temp_dir().join(format!("pgwarden-auth-hba-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("users"), "alice bob").unwrap();
        std::fs::write(dir.join("pg_hba.conf"), "local all @users trust\n").unwrap();
        let hba = Hba::load(dir.join("pg_hba.conf")).unwrap();
        assert_eq!(hba.rules()[0].users.len(), 2);
        let e = Hba::load(dir.join("missing.conf")).unwrap_err();
        assert_eq!(e.line, 0);
        assert!(e.message.starts_with("could not open configuration file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
