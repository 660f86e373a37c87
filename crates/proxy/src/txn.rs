//! Transaction pooling: a client borrows a server connection for one
//! transaction at a time.
//!
//! Transaction ends come from ReadyForQuery's status byte: the server goes
//! back to its pool at `I` once every Query/Sync the client sent has been
//! answered and no extended-protocol batch is open. No reset round trip is
//! added per transaction.
//!
//! Named prepared statements follow the client from server to server: each
//! client's statements are recorded and prepared under a per-client name on
//! whatever server it lands on, on demand; the ParseComplete of such an
//! injected Parse is swallowed so the client sees exactly the replies it
//! expects.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use crate::stream::ClientStream;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use pgwarden_wire::effects::Effects;
use pgwarden_wire::encode;
use pgwarden_wire::message::{self, backend, frontend, TxStatus};
use pgwarden_wire::sqlstate::{self, SqlState};
use pgwarden_wire::startup::StartupMessage;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use crate::cancel::BackendKey;
use crate::pool::{Checkout, Extras, PoolKey, ServerError, Tracked};
use crate::proxy::{Kill, KillState, Service, SessionEntry, SessionGuard, Shared};
use pgwarden_wire::readonly_pipeline::{Admission, ReadOnlyPipeline};

/// Largest client message accepted (PostgreSQL's own limit is 1 GB).
const MAX_MESSAGE: usize = 1 << 30;

/// Largest client message of a type that carries no SQL or data
/// (PostgreSQL's `PQ_SMALL_MESSAGE_LIMIT`), header included.
const SMALL_MESSAGE: usize = 10_000 + 1;

struct Fatal {
    code: SqlState,
    message: String,
    /// A server's own ErrorResponse to relay instead.
    raw: Option<BytesMut>,
    /// pgwarden ended the session, for this reason.
    kill: Option<Kill>,
}

impl Fatal {
    fn new(code: SqlState, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            raw: None,
            kill: None,
        }
    }

    /// The session ends because pgwarden ended it.
    fn killed(self, kill: Kill) -> Self {
        Self {
            kill: Some(kill),
            ..self
        }
    }

    /// What the client is sent: the server's own ErrorResponse, or one
    /// built from the code and message.
    fn into_message(self) -> BytesMut {
        if let Some(raw) = self.raw {
            return raw;
        }
        encode::fatal(self.code.code(), &self.message)
    }
}

/// Where a server's replies to the current batch go.
#[derive(Default)]
struct Replies {
    /// Queries and Syncs sent whose ReadyForQuery has not come back.
    pending: usize,
    /// Parse messages sent and not yet answered, with the batch they
    /// belong to, so those skipped after an error are dropped at its Sync.
    parses: VecDeque<SentParse>,
    /// Close messages sent and not yet answered, tagged likewise.
    closes: VecDeque<SentClose>,
    /// Batches sent / completed (a batch ends with Query or Sync).
    sent: u64,
    done: u64,
    /// An extended-protocol batch is open (messages sent, no Sync yet).
    open_batch: bool,
    /// Last transaction status the server reported.
    status: Option<TxStatus>,
    /// `DEALLOCATE name` sent and not yet answered (see
    /// [`Session::deallocate`]).
    deallocs: Vec<SentDealloc>,
    /// The server sent a FATAL or PANIC error: its session is over, and
    /// the connection must never go back to the pool.
    fatal: bool,
    /// What each pending Query/Sync is, oldest in the lowest bit: 1 for a
    /// Query or FunctionCall, 0 for a Sync (past 64 pending, Syncs).
    kinds: u64,
    /// The server is taking COPY data (CopyInResponse came; the client
    /// has not ended the COPY). PostgreSQL ignores Syncs until then.
    copy_in: bool,
    /// The client ended a COPY (CopyDone/CopyFail) since the last
    /// ReadyForQuery, before the server said it was taking data.
    copy_ended: bool,
    /// Which pending Queries and FunctionCalls went out behind a batch
    /// marker ([`encode::batch_marker`]) not yet answered, in the bits of
    /// `kinds`. One still marked when a ReadyForQuery comes was skipped
    /// by the server, and gets none.
    marks: u64,
    /// A Query or FunctionCall went out inside an extended-protocol batch (no
    /// Sync before it), since the server was last idle. After an error there
    /// PostgreSQL ignores it, so its ReadyForQuery comes only once the client
    /// has sent the Sync that ends the extended batch (or never, past 64
    /// pending, where it has no marker).
    query_in_batch: bool,
    /// Parses and Closes sent so far, which numbers them in order.
    sent_statement_messages: u64,
}

/// A client's `DEALLOCATE name`, as sent: the statement is forgotten only
/// once the server confirms it dropped it, since a DEALLOCATE can fail (in
/// a failed transaction) and the statement then stays.
struct SentDealloc {
    /// The batch it was sent in (its simple Query, or the batch of the
    /// Execute that runs it).
    batch: u64,
    /// The client's name and the server-side name.
    name: String,
    sname: Arc<str>,
    /// The Query prepares a placeholder first, whose CommandComplete is
    /// swallowed.
    placeholder: bool,
    /// A placeholder is on the server under `sname` until the DEALLOCATE
    /// drops it: should the DEALLOCATE not run, the server holds a
    /// statement under a name pgwarden would prepare the client's there.
    stray: bool,
}

/// A Parse sent to the attached server.
struct SentParse {
    /// Injected by pgwarden: its ParseComplete is swallowed.
    injected: bool,
    /// The placeholder an extended-protocol `DEALLOCATE` of this
    /// server-side name is about to drop ([`Session::deallocating`]).
    placeholder: Option<Arc<str>>,
    /// The server-side name of a statement pgwarden follows; should the
    /// server skip the Parse, the statement is not there after all.
    name: Option<Arc<str>>,
    /// The client's own new statement: should the Parse fail or be
    /// skipped, the client has no such statement, as with PostgreSQL.
    forget: bool,
    /// For the unnamed statement, which of the client's unnamed Parses.
    unnamed_seq: u64,
    batch: u64,
    /// Order among the Parses and Closes sent ([`Replies::push_parse`]).
    seq: u64,
}

/// A client's statement as pgwarden follows it: its name on servers, the
/// Parse body after the name (kept to prepare it on other servers) and
/// what running it drops.
type Statement = (Arc<str>, Bytes, Drops);

/// What running a client's statement drops of its prepared statements.
#[derive(Clone, Default)]
enum Drops {
    #[default]
    Nothing,
    /// Every one: `DISCARD ALL`, `DEALLOCATE ALL` ([`Effects::drops`]);
    /// with whether it resets settings too (`DISCARD ALL`).
    Every { settings: bool },
    /// One: the statement is `DEALLOCATE name` of this statement of the
    /// client's, renamed when parsed to the server-side name it had then.
    One(Arc<Target>),
}

/// The client's statement an extended-protocol `DEALLOCATE` drops.
struct Target {
    name: String,
    sname: Arc<str>,
}

/// A Close sent to the attached server.
struct SentClose {
    /// A statement pgwarden closed to keep the server's cache bounded
    /// (or the unnamed one, `""`): its CloseComplete is swallowed; if the
    /// server skipped the Close, the statement is still there.
    own: Option<String>,
    /// The client's statement it closes, with whether it was prepared on
    /// this server: back in place should the server skip the Close.
    restore: Option<(String, Statement, bool)>,
    /// pgwarden's batch marker ([`encode::batch_marker`]; `own` is then
    /// `""`, for no statement).
    marker: bool,
    batch: u64,
    /// Order among the Parses and Closes sent ([`Replies::push_close`]).
    seq: u64,
}

impl Replies {
    /// Records a Parse sent, numbered after everything sent before it.
    fn push_parse(&mut self, mut p: SentParse) {
        self.sent_statement_messages += 1;
        p.seq = self.sent_statement_messages;
        self.parses.push_back(p);
    }

    /// Records a Close sent, numbered after everything sent before it.
    fn push_close(&mut self, mut c: SentClose) {
        self.sent_statement_messages += 1;
        c.seq = self.sent_statement_messages;
        self.closes.push_back(c);
    }

    /// Whether the server owes ReadyForQuery messages it will send
    /// without more input from the client: not inside an unfinished
    /// extended batch or a COPY FROM STDIN, which wait for the client.
    fn answers_owed(&self) -> bool {
        self.pending > 0 && !self.open_batch && !self.copy_in && !self.query_in_batch
    }

    fn idle(&self) -> bool {
        self.pending == 0
            && !self.open_batch
            && !self.copy_in
            && self.status == Some(TxStatus::Idle)
    }

    /// The server answered a COPY FROM STDIN with CopyInResponse.
    ///
    /// While it takes data, PostgreSQL ignores Sync messages (libpq sends
    /// one after the Execute of every extended-protocol statement, COPY
    /// included, and another after CopyDone), so the Syncs sent since
    /// the COPY began will get no ReadyForQuery. An extended-protocol COPY
    /// stays an open batch until the Sync after its CopyDone.
    fn copy_in_started(&mut self) {
        if self.copy_ended {
            // The client sent its data and CopyDone without waiting for
            // the server (no driver does): which Syncs were ignored is
            // not known, so none is forgotten. The server then stays with
            // the client, which is safe, instead of going back to the
            // pool with a ReadyForQuery still to come.
            return;
        }
        let query = self.pending > 0 && self.kinds & 1 == 1;
        // Their batches are over as far as Parse and Close replies go.
        self.done += (self.pending - usize::from(query)) as u64;
        self.pending = usize::from(query);
        self.kinds = u64::from(query);
        // A Query's COPY: its marker, if any, was answered.
        self.marks = 0;
        if !query {
            self.open_batch = true;
        }
        self.copy_in = true;
    }
}

/// Serves a logged-in client by transaction pooling until it leaves.
///
/// The future lives as long as the client, idle most of the time, so its
/// size is memory per client: the arguments come boxed (an async fn keeps
/// its arguments beside the locals they move into) and the session is
/// built outside it.
pub(crate) async fn run(
    shared: &Arc<Shared>,
    service: &Arc<Service>,
    client: &mut ClientStream,
    pooled: Box<crate::session::Pooled>,
    peer: std::net::SocketAddr,
) {
    let spec = &service.spec;
    let (mut session, mut early) = Session::new(shared, service, *pooled);

    // Boxed, and freed once the client is in: the login's states would
    // otherwise stay in the layout of the future every idle client keeps.
    let Some(key) = Box::pin(greet(shared, &mut session, client)).await else {
        return;
    };

    let killed = session.killed.clone();
    let registration = SessionGuard::register(
        shared,
        session.client_id,
        SessionEntry {
            service: service.name.clone(),
            user: session.user.clone(),
            database: session.database.clone(),
            client: peer,
            want: spec.want.clone(),
            host: None,
            pooled: Some(session.cancel_target.clone()),
            killed: killed.clone(),
            client_fd: client.raw_fd(),
            server_fd: None,
            connected_s: crate::proxy::unix_now_s(),
            tls: client.is_tls(),
            application_name: session.params.application_name(),
        },
    );
    let (from_client, to_client) = (
        service.handles.bytes_from_clients.clone(),
        service.handles.bytes_to_clients.clone(),
    );

    // The startup buffer is not needed once the client is idle.
    if early.is_empty() {
        crate::bufcache::release(&mut early);
    }
    let mut sbuf = BytesMut::new();
    let outcome: Result<(), Fatal> = async {
        let mut client_armed = false;
        // The client shut its sending side with replies still owed: the
        // server was shown the end of input too, and what it sends is
        // relayed until the replies are in or it closes.
        let mut input_ended = false;
        // Being told to end shows as the end of the client's input.
        let ended = |killed: &KillState| match killed.reason() {
            None => Ok(()),
            Some(Kill::HostDown) => Err(Fatal::new(
                sqlstate::CONNECTION_FAILURE,
                "terminating connection: its server is down",
            )
            .killed(Kill::HostDown)),
            Some(k) => {
                let why = match k {
                    Kill::Shutdown => "pgwarden is shutting down",
                    Kill::Admin => "administrator command",
                    Kill::HostRemoved => "its server was removed from pgwarden's configuration",
                    _ => "the server went away",
                };
                Err(Fatal::new(sqlstate::ADMIN_SHUTDOWN, format!("terminating connection: {why}")).killed(k))
            }
        };
        // A client that left while waiting may have left because it was
        // told to end: it is told why. (Mapped after the await, so that no
        // closure lives in every idle client's future.)
        if !early.is_empty() {
            // A Terminate among them ends the session as anywhere else.
            if session.client_bytes(&mut early, client).await
                .map_err(|f| ended(&killed).err().unwrap_or(f))?
                || session.answer_client(client).await.is_err()
            {
                return Ok(());
            }
        }
        loop {
            // Only a client between transactions can be idle; one that
            // holds a server inside a transaction, with every reply in, is
            // idle in transaction (and keeps that server from the others).
            // A pinned client holds its server between transactions too,
            // and is as idle as any other there.
            let between = session.attached.is_none()
                || ((session.settings.hold_session || session.pinned)
                    && session.replies.idle());
            let (idle_limit, in_transaction) = if between {
                (session.settings.client_idle_timeout, false)
            } else if session.attached.is_some()
                && session.replies.pending == 0
                && !session.replies.open_batch
                && matches!(session.replies.status, Some(TxStatus::InTransaction | TxStatus::Failed))
            {
                (session.settings.idle_transaction_timeout, true)
            } else {
                (None, false)
            };
            let watch_kill = session.unsent || session.held || input_ended;
            // Biased, in this order: a server's reply is the likeliest
            // event while attached, and stopping at the ready branch saves
            // polling the client socket (and registering its waker again)
            // on every reply; the idle timer matters only when nothing
            // else is ready.
            tokio::select! {
                biased;
                n = read_attached(&mut session.attached, &mut sbuf, &mut session.outbuf, &mut session.unsent) => {
                    // NOTHING_READ: sent what was left; the client may be
                    // read again, and messages held may go.
                    if !matches!(n, Ok(NOTHING_READ)) {
                        match n {
                            Ok(0) | Err(_) => {
                                session.detach(false);
                                if input_ended {
                                    return Ok(());
                                }
                                return Err(Fatal::new(sqlstate::CONNECTION_FAILURE, "terminating connection: the server closed the connection"));
                            }
                            Ok(_) => {}
                        }
                        let out = session.server_bytes(&mut sbuf)?;
                        let written = match &out {
                            ToClient::Prefix(n) => send_unless_killed(client, &sbuf[..*n], &killed).await.map(|()| *n),
                            ToClient::Owned(o) => send_unless_killed(client, o, &killed).await.map(|()| o.len()),
                        };
                        let Ok(written) = written else {
                            // The client is gone, or was told to end
                            // while it read nothing, perhaps in the middle
                            // of a message: it is told nothing more (see
                            // the end of the session).
                            session.skip = session.skip.max(1);
                            return ended(&killed);
                        };
                        to_client.inc_by(written as u64);
                        if let Some(c) = session.attached.as_mut() {
                            c.traffic.sent += written as u64;
                        }
                        if let ToClient::Prefix(n) = out {
                            sbuf.advance(n);
                        }
                        if session.replies.fatal {
                            // The client has the server's own reason; its
                            // session ends with the server's, as it would
                            // without pgwarden.
                            session.detach(false);
                            return Ok(());
                        }
                        if input_ended && !session.replies.answers_owed() {
                            // Its end of input was shown: never reused.
                            session.detach(false);
                            return Ok(());
                        }
                        if session.attached.is_some() && session.replies.idle() && !session.pinned && !session.settings.hold_session && sbuf.is_empty() && session.skip == 0 && !session.unsent {
                            session.detach(true);
                            crate::bufcache::release(&mut sbuf);
                        } else if !session.held_idle && (session.pinned || session.settings.hold_session) && session.attached.is_some() && session.replies.idle() {
                            // Its next message starts a transaction, which
                            // a pause holds as any other client's.
                            session.held_idle = true;
                            if let Some(c) = session.attached.as_mut() {
                                c.set_held(true);
                            }
                        }
                    }
                    // Not while bytes wait to go: the messages held would
                    // go out after a cut-off one.
                    if session.held
                        && !session.unsent
                        && !matches!(session.parse_wait, Some(b) if session.replies.done <= b)
                        && !session.read_only.as_deref().is_some_and(|p| p.awaiting_ready())
                    {
                        // The ReadyForQuery the held messages waited for.
                        session.parse_wait = None;
                        session.held = false;
                        // Inline, as below: a function's future would keep
                        // its arguments in every idle client's.
                        if session.client_bytes(&mut early, client).await
                .map_err(|f| ended(&killed).err().unwrap_or(f))?
                            || session.answer_client(client).await.is_err()
                        {
                            return Ok(());
                        }
                        if early.is_empty() {
                            crate::bufcache::release(&mut early);
                        }
                    }
                }
                // A session that reads nothing from its client would not
                // see the end of input that tells it to end. Boxed, as the
                // timer below: part of every idle client otherwise.
                () = async {
                    if watch_kill {
                        Box::pin(killed.told()).await
                    } else {
                        std::future::pending().await
                    }
                } => return ended(&killed),
                r = read_client(client, &mut early, &mut client_armed), if !session.unsent && !session.held && !input_ended => {
                    match r {
                        Ok(0) | Err(_) => {
                            // A client that shut only its sending side
                            // still reads (it cannot be told from one that
                            // closed until a write fails): what it sent is
                            // answered, as PostgreSQL answers it. Shown the
                            // end too, the server answers and closes, so
                            // the wait ends even when the replies owed
                            // cannot be counted exactly (after a COPY).
                            if matches!(r, Ok(0))
                                && killed.reason().is_none()
                                && session.replies.answers_owed()
                                && session.show_end_of_input().await
                            {
                                input_ended = true;
                                continue;
                            }
                            return ended(&killed);
                        }
                        Ok(n) => {
                            from_client.inc_by(n as u64);
                        }
                    }
                    if session.client_bytes(&mut early, client).await
                .map_err(|f| ended(&killed).err().unwrap_or(f))?
                        || session.answer_client(client).await.is_err()
                    {
                        return Ok(());
                    }
                    // Buffers exist only while bytes are in flight, so an
                    // idle client costs no more than its socket and task.
                    if early.is_empty() {
                        crate::bufcache::release(&mut early);
                    }
                }
                _ = async {
                    // Boxed: a timer is large, and most clients have none.
                    match idle_limit {
                        Some(d) => Box::pin(crate::timer::sleep(d)).await,
                        None => std::future::pending().await,
                    }
                } => {
                    if in_transaction {
                        // The server is mid-transaction: it is closed, which
                        // rolls the transaction back.
                        return Err(Fatal::new(sqlstate::IDLE_IN_TRANSACTION_SESSION_TIMEOUT, "terminating connection due to idle_transaction_timeout"));
                    }
                    return Err(Fatal::new(sqlstate::IDLE_SESSION_TIMEOUT, "terminating connection due to client_idle_timeout"));
                }
            }
        }
    }
    .await;
    // What is left unread goes nowhere now. The buffers go back to this
    // thread's list: a client that connects for one transaction would
    // otherwise cost a 16 KiB malloc and free for each of them.
    early.clear();
    crate::bufcache::release(&mut early);
    sbuf.clear();
    crate::bufcache::release(&mut sbuf);

    // Counted as a relayed session's end is: only when pgwarden's kill is
    // what ended it, by why.
    let kill = outcome.as_ref().err().and_then(|f| f.kill);
    // A client in the middle of a message the server began (or one whose
    // reply was cut off being written) cannot be told anything: an
    // ErrorResponse there would read as the rest of that message. Its
    // connection is just closed, as a server that dies mid-row closes it.
    if let (Err(f), 0) = (outcome, session.skip) {
        let out = f.into_message();
        let _ = crate::timer::timeout(Duration::from_secs(1), client.write_all(&out)).await;
    }
    if let Some(k) = kill {
        shared
            .metrics
            .sessions_terminated
            .get_or_create(&crate::metrics::ErrorLabel {
                service: spec.name.clone(),
                reason: format!("{k:?}"),
            })
            .inc();
    }
    drop(registration);
    drop(key);
    // TLS ends with close_notify; a plain socket's close sends the FIN a
    // shutdown would, one system call sooner.
    if client.is_tls() {
        let _ = crate::timer::timeout(crate::session::SHUTDOWN_WRITE, client.shutdown()).await;
    }
    // A server mid-transaction cannot be handed to someone else; one that
    // carried a whole session must be reset first (after the client is
    // let go, which need not wait for it).
    let reusable = if session.end_shown {
        false
    } else if session.settings.hold_session {
        session.replies.idle() && !session.loaded && session.reset().await
    } else {
        session.replies.idle() && !session.pinned
    };
    session.detach(reusable);
}

/// Longest the messages a client sent before its Terminate may take to
/// reach the server.
const TERMINATE_FLUSH: Duration = Duration::from_secs(60);

/// Whether `ahead`, what the client sent after the message being handled,
/// holds a Terminate among its complete messages. Bounded: a longer
/// pipeline is not searched to its end.
fn terminate_ahead(mut ahead: &[u8]) -> bool {
    for _ in 0..1024 {
        let Some(head) = ahead.get(..5) else {
            return false;
        };
        if head[0] == frontend::TERMINATE {
            return true;
        }
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        match ahead.get(len.max(4) + 1..) {
            Some(rest) => ahead = rest,
            None => return false,
        }
    }
    false
}

/// Sends the server's replies to the client; gives up (with an error) when
/// the session is told to end meanwhile. A kill shuts the read side of the
/// client's socket, which wakes no write: a client that stopped reading
/// would otherwise hold its session, and the server lent to it, past an
/// administrator's KILL, a shutdown or its host going down. The wait is
/// boxed, off the common path of a plain socket that takes the reply at
/// once (a TLS client's replies all take it), and out of every client's
/// future.
async fn send_unless_killed(
    client: &mut ClientStream,
    buf: &[u8],
    killed: &KillState,
) -> std::io::Result<()> {
    let n = client.try_send(buf)?;
    if n == buf.len() {
        return Ok(());
    }
    Box::pin(async move {
        tokio::select! {
            biased;
            () = killed.told() => Err(std::io::ErrorKind::Interrupted.into()),
            r = client.send_rest(&buf[n..]) => r,
        }
    })
    .await
}

/// A waiting client closed its connection (or was killed): its statement
/// is dropped with the session.
fn client_gone() -> Fatal {
    Fatal::new(
        sqlstate::CONNECTION_FAILURE,
        "terminating connection: the client went away while waiting",
    )
}

/// Logs a pooled client in: borrows a server once to learn its parameters
/// (and whether the database and role exist), applies the client's
/// start-up settings there, sends the greeting and gives the server back
/// (session pooling keeps it). The client's cancel key, or `None` when
/// the client has been told why not.
async fn greet<'a>(
    shared: &'a Arc<Shared>,
    session: &mut Session,
    client: &mut ClientStream,
) -> Option<KeyHeld<'a>> {
    // No cancel key is out yet, so nothing can cancel this wait. The
    // client is no session yet either, which a shutdown would end: it
    // watches the shutdown itself.
    let mut ending = shared.ending_signal.subscribe();
    let acquired = tokio::select! {
        biased;
        _ = ending.wait_for(|e| *e) => Err(Fatal::new(
            sqlstate::ADMIN_SHUTDOWN,
            "terminating connection: pgwarden is shutting down",
        )),
        r = Box::pin(session.acquire(client)) => r,
    };
    let mut first = match acquired {
        Ok(Some(c)) => c,
        Ok(None) => return None,
        Err(f) => {
            let _ = client.write_all(&f.into_message()).await;
            return None;
        }
    };
    let registered = KeyHeld {
        cancel: &shared.cancel,
        key: shared
            .cancel
            .register_dynamic(session.cancel_target.clone()),
    };
    let key = registered.key;
    // Applied on the first server before the client is let in: a setting
    // PostgreSQL refuses refuses the login, as it would without pgwarden.
    // Bounded, and given up when the client goes: a server cut off while
    // idle answers nothing, and a client not yet in the session table is
    // reached by no host-down kill.
    // Most logins have nothing to apply: those skip the watch (a readiness
    // check of the client's socket, perhaps a peek, and a timer).
    let pending = first.conn.extras != session.extras
        || session
            .params
            .iter()
            .any(|(k, v)| first.conn.tracked.get(k) != Some(v));
    let applied = if !pending {
        Ok(())
    } else {
        let wait = session.settings.query_wait_timeout;
        let host = first.pool.key.host.clone();
        let work = session.apply_login_settings(&mut first);
        tokio::select! {
            biased;
            () = client.closed() => Err((client_gone(), false)),
            r = crate::timer::timeout(wait, work) => r.unwrap_or_else(|_| {
                Err((
                    Fatal::new(
                        sqlstate::CONNECTION_FAILURE,
                        format!(
                            "terminating connection: the server at {host} did not answer within query_wait_timeout"
                        ),
                    ),
                    false,
                ))
            }),
        }
    };
    if let Err((f, reusable)) = applied {
        first.release(reusable);
        let _ = client.write_all(&f.into_message()).await;
        return None;
    }
    // A role's or database's default encoding reaches the client through
    // the greeting, not through a ParameterStatus the session checks.
    if session.service.spec.read_only {
        if let Some(v) = crate::session::client_only_encoding_of(&first.conn.params) {
            let f = Fatal::new(
                sqlstate::READ_ONLY_SQL_TRANSACTION,
                format!("client_encoding {v} is not allowed on a read-only service"),
            );
            first.release(true);
            let _ = client.write_all(&f.into_message()).await;
            return None;
        }
    }
    let hello = hello(session, &mut first, key);
    if session.settings.hold_session {
        // Session pooling: the server that answered the login stays.
        if let Err(f) = Box::pin(session.attach_checkout(first, client)).await {
            let _ = client.write_all(&f.into_message()).await;
            session.detach(false);
            return None;
        }
        // Between transactions from the start: a pause does not wait for
        // a client that has run nothing yet, and holds its first
        // statement as any other.
        if let Some(c) = session.attached.as_mut() {
            c.traffic.settle();
            c.set_held(true);
        }
        session.held_idle = true;
    } else {
        first.release(true);
    }
    if client.send_all(&hello).await.is_err() {
        // Nothing ran on it.
        session.detach(true);
        return None;
    }
    Some(registered)
}

/// A pooled client's cancel key, taken out of the registry however its
/// session ends (a panic included): an entry left behind would stay for
/// good, pointing at a server the client no longer uses.
struct KeyHeld<'a> {
    cancel: &'a crate::cancel::CancelRegistry,
    key: (i32, i32),
}

impl Drop for KeyHeld<'_> {
    fn drop(&mut self) {
        self.cancel.remove(self.key);
    }
}

/// What a client gets on login: the server's parameters (the client's
/// own where it set them), its cancel key, ReadyForQuery.
fn hello(session: &mut Session, first: &mut Checkout, key: (i32, i32)) -> BytesMut {
    // What the client did not ask for is what a new session of its
    // database and role starts with, not what the last client of this
    // server set (a DateStyle that swaps days and months, say). The
    // server's own values only where the pool has yet to learn them.
    first.pool.adopt_baseline(&mut session.params);
    session.params.adopt_missing(&first.conn.tracked);
    if session.params == first.conn.tracked {
        // The usual case: the client asked for nothing the server does
        // not already have, and the server's greeting is cached.
        let block = first.conn.status_block();
        let mut hello = BytesMut::with_capacity(block.len() + 64);
        encode::authentication_ok(&mut hello);
        hello.extend_from_slice(block);
        encode::backend_key_data(&mut hello, key.0, key.1);
        encode::ready_for_query(&mut hello, TxStatus::Idle);
        return hello;
    }
    let room: usize = first
        .conn
        .params
        .iter()
        .map(|(k, v)| 7 + k.len() + v.len().max(64))
        .sum();
    let mut hello = BytesMut::with_capacity(room + 64);
    encode::authentication_ok(&mut hello);
    let mut server_params: Vec<(&String, &String)> = first.conn.params.iter().collect();
    server_params.sort();
    for (k, v) in server_params {
        let v = session.params.get(k).unwrap_or(v.as_str());
        encode::parameter_status(&mut hello, k, v);
    }
    // Only the tracked parameters are the client's; the rest belong to
    // the server and cost memory per idle client if copied.
    encode::backend_key_data(&mut hello, key.0, key.1);
    encode::ready_for_query(&mut hello, TxStatus::Idle);
    hello
}

async fn read_attached(
    attached: &mut Option<Checkout>,
    buf: &mut BytesMut,
    out: &mut BytesMut,
    unsent: &mut bool,
) -> std::io::Result<usize> {
    let Some(c) = attached else {
        return std::future::pending().await;
    };
    std::future::poll_fn(|cx| {
        if *unsent {
            // Bytes the server did not take at once (see `Session::flush`):
            // sent as it makes room, its replies read meanwhile. Done,
            // they count as a read of nothing new.
            loop {
                match tokio::io::AsyncWrite::poll_write(
                    std::pin::Pin::new(&mut c.conn.stream),
                    cx,
                    out,
                ) {
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()))
                    }
                    Poll::Ready(Ok(n)) => {
                        out.advance(n);
                        if out.is_empty() {
                            break;
                        }
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => break,
                }
            }
            if out.is_empty() {
                match tokio::io::AsyncWrite::poll_flush(std::pin::Pin::new(&mut c.conn.stream), cx)
                {
                    Poll::Ready(Ok(())) => {
                        out.clear();
                        *unsent = false;
                        return Poll::Ready(Ok(NOTHING_READ));
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {}
                }
            }
        }
        if c.read_armed && c.conn.stream.quiet() {
            return Poll::Pending;
        }
        let r = c.conn.stream.poll_read_some(cx, buf, 4096);
        c.read_armed = r.is_pending() && tokio::task::coop::has_budget_remaining();
        r
    })
    .await
}

/// What [`read_attached`] returns when it finished sending rather than
/// read: no read returns it (a read of nothing is the end of the stream).
const NOTHING_READ: usize = usize::MAX;

/// [`ClientStream::poll_read_some`], not polled again while the socket stays
/// quiet after a read that registered the task's waker with it (`armed`).
///
/// The session loop re-creates its branches after every event, and each
/// poll of a socket with nothing to read takes the lock of its waiter
/// list to register the same waker again: two of those per statement,
/// one per socket, saved here and in [`read_attached`]. A read that found
/// the task's budget spent registered nothing, so it does not arm (a
/// pending read gives back the budget it took: what is left after it is
/// what it found).
async fn read_client(
    client: &mut ClientStream,
    buf: &mut BytesMut,
    armed: &mut bool,
) -> std::io::Result<usize> {
    std::future::poll_fn(|cx| {
        if *armed && client.quiet() {
            return Poll::Pending;
        }
        let r = client.poll_read_some(cx, buf, 8 * 1024);
        *armed = r.is_pending() && tokio::task::coop::has_budget_remaining();
        r
    })
    .await
}

/// What [`Session::server_bytes`] passes on to the client.
enum ToClient {
    /// The first `n` bytes of the server buffer, as they are (the caller
    /// advances the buffer once they are written).
    Prefix(usize),
    /// Bytes rebuilt around a dropped message; the buffer is advanced.
    Owned(BytesMut),
}

struct Session {
    shared: Arc<Shared>,
    service: Arc<Service>,
    startup: StartupMessage,
    /// Shared with the session table's entry.
    database: Arc<str>,
    user: Arc<str>,
    client_id: u64,
    attached: Option<Checkout>,
    replies: Replies,
    /// The client's view of the tracked session parameters.
    params: Tracked,
    /// The client's named statements, by name.
    statements: HashMap<String, Statement>,
    /// What running the unnamed statement drops.
    unnamed_drops: Drops,
    /// The client's unnamed statement (the Parse body after the name),
    /// when it has one: bound in a later transaction, it is prepared
    /// again on whatever server that lands on. The buffer is reused.
    unnamed: Vec<u8>,
    unnamed_set: bool,
    /// The attached server's unnamed statement is the client's (or both
    /// have none): set by the client's unnamed Parse or Close in this
    /// loan, or by pgwarden preparing it again.
    unnamed_here: bool,
    /// An unnamed Parse or Close went out after other messages of its
    /// batch: an error before it makes the server skip it, which shows
    /// only at the batch's ReadyForQuery. Batches the client pipelined
    /// behind it must not take `unnamed_here` on trust (the server's
    /// unnamed statement could be another client's), so it is cleared at
    /// the batch's Sync.
    unnamed_uncertain: bool,
    /// Unnamed Parses so far.
    unnamed_seq: u64,
    /// The client used session state (LISTEN, session advisory locks,
    /// temporary tables, WITH HOLD cursors, session SET, SQL PREPARE): it
    /// keeps its server connection until it disconnects.
    pinned: bool,
    /// The client keeps its server (pinned, or session-pooled) and is
    /// between transactions; mirrored in `cancel_target` for pauses.
    held_idle: bool,
    /// The client had already sent a Terminate behind the statement that
    /// waits for a server: it pipelined the statement and ended its
    /// session, so the end of its input that follows is no sign it gave
    /// up on it, and the statement runs, as on a direct connection.
    ended_ahead: bool,
    /// The client ran `LOAD`: its server keeps the module, which a
    /// session pool's reset does not unload, so the server is closed
    /// rather than passed on.
    loaded: bool,
    cancel_target: Arc<crate::cancel::CancelSlot>,
    /// Set when the session is told to end (a KILL, a lost host, a
    /// shutdown). Its waits watch it besides the client's socket, which a
    /// kill shuts for reading but which still shows bytes sent before.
    killed: Arc<KillState>,
    /// Bytes of a server message still to pass through unexamined.
    skip: usize,
    /// This client's pool settings (service, database and user combined).
    settings: Arc<crate::pool::PoolSettings>,
    /// What the client proved, for opening server connections as its role.
    credential: crate::auth::Credential,
    /// Output buffer towards the server, kept while attached.
    outbuf: BytesMut,
    /// `outbuf` holds bytes the server has not taken yet: the session loop
    /// sends them as the socket allows, reading the server's replies
    /// meanwhile, and reads nothing more from the client until they are
    /// gone.
    unsent: bool,
    /// The pool of the last transaction: reused while it fits.
    last_pool: Option<Arc<crate::pool::Pool>>,
    /// The service's pause switch.
    paused: watch::Receiver<bool>,
    /// This service's wait histogram, resolved once.
    wait_histogram: crate::metrics::WaitHistogram,
    /// The timer of the client's waits for a server, kept once it has
    /// waited ([`crate::pool::Pool::checkout_timed`]).
    wait_timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// `DISCARD ALL` / `DEALLOCATE ALL` statements sent to the attached
    /// server ([`Session::forget_statements`]) whose CommandComplete has
    /// not come: until it does, an error may mean the server skipped one.
    discarding: u32,
    /// The attached server may hold statements pgwarden does not know of
    /// (an error followed a `DISCARD ALL`, a placeholder was not dropped):
    /// it is closed when let go, not given to another client.
    stray_statements: bool,
    /// The attached server was shown the end of the client's input (its
    /// write side shut): it must never serve anyone else.
    end_shown: bool,
    /// Portals of the attached server bound to a client's `DEALLOCATE`
    /// statement ([`Drops::One`]), with the batch of their Bind: the
    /// statement is forgotten when one of them runs.
    dealloc_portals: Vec<(u64, String, Arc<Target>)>,
    /// Named Parse messages so far, numbering server-side names.
    parses_named: u64,
    /// What pgwarden answers the client itself (a statement cancelled
    /// while waiting for a server), sent after the messages at hand.
    /// Boxed: rarely used, and part of every idle client otherwise.
    answers: Option<Box<BytesMut>>,
    /// The rest of a cancelled extended-protocol batch is skipped, as
    /// PostgreSQL skips a failed one, up to its Sync.
    skip_to_sync: bool,
    /// Start-up settings set on each server the client lands on.
    extras: Extras,
    /// On a read-only service: which client messages must wait for the
    /// server's ReadyForQuery, or are refused ([`ReadOnlyPipeline`]).
    /// Boxed, and only there.
    read_only: Option<Box<ReadOnlyPipeline>>,
    /// A message is held for [`Session::read_only`] or
    /// [`Session::parse_wait`]: the rest of the client's bytes wait with
    /// it, and nothing more is read from the client until the
    /// ReadyForQuery is in.
    held: bool,
    /// A Bind, Describe or Parse of a statement is held until this batch
    /// is answered: pgwarden's own Parse of the statement went in it, and an
    /// earlier error there makes the server skip it, which only its
    /// ReadyForQuery shows ([`Session::unanswered_parse`]).
    parse_wait: Option<u64>,
}

impl Session {
    /// The session of a client that just logged in, and the bytes it sent
    /// after its start-up.
    fn new(
        shared: &Arc<Shared>,
        service: &Arc<Service>,
        pooled: crate::session::Pooled,
    ) -> (Session, BytesMut) {
        let crate::session::Pooled {
            startup,
            early,
            settings,
            credential,
            extras,
        } = pooled;
        let params = Tracked::from_startup(&startup);
        let database = startup.database().unwrap_or_default();
        let user = startup.user().unwrap_or_default();
        // Most clients of a service are one application: its pool is
        // likely the last one used, and checked again at the first
        // transaction like any other.
        let last_pool = service
            .recent_pool
            .load_full()
            .filter(|p| p.key.database == database && p.key.user == user);
        let (database, user) = (Arc::from(database), Arc::from(user));
        let session = Session {
            shared: shared.clone(),
            service: service.clone(),
            database,
            user,
            // Only what opening a server connection reads stays.
            startup: crate::pool::server_defaults(startup),
            client_id: shared.next_session.fetch_add(1, Ordering::Relaxed),
            attached: None,
            replies: Replies::default(),
            params,
            statements: HashMap::new(),
            unnamed_drops: Drops::Nothing,
            unnamed: Vec::new(),
            unnamed_set: false,
            unnamed_here: false,
            unnamed_uncertain: false,
            unnamed_seq: 0,
            pinned: false,
            held_idle: false,
            ended_ahead: false,
            loaded: false,
            cancel_target: Arc::default(),
            killed: Arc::default(),
            skip: 0,
            settings,
            credential,
            last_pool,
            outbuf: BytesMut::new(),
            unsent: false,
            paused: service.handles.paused.clone(),
            wait_histogram: service.handles.pool_wait.clone(),
            wait_timer: None,
            discarding: 0,
            stray_statements: false,
            end_shown: false,
            dealloc_portals: Vec::new(),
            parses_named: 0,
            answers: None,
            skip_to_sync: false,
            extras,
            read_only: service.spec.read_only.then(Box::default),
            held: false,
            parse_wait: None,
        };
        (session, early)
    }

    /// The server-side name for a client's statement: unique per Parse, so
    /// that a name the client closes and prepares again never meets its
    /// old statement on a server the Close did not reach.
    fn server_name(&mut self, name: &str) -> String {
        self.parses_named += 1;
        format!("pgw{}_{}_{name}", self.client_id, self.parses_named)
    }

    /// The server-side name for a statement the client never prepared
    /// here: no statement has it (the `u` keeps it apart from
    /// [`Session::server_name`]'s), so the server answers as PostgreSQL
    /// would for an unknown name.
    fn untracked_name(&self, name: &str) -> String {
        format!("pgw{}u_{name}", self.client_id)
    }

    /// Picks a host and borrows a connection from its pool, waiting in
    /// line (and for a host to appear, and while the service is paused)
    /// up to `query_wait_timeout`.
    /// `None`: the client was cancelled while waiting (a CancelRequest).
    async fn acquire(&mut self, client: &ClientStream) -> Result<Option<Checkout>, Fatal> {
        if let Some(c) = self.try_idle() {
            return Ok(Some(c));
        }
        self.acquire_waiting(client).await
    }

    /// The common case, which costs no lock, allocation or timer: the host
    /// is the one of the last transaction, its pool still serves, the
    /// service is not paused and a connection is idle.
    fn try_idle(&mut self) -> Option<Checkout> {
        if let Some(pool) = &self.last_pool {
            let snap = self.shared.snapshot.load();
            // A peek: when this path cannot serve, the slow one picks, and
            // each transaction takes one turn of the round robin. Two turns
            // would send a client back to its last host every time.
            let selector = &self.service.selector;
            let peeked = selector
                .peek(&snap.topology, &self.service.spec.want)
                .ok()
                .filter(|p| snap.topology.hosts()[p.index].config.addr == pool.key.host);
            let serves = !pool.is_retired()
                && !self
                    .shared
                    .any_refusal
                    .load(std::sync::atomic::Ordering::Relaxed);
            if let (Some(peeked), true) = (peeked, serves) {
                if let Some(c) = pool.try_checkout() {
                    // Looked at once the server counts as lent: a pause
                    // set before that is seen here, and one set after it
                    // sees the server lent and waits for the transaction.
                    if *self.paused.borrow() {
                        c.release(true);
                        return None;
                    }
                    selector.advance(&self.service.spec.want, peeked);
                    self.wait_histogram.observe(Duration::ZERO);
                    c.pool.stats.wait.observe(Duration::ZERO);
                    return Some(c);
                }
            }
        }
        None
    }

    /// [`acquire`](Self::acquire) past [`try_idle`](Self::try_idle):
    /// waits for a server, or for a cancel request. A client that goes
    /// away meanwhile (or is killed) leaves the line at once: the
    /// statement it had sent must not run after it gave up.
    async fn acquire_waiting(&mut self, client: &ClientStream) -> Result<Option<Checkout>, Fatal> {
        // Boxed: the slow path's state is large and rare, and would
        // otherwise be part of every idle client's task.
        let slot = self.cancel_target.clone();
        let killed = self.killed.clone();
        slot.start_waiting();
        // Biased: a client gone is not served even when a server comes at
        // the same moment. A kill shows here too: it shuts the reading
        // side of the client's socket down, which reads as its end unless
        // the client had sent more (so it is watched as well).
        let got = tokio::select! {
            biased;
            () = client.closed(), if !self.ended_ahead => {
                slot.stop_waiting();
                return Err(client_gone());
            }
            () = killed.told() => {
                slot.stop_waiting();
                return Err(client_gone());
            }
            () = slot.cancelled() => None,
            r = Box::pin(self.acquire_slow()) => Some(r),
        };
        let cancelled = slot.stop_waiting();
        let Some(c) = got.transpose()? else {
            return Ok(None);
        };
        if cancelled {
            // Cancelled just as a server came: nothing was sent on it.
            c.release(true);
            return Ok(None);
        }
        self.last_pool = Some(c.pool.clone());
        Ok(Some(c))
    }

    async fn acquire_slow(&mut self) -> Result<Checkout, Fatal> {
        let spec = &self.service.spec;
        let settings = self.settings.clone();
        let deadline = tokio::time::Instant::now() + settings.query_wait_timeout;
        let mut changes = self.shared.changes.clone();
        let mut paused = self.paused.clone();
        let mut failed_rounds = 0u32;
        loop {
            if let Some(reason) = self.shared.refusal(&spec.name) {
                self.shared.metrics.error(&spec.name, "refused");
                return Err(Fatal::new(
                    sqlstate::CANNOT_CONNECT_NOW,
                    format!("service \"{}\": {reason}", spec.name),
                ));
            }
            let snap = self.shared.snapshot.load_full();
            let pick = self
                .service
                .selector
                .select(&snap.topology, &spec.want)
                .map(|i| &snap.topology.hosts()[i].config.addr);
            // Clients outnumbering servers wait here at every
            // transaction: the pool of the last one is found without
            // building its key or taking the pool table's lock.
            let reuse = match (&pick, &self.last_pool) {
                (Ok(h), Some(p)) if p.key.host == **h && !p.is_retired() => Some(p.clone()),
                _ => None,
            };
            let pool = match reuse {
                Some(p) => p,
                None => {
                    let host = match pick.cloned() {
                        Ok(h) => h,
                        Err(e) => {
                            tokio::select! {
                                r = changes.changed() => if r.is_err() { return Err(Fatal::new(sqlstate::CANNOT_CONNECT_NOW, e.to_string())) },
                                _ = crate::timer::sleep_until(deadline) => {
                                    self.shared.metrics.error(&spec.name, "no_host");
                                    return Err(Fatal::new(sqlstate::CANNOT_CONNECT_NOW, format!("service \"{}\": {e}", spec.name)));
                                }
                            }
                            continue;
                        }
                    };
                    let pool = self.shared.pool(
                        PoolKey {
                            host,
                            database: self.database.to_string(),
                            user: self.user.to_string(),
                            read_only: spec.read_only,
                        },
                        &self.service.name,
                        &settings,
                    );
                    self.service.recent_pool.store(Some(pool.clone()));
                    pool
                }
            };
            if *paused.borrow() {
                // Waiting for a server like any client the pool cannot
                // serve yet, and counted so (cl_waiting, the metric).
                let _waiting = pool.count_waiting();
                tokio::select! {
                    // The host is picked again once resumed.
                    _ = paused.wait_for(|p| !*p) => continue,
                    _ = crate::timer::sleep_until(deadline) => {
                        self.shared.metrics.error(&spec.name, "paused");
                        return Err(Fatal::new(sqlstate::CANNOT_CONNECT_NOW, format!("service \"{}\" is paused and did not resume within query_wait_timeout", spec.name)));
                    }
                }
            }
            let host = &pool.key.host;
            pool.set_credential(&self.credential);
            match pool
                .checkout_timed(&self.startup, deadline, &mut self.wait_timer)
                .await
            {
                Ok((c, waited)) => {
                    if *paused.borrow() {
                        // Paused while this client waited or its server
                        // was being opened: no new transaction starts
                        // until resumed, so the server goes back unused.
                        c.release(true);
                        continue;
                    }
                    self.wait_histogram.observe(waited);
                    pool.stats.wait.observe(waited);
                    return Ok(c);
                }
                Err(ServerError::Retired) => continue,
                Err(ServerError::Timeout) => {
                    self.shared.metrics.error(&spec.name, "query_wait_timeout");
                    return Err(Fatal::new(
                        sqlstate::CANNOT_CONNECT_NOW,
                        format!("query_wait_timeout: no server connection to {host} became free within {} ms", settings.query_wait_timeout.as_millis()),
                    ));
                }
                Err(ServerError::Limit(what)) => {
                    self.shared.metrics.error(&spec.name, "connection_limit");
                    return Err(Fatal::new(
                        sqlstate::TOO_MANY_CONNECTIONS,
                        format!(
                            "{what} reached: no server connection became free within {} ms",
                            settings.query_wait_timeout.as_millis()
                        ),
                    ));
                }
                Err(ServerError::Refused(raw)) => {
                    self.shared.forget_if_unused(&pool);
                    return Err(Fatal {
                        code: sqlstate::CONNECTION_FAILURE,
                        message: String::new(),
                        raw: Some(raw),
                        kill: None,
                    });
                }
                Err(ServerError::Failed(e) | ServerError::NotReady(e)) => {
                    if failed_rounds == 0 {
                        tracing::warn!(host = %host, error = %e, "pooled server connection failed");
                    } else {
                        tracing::debug!(host = %host, error = %e, "pooled server connection failed again");
                    }
                    self.shared.forget_if_unused(&pool);
                    // A topology change picks a host again at once; without
                    // one, the same host is tried again a little later (the
                    // probes still call it up: a restart, a refused
                    // connection), within the client's wait.
                    // The probes publish after every result, several
                    // times a round: only a change of the eligible hosts
                    // cuts the pause short, or every waiting client would
                    // hit the failing host several times a second. (Not
                    // `select`, which would take turns of the round robin.)
                    let retry =
                        tokio::time::Instant::now() + crate::timer::retry_pause(failed_rounds);
                    failed_rounds += 1;
                    let eligible = |shared: &Shared| {
                        self.service
                            .eligible_addrs(&shared.snapshot.load().topology)
                    };
                    let before = eligible(&self.shared);
                    loop {
                        tokio::select! {
                            r = changes.changed() => {
                                if r.is_err() {
                                    // No more changes (shutting down).
                                    crate::timer::sleep_until(retry.min(deadline)).await;
                                    break;
                                }
                                if eligible(&self.shared) != before {
                                    break;
                                }
                            }
                            _ = crate::timer::sleep_until(retry) => break,
                            _ = crate::timer::sleep_until(deadline) => {
                                self.shared.metrics.error(&spec.name, "server_connect");
                                return Err(Fatal::new(sqlstate::CONNECTION_FAILURE, format!("service \"{}\": {e}", spec.name)));
                            }
                        }
                    }
                }
            }
        }
    }

    /// Borrows a server if none is attached, and sets the client's session
    /// parameters on it where they differ. False: the client was cancelled
    /// while waiting for one.
    async fn attach(&mut self, client: &ClientStream) -> Result<bool, Fatal> {
        if let Some(c) = &self.attached {
            // Checked per message rather than watched: a client mid-way
            // through a transaction on a server that is no longer right
            // learns it at its next message; a lost server ends the
            // session anyway through its socket.
            if c.pool.is_retired() {
                return Err(Fatal::new(
                    sqlstate::ADMIN_SHUTDOWN,
                    "terminating connection: the server is no longer the right host for this service; reconnect",
                ));
            }
            if self.held_idle {
                // Boxed: rare, and would otherwise be part of every
                // client's future.
                return Box::pin(self.start_held_transaction(client)).await;
            }
            return Ok(true);
        }
        // An idle server whose session already matches the client's: no
        // wait and no statement to run, so nothing to await. Otherwise
        // boxed: waiting for a server is the largest state of the client's
        // future, which every idle client would carry; and the loan is
        // moved into the box in a scope that ends before the await, so
        // that it takes no room in this future either.
        let slow: std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<bool, Fatal>> + Send + '_>,
        > = match self.try_idle() {
            Some(c) if c.conn.tracked == self.params && c.conn.extras == self.extras => {
                self.bind(c);
                return Ok(true);
            }
            Some(c) => Box::pin(self.attach_checkout(c, client)),
            None => Box::pin(self.attach_new(client)),
        };
        slow.await
    }

    /// Marks whether the client's kept server is between transactions.
    fn set_held(&mut self, on: bool) {
        if let Some(c) = self.attached.as_mut() {
            c.set_held(on);
        }
    }

    /// A client that kept its server between transactions starts the next
    /// one: while its service is paused it waits for the resume (bounded
    /// by `query_wait_timeout`), as clients that need a server do.
    async fn start_held_transaction(&mut self, client: &ClientStream) -> Result<bool, Fatal> {
        // Marked busy before the pause is looked at: a pause that then
        // found it between transactions must not see it start one.
        self.set_held(false);
        if !*self.paused.borrow() {
            self.held_idle = false;
            return Ok(true);
        }
        self.set_held(true);
        let pool = self.attached.as_ref().expect("attached").pool.clone();
        let _waiting = pool.count_waiting();
        let deadline = tokio::time::Instant::now() + self.settings.query_wait_timeout;
        let mut paused = self.paused.clone();
        // A cancel request meanwhile cancels the statement that waits, as
        // for a client waiting for a server: sent on to the idle server,
        // it would be ignored, and the statement would run at the resume.
        let slot = self.cancel_target.clone();
        slot.start_waiting();
        let outcome = loop {
            tokio::select! {
                r = paused.wait_for(|p| !*p) => if r.is_err() {
                    // The switch is gone with its service: nothing to wait for.
                    break Ok(true);
                },
                _ = crate::timer::sleep_until(deadline) => {
                    self.shared.metrics.error(&self.service.spec.name, "paused");
                    break Err(Fatal::new(
                        sqlstate::CANNOT_CONNECT_NOW,
                        format!(
                            "service \"{}\" is paused and did not resume within query_wait_timeout",
                            self.service.spec.name
                        ),
                    ));
                }
                () = client.closed(), if !self.ended_ahead => break Err(client_gone()),
                () = self.killed.told() => break Err(client_gone()),
                () = slot.cancelled() => break Ok(false),
            }
            self.set_held(false);
            if !*self.paused.borrow() {
                break Ok(true);
            }
            self.set_held(true);
        };
        let cancelled = slot.stop_waiting();
        match outcome {
            Ok(true) if !cancelled => {
                self.held_idle = false;
                self.set_held(false);
                Ok(true)
            }
            // Cancelled, also just as the service resumed: nothing ran,
            // and the client is still between transactions.
            Ok(_) => {
                self.set_held(true);
                Ok(false)
            }
            Err(f) => Err(f),
        }
    }

    /// Borrows a server for the transaction that starts, waiting for one.
    async fn attach_new(&mut self, client: &ClientStream) -> Result<bool, Fatal> {
        let Some(c) = self.acquire_waiting(client).await? else {
            return Ok(false);
        };
        self.attach_checkout(c, client).await
    }

    /// The client was cancelled while waiting for a server for message
    /// `tag`: it gets what PostgreSQL answers a statement cancelled before
    /// it ran, and the statement never runs.
    fn cancelled_in_line(&mut self, tag: u8) {
        let error = |out: &mut BytesMut| {
            encode::error_response(
                out,
                encode::Severity::Error,
                sqlstate::QUERY_CANCELED.code(),
                "canceling statement due to user request",
                None,
                None,
            )
        };
        match tag {
            frontend::QUERY | frontend::FUNCTION_CALL => {
                error(self.answers());
                encode::ready_for_query(self.answers(), TxStatus::Idle);
            }
            frontend::SYNC => encode::ready_for_query(self.answers(), TxStatus::Idle),
            frontend::PARSE
            | frontend::BIND
            | frontend::DESCRIBE
            | frontend::EXECUTE
            | frontend::CLOSE => {
                error(self.answers());
                self.skip_to_sync = true;
            }
            // COPY messages outside a COPY: ignored, as PostgreSQL does.
            _ => {}
        }
    }

    /// Where pgwarden's own answers to the client go.
    fn answers(&mut self) -> &mut BytesMut {
        self.answers.get_or_insert_with(Box::default)
    }

    /// Sends the client what pgwarden answered itself.
    async fn answer_client(&mut self, client: &mut ClientStream) -> std::io::Result<()> {
        match self.answers.take() {
            Some(out) => client.send_all(&out).await,
            None => Ok(()),
        }
    }

    /// Makes `c` the client's server: its session parameters brought in
    /// line with the client's, cancel requests pointed at it. False when
    /// the client was cancelled while its parameters were being set: `c`
    /// went back to its pool, and the client's statement is not to run.
    async fn attach_checkout(
        &mut self,
        mut c: Checkout,
        client: &ClientStream,
    ) -> Result<bool, Fatal> {
        let mut sets = String::new();
        // Usually equal: one comparison of six short strings, no hashing.
        if c.conn.tracked != self.params {
            for (k, v) in self.params.iter() {
                if c.conn.tracked.get(k) != Some(v) {
                    sets.push_str(&crate::pool::set_parameter_sql(k, v));
                }
            }
        }
        // The client's statement waits for these round trips as it waits
        // for a server, and a cancel request meanwhile cancels it so: with
        // no backend attached yet, it would otherwise be lost, and the
        // statement would run after all.
        let slot = self.cancel_target.clone();
        let watched = !sets.is_empty() || c.conn.extras != self.extras;
        if !watched {
            // Nothing to set (a server found after a wait in line): no
            // round trip to watch over.
            self.bind(c);
            return Ok(true);
        }
        slot.start_waiting();
        // Bounded, and given up when the client goes (or is killed): a
        // server cut off while idle answers nothing, and with no backend
        // attached yet no host-down kill reaches this wait.
        let outcome = {
            let this = &*self;
            let work = async {
                if !sets.is_empty() {
                    if let Err(e) = sync_params(&mut c, &sets).await {
                        return Err((Fatal::new(sqlstate::CONNECTION_FAILURE, e), false));
                    }
                }
                this.apply_extras(&mut c).await
            };
            tokio::select! {
                biased;
                () = client.closed(), if !this.ended_ahead => Err((client_gone(), false)),
                () = this.killed.told() => Err((client_gone(), false)),
                r = crate::timer::timeout(this.settings.query_wait_timeout, work) => r.unwrap_or_else(|_| {
                    Err((
                        Fatal::new(
                            sqlstate::CONNECTION_FAILURE,
                            format!(
                                "terminating connection: the server at {} did not answer within query_wait_timeout",
                                c.pool.key.host
                            ),
                        ),
                        false,
                    ))
                }),
            }
        };
        if let Err((fatal, reusable)) = outcome {
            slot.stop_waiting();
            c.release(reusable);
            return Err(fatal);
        }
        if slot.stop_waiting() {
            c.release(true);
            return Ok(false);
        }
        self.bind(c);
        Ok(true)
    }

    /// Makes `c`, whose session matches the client's, the client's server.
    fn bind(&mut self, c: Checkout) {
        self.cancel_target.attach(BackendKey {
            server: c.conn.peer,
            pid: c.conn.backend_key.0,
            secret: crate::cancel::Secret::Four(c.conn.backend_key.1),
        });
        self.replies = Replies {
            status: Some(TxStatus::Idle),
            ..Replies::default()
        };
        self.skip = 0;
        // Another client's unnamed statement may be there.
        self.unnamed_here = false;
        self.unnamed_uncertain = false;
        self.dealloc_portals.clear();
        self.attached = Some(c);
    }

    /// Brings the start-up settings of `c` ([`Extras`]) in line with the
    /// client's. Err: what to tell the client, and whether `c` may go back
    /// to its pool (a refused setting changes nothing on the server: the
    /// statements run as one transaction).
    async fn apply_extras(&self, c: &mut Checkout) -> Result<(), (Fatal, bool)> {
        self.apply_settings(c, &self.extras).await
    }

    /// At login, on the first server: [`Session::apply_extras`], and the
    /// client's own values of the tracked parameters where the server's
    /// differ, in the same round trip. A value PostgreSQL refuses refuses
    /// the login, as PostgreSQL refuses it at start-up; one it takes is
    /// the client's as the server reports it (`German` becomes `German,
    /// DMY`), which is what PostgreSQL's greeting would report.
    async fn apply_login_settings(&mut self, c: &mut Checkout) -> Result<(), (Fatal, bool)> {
        let given: Vec<(String, String)> = self
            .params
            .iter()
            .filter(|(k, v)| c.conn.tracked.get(k) != Some(*v))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if given.is_empty() {
            return self.apply_extras(c).await;
        }
        let wanted = self.extras.with(given.iter().cloned());
        self.apply_settings(c, &wanted).await?;
        for (k, _) in &given {
            if let Some(v) = c.conn.tracked.get(k) {
                self.params.set(k, v);
            }
        }
        Ok(())
    }

    /// Brings the settings of `c` in line with `wanted`, which are this
    /// client's start-up settings and possibly more; `c` is then recorded
    /// as having the client's ([`Session::apply_extras`]).
    async fn apply_settings(&self, c: &mut Checkout, wanted: &Extras) -> Result<(), (Fatal, bool)> {
        let sql = wanted.sql_from(&c.conn.extras);
        if sql.is_empty() {
            return Ok(());
        }
        match run_on_server(c, &sql).await {
            Ok(None) => {
                c.conn.extras = self.extras.clone();
                Ok(())
            }
            Ok(Some((code, message))) => Err((
                // The server's own code (42704 for an unknown parameter).
                Fatal {
                    code: sqlstate::INVALID_PARAMETER_VALUE,
                    message: String::new(),
                    raw: Some(encode::fatal(&code, &message)),
                    kill: None,
                },
                true,
            )),
            Err(e) => Err((
                Fatal::new(
                    sqlstate::CONNECTION_FAILURE,
                    format!("terminating connection: {e}"),
                ),
                false,
            )),
        }
    }

    /// Resets the held server connection for the next client (session
    /// pooling): `DISCARD ALL` drops prepared statements, temporary tables,
    /// session settings, LISTENs and advisory locks. False when the server
    /// did not confirm in time: the connection is then closed instead.
    async fn reset(&mut self) -> bool {
        let Some(c) = self.attached.as_mut() else {
            return false;
        };
        if c.pool.is_retired() {
            return false;
        }
        let done = crate::timer::timeout(RESET_TIMEOUT, run_on_server(c, "DISCARD ALL")).await;
        match done {
            Ok(Ok(None)) => {
                c.conn.prepared.clear();
                // RESET ALL is part of it.
                c.conn.extras = Extras::default();
                true
            }
            Ok(Ok(Some((_, error)))) => {
                tracing::warn!(%error, "resetting a session's server connection failed; closing it");
                false
            }
            Ok(Err(_)) | Err(_) => false,
        }
    }

    fn detach(&mut self, reusable: bool) {
        // A server with bytes still to send is mid-message: never reused.
        let reusable = reusable && !std::mem::take(&mut self.unsent) && !self.end_shown;
        crate::bufcache::release(&mut self.outbuf);
        // A DISCARD ALL or DEALLOCATE ALL whose end never came (skipped
        // after an error, or bound and never run) may or may not have
        // dropped the statements pgwarden no longer lists there.
        let uncertain = std::mem::take(&mut self.stray_statements) || self.discarding > 0;
        self.discarding = 0;
        if let Some(c) = self.attached.take() {
            let reusable = reusable && !uncertain;
            self.cancel_target
                .detach(move |safe| c.release(reusable && safe));
        }
    }

    /// Shows the attached server the end of the client's input; false
    /// without a server, or when it could not be shown in time (a TLS
    /// close_notify the socket would not take).
    async fn show_end_of_input(&mut self) -> bool {
        let Some(c) = self.attached.as_mut() else {
            return false;
        };
        // Set before the attempt: a TLS stream that timed out has the
        // close_notify queued all the same.
        self.end_shown = true;
        matches!(
            crate::timer::timeout(crate::session::SHUTDOWN_WRITE, c.conn.stream.shutdown()).await,
            Ok(Ok(()))
        )
    }

    /// Handles every complete client message in `buf`; true = the client
    /// said goodbye (Terminate).
    async fn client_bytes(
        &mut self,
        buf: &mut BytesMut,
        client: &ClientStream,
    ) -> Result<bool, Fatal> {
        // Reused while the client holds a server, so a transaction does not
        // allocate its output; dropped with the server (idle clients hold
        // no buffers).
        let mut out = std::mem::take(&mut self.outbuf);
        out.clear();
        if out.capacity() == 0 {
            out = crate::bufcache::take();
        }
        let r = self.client_messages(buf, &mut out, client).await;
        if self.attached.is_some() {
            self.outbuf = out;
        } else {
            // Nothing in it can reach a server now (a Terminate, a
            // refused or failed transaction): the buffer goes back.
            out.clear();
            crate::bufcache::give(out);
        }
        r
    }

    async fn client_messages(
        &mut self,
        buf: &mut BytesMut,
        out: &mut BytesMut,
        client: &ClientStream,
    ) -> Result<bool, Fatal> {
        loop {
            // Messages are looked at where they lie and consumed with
            // `advance`: splitting them off would make the buffer shared
            // (an allocation per message) and keep it from being reused.
            let total = match message::peek_header(buf, MAX_MESSAGE) {
                Ok(Some(h)) => h.total_len(),
                Ok(None) => break,
                Err(e) => {
                    return Err(Fatal::new(
                        sqlstate::PROTOCOL_VIOLATION,
                        format!("invalid frontend message: {e}"),
                    ))
                }
            };
            let tag = buf[0];
            if !frontend_message(tag) {
                // As PostgreSQL answers it, and at once: forwarded, it
                // would end the server's session, which the pool would
                // then lend to the next client.
                return Err(Fatal::new(
                    sqlstate::PROTOCOL_VIOLATION,
                    format!("invalid frontend message type {tag}"),
                ));
            }
            // PostgreSQL's own limits: only messages that carry SQL or
            // data may be large. A longer header is refused at once rather
            // than believed.
            let large = matches!(
                tag,
                frontend::QUERY
                    | frontend::PARSE
                    | frontend::BIND
                    | frontend::FUNCTION_CALL
                    | frontend::COPY_DATA
            );
            if !large && total > SMALL_MESSAGE {
                return Err(Fatal::new(
                    sqlstate::PROTOCOL_VIOLATION,
                    format!(
                        "invalid message length {} for message type {}",
                        total - 1,
                        char::from(tag)
                    ),
                ));
            }
            if buf.len() < total {
                // Room grows with what has arrived (at most doubling), not
                // with what the header announces: a client that sends
                // only a header claiming a gigabyte must not get one.
                let want = (total - buf.len()).min(buf.len().max(64 * 1024));
                buf.reserve(want);
                break;
            }
            if tag == frontend::TERMINATE {
                // Bounded: nothing reads the server's replies any more, and
                // a server blocked writing them (a large result pipelined
                // before) would never take the rest.
                return match crate::timer::timeout(TERMINATE_FLUSH, self.flush(out, true)).await {
                    Ok(r) => r.map(|()| true),
                    Err(_) => Err(Fatal::new(
                        sqlstate::CONNECTION_FAILURE,
                        "terminating connection: the server did not take the messages sent before Terminate",
                    )),
                };
            }
            // pgwarden passes replies on as they come, so a Flush between
            // transactions has nothing to push; libpq's pipeline mode
            // sends one after each Sync, and it must not take a server.
            // COPY data after the server gave up on the COPY (an error,
            // the transaction over): PostgreSQL ignores it outside a COPY,
            // and it must not take a server either. Nor, from a client
            // that keeps its server between transactions (pinned, session
            // pooled), start a transaction that a pause would hold and a
            // switchover's drain wait for: its server has nothing to push
            // and no COPY open.
            if matches!(
                tag,
                frontend::FLUSH | frontend::COPY_DATA | frontend::COPY_DONE | frontend::COPY_FAIL
            ) && (self.attached.is_none() || self.held_idle)
            {
                buf.advance(total);
                continue;
            }
            if self.skip_to_sync {
                if tag == frontend::SYNC {
                    self.skip_to_sync = false;
                    encode::ready_for_query(self.answers(), TxStatus::Idle);
                }
                buf.advance(total);
                continue;
            }
            if let Some(pipeline) = self.read_only.as_deref() {
                if pipeline.admit(tag) == Admission::Wait {
                    self.held = true;
                    break;
                }
            }
            if !self.replies.parses.is_empty() || !self.replies.closes.is_empty() {
                if let Some(batch) = self.unanswered_parse(tag, &buf[5..total]) {
                    self.parse_wait = Some(batch);
                    self.held = true;
                    break;
                }
            }
            // Looked for only where the client may have to wait: at the
            // start of a transaction.
            self.ended_ahead =
                (self.attached.is_none() || self.held_idle) && terminate_ahead(&buf[total..]);
            if !self.attach(client).await? {
                self.cancelled_in_line(tag);
                buf.advance(total);
                continue;
            }
            self.translate(tag, &buf[..total], out)?;
            buf.advance(total);
        }
        self.flush(out, false).await?;
        Ok(false)
    }

    /// Sends `out` to the server. Without `wait`, what the socket does not
    /// take at once stays in `out` for the session loop ([`Session::unsent`]):
    /// a server whose replies are not read stops reading, so a long
    /// pipeline with large results would otherwise leave both sides
    /// waiting on each other, where the client alone (reading while it
    /// writes, as libpq does) would not.
    async fn flush(&mut self, out: &mut BytesMut, wait: bool) -> Result<(), Fatal> {
        if out.is_empty() {
            return Ok(());
        }
        let failed = |e: std::io::Error| {
            Fatal::new(
                sqlstate::CONNECTION_FAILURE,
                format!("terminating connection: server write failed: {e}"),
            )
        };
        let c = self.attached.as_mut().expect("attached before translating");
        c.traffic.received += out.len() as u64;
        c.traffic.sending();
        if wait {
            c.conn.stream.send_all(out).await.map_err(failed)?;
            out.clear();
            return Ok(());
        }
        let n = c.conn.stream.try_send(out).map_err(failed)?;
        if n == out.len() {
            out.clear();
        } else {
            out.advance(n);
            self.unsent = true;
        }
        Ok(())
    }

    /// Appends what to send to the server for one client message.
    fn translate(&mut self, tag: u8, msg: &[u8], out: &mut BytesMut) -> Result<(), Fatal> {
        if matches!(tag, frontend::QUERY | frontend::FUNCTION_CALL)
            && self.replies.open_batch
            && self.replies.pending < 64
        {
            // Skipped after an error earlier in the batch, it would leave
            // a ReadyForQuery owed forever, and the server with the client.
            encode::batch_marker(out);
            self.replies.push_close(SentClose {
                own: Some(String::new()),
                restore: None,
                marker: true,
                batch: self.replies.sent,
                seq: 0,
            });
            self.replies.marks |= 1 << self.replies.pending;
            if let Some(pipeline) = self.read_only.as_deref_mut() {
                pipeline.marker_sent();
            }
        }
        if let Some(pipeline) = self.read_only.as_deref_mut() {
            let name = &self.service.spec.name;
            if let Err(v) = pipeline.sent(tag, &msg[5..]) {
                // Mid-batch, with no statement to put in its place that
                // fails where it stands: the session ends, and its server
                // (mid-transaction) is closed.
                self.shared
                    .metrics
                    .read_only_refusals
                    .get_or_create(&crate::metrics::ServiceLabel {
                        service: name.clone(),
                    })
                    .inc();
                return Err(Fatal::new(
                    sqlstate::READ_ONLY_SQL_TRANSACTION,
                    format!("terminating connection: service \"{name}\" is read-only: {v}"),
                ));
            }
            let refused = if crate::session::guarded(tag) {
                crate::session::guard_message(name, tag, msg)
            } else {
                None
            };
            if let Some(replacement) = refused {
                self.shared
                    .metrics
                    .read_only_refusals
                    .get_or_create(&crate::metrics::ServiceLabel {
                        service: self.service.spec.name.clone(),
                    })
                    .inc();
                // The refusal goes through the same bookkeeping as the
                // message it replaces (a named Parse keeps its name; a
                // function call becomes a Query, answered alike).
                return self.forward(replacement[0], &replacement, out);
            }
        }
        self.forward(tag, msg, out)
    }

    fn forward(&mut self, tag: u8, msg: &[u8], out: &mut BytesMut) -> Result<(), Fatal> {
        let body = &msg[5..];
        if tag == frontend::CLOSE {
            // Every Close is answered by a CloseComplete, in order with
            // those of pgwarden's own.
            self.replies.push_close(SentClose {
                own: None,
                restore: None,
                marker: false,
                batch: self.replies.sent,
                seq: 0,
            });
        }
        match tag {
            frontend::QUERY => {
                // PostgreSQL drops the unnamed statement at a simple
                // Query, as a Close of it would: the client has none.
                self.unnamed_set = false;
                self.unnamed_here = true;
                self.unnamed_uncertain |= self.replies.open_batch;
                // Raw bytes: the client's encoding need not be UTF-8.
                let text = message::query_bytes(body).unwrap_or_default();
                let effects = Effects::of(text);
                if effects.pins || (effects.resets && !self.extras.is_empty()) {
                    self.pinned = true;
                }
                self.loaded |= effects.loads;
                if effects.drops {
                    self.forget_statements(effects.discards);
                }
                let rewritten = if effects.deallocate {
                    std::str::from_utf8(text)
                        .ok()
                        .and_then(|t| self.deallocate(t))
                } else {
                    None
                };
                if let Some(rewritten) = rewritten {
                    self.note_sent(tag);
                    encode::query(out, &rewritten);
                    return Ok(());
                }
            }
            frontend::PARSE => {
                if let Ok(p) = message::parse_message(body) {
                    let effects = Effects::of(p.query);
                    if effects.pins || (effects.resets && !self.extras.is_empty()) {
                        self.pinned = true;
                    }
                    self.loaded |= effects.loads;
                    // Forgotten when run, not here: the Bind may come in a
                    // later batch, on another server.
                    let mut drops = if effects.drops {
                        Drops::Every {
                            settings: effects.discards,
                        }
                    } else {
                        Drops::Nothing
                    };
                    // A name that is not UTF-8 is passed on as it is, not
                    // followed from server to server.
                    let named = std::str::from_utf8(p.name).ok().filter(|n| !n.is_empty());
                    let mut rest = std::borrow::Cow::Borrowed(&body[p.name.len() + 1..]);
                    if effects.deallocate && (named.is_some() || p.name.is_empty()) {
                        // The client's statement exists on servers only
                        // under its server-side name, as for a Query's
                        // DEALLOCATE ([`Session::deallocate`]); psycopg
                        // drops statements this way in pipelines.
                        if let Some(t) = std::str::from_utf8(p.query)
                            .ok()
                            .and_then(|q| self.deallocated(q))
                        {
                            let mut text =
                                format!("DEALLOCATE {}", quote_ident(&t.sname)).into_bytes();
                            text.push(0);
                            text.extend_from_slice(&rest[p.query.len() + 1..]);
                            rest = std::borrow::Cow::Owned(text);
                            drops = Drops::One(Arc::new(t));
                        }
                    }
                    if let Some(name) = named {
                        if self.statements.contains_key(name) {
                            // PostgreSQL refuses a name already in use
                            // (42P05) and keeps the statement it has: the
                            // Parse goes out under that statement's server
                            // name, prepared here first if need be, for
                            // the server to refuse it likewise.
                            let (sname, _) = self.ensure(name, out);
                            self.replies.push_parse(SentParse {
                                injected: false,
                                placeholder: None,
                                name: None,
                                forget: false,
                                unnamed_seq: 0,
                                batch: self.replies.sent,
                                seq: 0,
                            });
                            self.replies.open_batch = true;
                            put_parse(out, &sname, &rest);
                            return Ok(());
                        }
                        let name = name.to_string();
                        let rest = Bytes::copy_from_slice(&rest);
                        let sname: Arc<str> = Arc::from(self.server_name(&name));
                        self.statements
                            .insert(name, (sname.clone(), rest.clone(), drops));
                        if let Some(c) = self.attached.as_mut() {
                            c.conn.prepared.insert(&sname);
                        }
                        self.replies.push_parse(SentParse {
                            injected: false,
                            placeholder: None,
                            name: Some(sname.clone()),
                            forget: true,
                            unnamed_seq: 0,
                            batch: self.replies.sent,
                            seq: 0,
                        });
                        self.replies.open_batch = true;
                        put_parse(out, &sname, &rest);
                        self.bound_statements(&sname, out);
                        return Ok(());
                    }
                    // (A name that is not UTF-8 passes as it is.)
                    if p.name.is_empty() {
                        self.unnamed.clear();
                        self.unnamed.extend_from_slice(&rest);
                        self.unnamed_set = true;
                        self.unnamed_here = true;
                        self.unnamed_uncertain |= self.replies.open_batch;
                        self.unnamed_seq += 1;
                    }
                    self.replies.push_parse(SentParse {
                        injected: false,
                        placeholder: None,
                        name: None,
                        forget: p.name.is_empty(),
                        unnamed_seq: self.unnamed_seq,
                        batch: self.replies.sent,
                        seq: 0,
                    });
                    self.unnamed_drops = drops;
                    if let std::borrow::Cow::Owned(rest) = rest {
                        self.note_sent(tag);
                        put_parse(out, "", &rest);
                        return Ok(());
                    }
                }
            }
            // The fast-path interface names its function by OID only.
            frontend::FUNCTION_CALL
                if message::function_call_oid(body)
                    .is_ok_and(|oid| PINNING_FUNCTIONS.contains(&oid)) =>
            {
                self.pinned = true;
            }
            frontend::BIND => {
                if let Ok((portal, stmt)) = message::bind_names(body) {
                    if !stmt.is_empty() {
                        let skip = portal.len() + 1 + stmt.len() + 1;
                        let (sname, drops) = self.ensure(stmt, out);
                        self.bound(portal, drops);
                        let rest = &body[skip.min(body.len())..];
                        out.put_u8(frontend::BIND);
                        out.put_u32((4 + portal.len() + 1 + sname.len() + 1 + rest.len()) as u32);
                        out.put_slice(portal.as_bytes());
                        out.put_u8(0);
                        out.put_slice(sname.as_bytes());
                        out.put_u8(0);
                        out.put_slice(rest);
                        self.replies.open_batch = true;
                        return Ok(());
                    }
                    self.ensure_unnamed(out);
                    self.bound(portal, self.unnamed_drops.clone());
                }
            }
            frontend::EXECUTE if !self.dealloc_portals.is_empty() => {
                if let Ok(portal) = message::execute_portal(body) {
                    if let Some(i) = self
                        .dealloc_portals
                        .iter()
                        .position(|(_, p, _)| p == portal)
                    {
                        // Only the first Execute runs the DEALLOCATE: the
                        // server refuses to run a finished portal again.
                        let (_, _, t) = self.dealloc_portals.swap_remove(i);
                        self.deallocating(&t, out);
                    }
                }
            }
            frontend::DESCRIBE | frontend::CLOSE => {
                let target = message::describe_target(body);
                if let Ok((b'P', portal)) = target {
                    if tag == frontend::CLOSE {
                        self.dealloc_portals.retain(|(_, p, _)| p != portal);
                    }
                }
                if let Ok((b'S', name)) = target {
                    if name.is_empty() {
                        if tag == frontend::DESCRIBE {
                            self.ensure_unnamed(out);
                        } else {
                            // The server's unnamed statement goes, and
                            // the client has none.
                            self.unnamed_set = false;
                            self.unnamed_here = true;
                            self.unnamed_uncertain |= self.replies.open_batch;
                        }
                    } else {
                        let name = name.to_string();
                        let sname = if tag == frontend::DESCRIBE {
                            self.ensure(&name, out).0
                        } else {
                            // A name the client never prepared here gets
                            // one no statement has: closing it is no error.
                            match self.statements.remove(&name) {
                                Some(st) => {
                                    let s = st.0.clone();
                                    let here = self
                                        .attached
                                        .as_mut()
                                        .is_some_and(|c| c.conn.prepared.remove(&s));
                                    if let Some(close) = self.replies.closes.back_mut() {
                                        close.restore = Some((name, st, here));
                                    }
                                    s
                                }
                                None => Arc::from(self.untracked_name(&name)),
                            }
                        };
                        out.put_u8(tag);
                        out.put_u32((4 + 1 + sname.len() + 1) as u32);
                        out.put_u8(b'S');
                        out.put_slice(sname.as_bytes());
                        out.put_u8(0);
                        self.replies.open_batch = true;
                        return Ok(());
                    }
                }
            }
            _ => {}
        }
        self.note_sent(tag);
        out.extend_from_slice(msg);
        Ok(())
    }

    fn note_sent(&mut self, tag: u8) {
        match tag {
            // PostgreSQL ignores it: no ReadyForQuery will come.
            frontend::SYNC if self.replies.copy_in => {}
            frontend::QUERY | frontend::SYNC | frontend::FUNCTION_CALL => {
                self.replies.query_in_batch |= tag != frontend::SYNC && self.replies.open_batch;
                if tag != frontend::SYNC && self.replies.pending < 64 {
                    self.replies.kinds |= 1 << self.replies.pending;
                }
                self.replies.pending += 1;
                self.replies.sent += 1;
                if tag == frontend::SYNC {
                    self.replies.open_batch = false;
                    if std::mem::take(&mut self.unnamed_uncertain) {
                        self.unnamed_here = false;
                    }
                }
            }
            // Not Flush: it asks for replies without starting anything
            // that needs this server, and after a Sync it ends no batch.
            frontend::PARSE
            | frontend::BIND
            | frontend::DESCRIBE
            | frontend::EXECUTE
            | frontend::CLOSE => {
                self.replies.open_batch = true;
            }
            frontend::COPY_DONE | frontend::COPY_FAIL => {
                if !self.replies.copy_in {
                    self.replies.copy_ended = true;
                }
                self.replies.copy_in = false;
            }
            _ => {}
        }
    }

    /// For a Bind, Describe or Parse (`tag`, `body`) of a client's statement
    /// whose Parse (or Close, to bound the cache) pgwarden sent in an earlier
    /// batch still unanswered, that batch. Whether the statement is on the
    /// server depends on that Parse, which an error before it makes the server
    /// skip: prepared again now, it could be refused as a duplicate; not
    /// prepared, the Bind could fail where PostgreSQL would run it. Pipelines
    /// rarely meet this (a statement new to its server, used in batches sent
    /// before the first is answered) and then wait one round trip.
    fn unanswered_parse(&self, tag: u8, body: &[u8]) -> Option<u64> {
        let name = match tag {
            frontend::BIND => message::bind_names(body).ok()?.1,
            // A Parse of a name the client has goes out under that
            // statement's server-side name, for the server to refuse it.
            frontend::PARSE => std::str::from_utf8(message::parse_message(body).ok()?.name).ok()?,
            frontend::DESCRIBE if body.first() == Some(&b'S') => {
                let end = body.iter().position(|&b| b == 0)?;
                std::str::from_utf8(&body[1..end]).ok()?
            }
            _ => return None,
        };
        let (sname, ..) = self.statements.get(name)?;
        if self.replies.query_in_batch {
            // The batch awaited may be answered only after the messages
            // the wait would hold back; as before this wait existed, the
            // statement is taken as prepared.
            return None;
        }
        // Likewise a Close of it pgwarden sent to bound the cache: skipped
        // after an error, it leaves the statement there, and preparing it
        // again meanwhile would meet it (42P05).
        let parsed = self
            .replies
            .parses
            .iter()
            .filter(|p| p.injected && p.batch < self.replies.sent)
            .filter(|p| p.name.as_ref() == Some(sname))
            .map(|p| p.batch);
        let closed = self
            .replies
            .closes
            .iter()
            .filter(|c| c.batch < self.replies.sent)
            .filter(|c| c.own.as_deref() == Some(&**sname))
            .map(|c| c.batch);
        parsed.chain(closed).max()
    }

    /// Makes sure the client's statement `name` exists on the attached
    /// server, injecting its Parse if needed; returns the server-side name.
    /// Runs per Bind, so a known statement costs no allocation. Also says
    /// what running the statement drops.
    fn ensure(&mut self, name: &str, out: &mut BytesMut) -> (Arc<str>, Drops) {
        let Some((sname, rest, drops)) = self.statements.get(name) else {
            return (Arc::from(self.untracked_name(name)), Drops::Nothing);
        };
        let (sname, drops) = (sname.clone(), drops.clone());
        if let Some(c) = self.attached.as_mut() {
            if !c.conn.prepared.touch(&sname) {
                put_parse(out, &sname, rest);
                c.conn.prepared.insert(&sname);
                self.replies.push_parse(SentParse {
                    injected: true,
                    placeholder: None,
                    name: Some(sname.clone()),
                    forget: false,
                    unnamed_seq: 0,
                    batch: self.replies.sent,
                    seq: 0,
                });
                self.bound_statements(&sname, out);
            }
        }
        (sname, drops)
    }

    /// The client bound `portal` to a statement that drops `drops` when
    /// run.
    fn bound(&mut self, portal: &str, drops: Drops) {
        if !self.dealloc_portals.is_empty() {
            // The unnamed portal is replaced by the next Bind.
            self.dealloc_portals.retain(|(_, p, _)| p != portal);
        }
        match drops {
            Drops::Nothing => {}
            Drops::Every { settings } => self.forget_statements(settings),
            // Only once the DEALLOCATE runs and the server confirms it:
            // the portal may never be executed, or fail.
            Drops::One(t) => self
                .dealloc_portals
                .push((self.replies.sent, portal.to_string(), t)),
        }
    }

    /// Before the Execute of a portal bound to a `DEALLOCATE` of the
    /// client's statement `t`: the statement is forgotten once the server
    /// confirms the DEALLOCATE ran. Where the statement is not prepared,
    /// a placeholder is prepared under its server-side name for the
    /// DEALLOCATE to drop, for the reasons [`Session::deallocate`] gives;
    /// a Parse of its own here, since an error before the Execute makes the
    /// server skip both, and in an aborted transaction the Parse fails
    /// with the error the Execute would get.
    fn deallocating(&mut self, t: &Target, out: &mut BytesMut) {
        // Dropped or prepared again since the DEALLOCATE was parsed: it
        // names a statement the client no longer has, and the server
        // answers for it (26000, under the client's name).
        if !matches!(self.statements.get(&t.name), Some(st) if st.0 == t.sname) {
            return;
        }
        let here = self
            .attached
            .as_mut()
            .is_some_and(|c| c.conn.prepared.touch(&t.sname));
        if !here {
            put_parse(out, &t.sname, b"SELECT\0\0\0");
            self.replies.push_parse(SentParse {
                injected: true,
                placeholder: Some(t.sname.clone()),
                name: None,
                forget: false,
                unnamed_seq: 0,
                batch: self.replies.sent,
                seq: 0,
            });
        }
        self.replies.deallocs.push(SentDealloc {
            batch: self.replies.sent,
            name: t.name.clone(),
            sname: t.sname.clone(),
            placeholder: false,
            stray: false,
        });
    }

    /// Before a Bind or Describe of the unnamed statement: makes the
    /// attached server's unnamed statement the client's. The client's is
    /// prepared again when it was parsed in an earlier transaction; when
    /// the client has none, the server's (another client's) is closed, so
    /// that the server answers as PostgreSQL would (26000).
    fn ensure_unnamed(&mut self, out: &mut BytesMut) {
        if self.unnamed_here {
            return;
        }
        self.unnamed_here = true;
        self.unnamed_uncertain |= self.replies.open_batch;
        if self.unnamed_set {
            put_parse(out, "", &self.unnamed);
            self.replies.push_parse(SentParse {
                injected: true,
                placeholder: None,
                name: None,
                forget: false,
                unnamed_seq: self.unnamed_seq,
                batch: self.replies.sent,
                seq: 0,
            });
        } else {
            put_close(out, "");
            self.replies.push_close(SentClose {
                own: Some(String::new()),
                restore: None,
                marker: false,
                batch: self.replies.sent,
                seq: 0,
            });
        }
        self.replies.open_batch = true;
    }

    /// Closes the least recently used statements of the attached server
    /// while it holds more than `max_prepared_statements`, sparing `keep`.
    fn bound_statements(&mut self, keep: &str, out: &mut BytesMut) {
        let bound = self.settings.max_prepared_statements;
        let Some(c) = self.attached.as_mut() else {
            return;
        };
        if c.conn.prepared.len() <= bound {
            return;
        }
        for victim in c.conn.prepared.evict(bound, keep) {
            put_close(out, &victim);
            self.replies.push_close(SentClose {
                own: Some(victim),
                restore: None,
                marker: false,
                batch: self.replies.sent,
                seq: 0,
            });
        }
    }

    /// The client dropped every prepared statement of its session
    /// (`DEALLOCATE ALL`, `DISCARD ALL`): its own are gone, and so is
    /// everything on the attached server, other clients' statements
    /// included; those are prepared again on demand.
    ///
    /// Should the statement fail (inside a transaction block, say), the
    /// server keeps statements its cache no longer lists, and preparing
    /// them again would fail: an error before the statement's
    /// CommandComplete closes the server when it is released.
    /// With `settings` (`DISCARD ALL`), the server's settings return to
    /// its defaults as well. `DEALLOCATE ALL` keeps them: recorded as
    /// gone, the client's start-up settings would stay on the server for
    /// the next client, which has none, to inherit.
    fn forget_statements(&mut self, settings: bool) {
        self.statements.clear();
        if let Some(c) = self.attached.as_mut() {
            c.conn.prepared.clear();
            if settings {
                c.conn.extras = Extras::default();
            }
            self.discarding += 1;
        }
    }

    /// The client's statement that `text`, a `DEALLOCATE name` (or
    /// `DEALLOCATE PREPARE name`), drops; `None` for `DEALLOCATE ALL`
    /// (see [`Effects::drops`]) and for names pgwarden does not follow
    /// (an SQL-level PREPARE's, which the client's own server has).
    fn deallocated(&self, text: &str) -> Option<Target> {
        // Comments anywhere become blanks (`DEALLOCATE /* done */ s1`),
        // and a quoted name may hold blanks of its own.
        let blanked =
            pgwarden_wire::blank_comments(text.as_bytes()).and_then(|b| String::from_utf8(b).ok());
        let t = blanked.as_deref().unwrap_or(text);
        let t = t.trim().trim_end_matches(';').trim();
        let keyword = |s: &'_ str, kw: &str| -> Option<usize> {
            let head = s.get(..kw.len())?;
            let next = s[kw.len()..].chars().next();
            (head.eq_ignore_ascii_case(kw) && next.is_some_and(char::is_whitespace))
                .then_some(kw.len())
        };
        let mut rest = t[keyword(t, "deallocate")?..].trim_start();
        if let Some(n) = keyword(rest, "prepare") {
            rest = rest[n..].trim_start();
        }
        if rest.eq_ignore_ascii_case("all") {
            return None;
        }
        let name = sql_ident(rest)?;
        let sname = self.statements.get(&name)?.0.clone();
        Some(Target { name, sname })
    }

    /// `DEALLOCATE name` in a Query for protocol-level statements (PHP's
    /// PDO, and psycopg outside pipelines, drop statements that way):
    /// renamed to the server-side name.
    fn deallocate(&mut self, text: &str) -> Option<String> {
        let Target { name, sname } = self.deallocated(text)?;
        let here = self
            .attached
            .as_mut()
            .is_some_and(|c| c.conn.prepared.touch(&sname));
        self.replies.deallocs.push(SentDealloc {
            batch: self.replies.sent,
            name,
            sname: sname.clone(),
            placeholder: !here,
            stray: false,
        });
        if here {
            return Some(format!("DEALLOCATE {}", quote_ident(&sname)));
        }
        // Not prepared on this server: the DEALLOCATE the client waits for
        // drops a placeholder, prepared in the same Query (whose PREPARE
        // reply is swallowed). Preparing the real statement only to drop
        // it would plan it for nothing, and fail if it no longer parses
        // (its table dropped, say), which the DEALLOCATE would not have
        // done where the statement was prepared. Not as a Parse ahead of
        // the Query either: after a failed Parse (in an aborted
        // transaction) the server would ignore the Query until a Sync, and
        // the client would wait for ever. In one Query, an aborted
        // transaction fails it with the error the DEALLOCATE would get.
        let q = quote_ident(&sname);
        Some(format!("PREPARE {q} AS SELECT; DEALLOCATE {q}"))
    }

    /// Processes a chunk from the server; returns what goes to the client.
    /// Only ParseComplete, ReadyForQuery and ParameterStatus are looked at;
    /// everything else streams through, partial messages included.
    fn server_bytes(&mut self, buf: &mut BytesMut) -> Result<ToClient, Fatal> {
        // Bytes are handed on without copying; only when a message is
        // dropped (an injected Parse's ParseComplete) is the rest copied
        // around it.
        let mut out: Option<BytesMut> = None;
        let mut pos = 0;
        if self.skip > 0 {
            pos = self.skip.min(buf.len());
            self.skip -= pos;
        }
        loop {
            let Some(h) = message::peek_header(&buf[pos..], usize::MAX)
                .map_err(|e| Fatal::new(sqlstate::PROTOCOL_VIOLATION, e.to_string()))?
            else {
                break;
            };
            let total = h.total_len();
            let avail = buf.len() - pos;
            let interesting = matches!(
                h.tag,
                backend::PARSE_COMPLETE
                    | backend::CLOSE_COMPLETE
                    | backend::READY_FOR_QUERY
                    | backend::PARAMETER_STATUS
                    | backend::COPY_IN_RESPONSE
            ) || h.tag == backend::ERROR_RESPONSE
                || (h.tag == backend::COMMAND_COMPLETE
                    && (self.discarding > 0 || !self.replies.deallocs.is_empty()));
            if !interesting {
                let n = total.min(avail);
                pos += n;
                self.skip = total - n;
                if self.skip > 0 {
                    break;
                }
                continue;
            }
            if avail < total {
                break;
            }
            let body = &buf[pos + 5..pos + total];
            match h.tag {
                backend::PARSE_COMPLETE => {
                    self.drop_stale_parses();
                    if let Some(SentParse {
                        injected: true,
                        placeholder,
                        ..
                    }) = self.replies.parses.pop_front()
                    {
                        if let Some(sname) = placeholder {
                            self.placeholder_made(&sname);
                        }
                        drop_message(&mut out, buf, &mut pos, total);
                        continue;
                    }
                    if let Some(pipeline) = self.read_only.as_deref_mut() {
                        pipeline.parse_complete();
                    }
                }
                backend::CLOSE_COMPLETE => {
                    self.drop_stale_closes(&[]);
                    if let Some(&SentClose {
                        own: Some(_),
                        marker,
                        ..
                    }) = self.replies.closes.front()
                    {
                        self.replies.closes.pop_front();
                        if marker {
                            // Its Query will run: the oldest marked one.
                            self.replies.marks &= self.replies.marks.wrapping_sub(1);
                            if let Some(pipeline) = self.read_only.as_deref_mut() {
                                pipeline.close_complete();
                            }
                        }
                        drop_message(&mut out, buf, &mut pos, total);
                        continue;
                    }
                    self.replies.closes.pop_front();
                    if let Some(pipeline) = self.read_only.as_deref_mut() {
                        pipeline.close_complete();
                    }
                }
                backend::COMMAND_COMPLETE => {
                    if self.discarding > 0
                        && (body.starts_with(b"DISCARD ALL\0")
                            || body.starts_with(b"DEALLOCATE ALL\0"))
                    {
                        // The server holds no prepared statement now:
                        // whatever an earlier error left there is gone.
                        self.discarding -= 1;
                        self.stray_statements = false;
                    }
                    if let Some(i) = self
                        .replies
                        .deallocs
                        .iter()
                        .position(|d| d.batch == self.replies.done)
                    {
                        let d = &mut self.replies.deallocs[i];
                        if d.placeholder && body.starts_with(b"PREPARE\0") {
                            d.placeholder = false;
                            d.stray = true;
                            drop_message(&mut out, buf, &mut pos, total);
                            continue;
                        }
                        if body.starts_with(b"DEALLOCATE\0") {
                            let d = self.replies.deallocs.remove(i);
                            self.dropped(&d.name, &d.sname);
                        }
                    }
                }
                backend::ERROR_RESPONSE => {
                    if let Some(pipeline) = self.read_only.as_deref_mut() {
                        pipeline.error();
                    }
                    if self.discarding > 0 {
                        self.stray_statements = true;
                    }
                    if ends_session(body) {
                        self.replies.fatal = true;
                    }
                    self.missing_statement(body);
                    // A COPY that failed takes no more data; the Sync
                    // that follows (extended protocol) is answered.
                    self.replies.copy_in = false;
                    if let Some(renamed) = client_names(body, self.client_id) {
                        drop_message(&mut out, buf, &mut pos, total);
                        if let Some(o) = out.as_mut() {
                            o.extend_from_slice(&renamed);
                        }
                        continue;
                    }
                }
                backend::COPY_IN_RESPONSE => {
                    self.replies.copy_in_started();
                    if let Some(pipeline) = self.read_only.as_deref_mut() {
                        pipeline.copy_in();
                    }
                }
                backend::READY_FOR_QUERY => {
                    // Any report before it was checked (below).
                    if let Some(pipeline) = self.read_only.as_deref_mut() {
                        pipeline.ready();
                    }
                    // Queries whose markers went unanswered were skipped
                    // (an error earlier in their batch): this answers the
                    // batch's Sync.
                    while self.replies.marks & 1 == 1 && self.replies.pending > 1 {
                        self.replies.pending -= 1;
                        self.replies.kinds >>= 1;
                        self.replies.marks >>= 1;
                        self.replies.done += 1;
                    }
                    self.replies.pending = self.replies.pending.saturating_sub(1);
                    if self.replies.pending == 0 {
                        self.replies.query_in_batch = false;
                    }
                    self.replies.kinds >>= 1;
                    self.replies.marks >>= 1;
                    self.replies.copy_ended = false;
                    self.replies.done += 1;
                    let status = message::ready_for_query_status(body).ok();
                    if let Some(c) = self.attached.as_mut() {
                        c.traffic.ready(
                            self.replies.pending == 0 && !self.replies.open_batch,
                            status == Some(TxStatus::Idle),
                        );
                    }
                    // A DEALLOCATE whose batch ended without dropping the
                    // statement (an error) leaves it where it was.
                    let done = self.replies.done;
                    let mut stray = false;
                    self.replies.deallocs.retain(|d| {
                        stray |= d.batch < done && d.stray;
                        d.batch >= done
                    });
                    self.stray_statements |= stray;
                    self.replies.status = status;
                    if self.replies.status == Some(TxStatus::Idle) {
                        // Portals end with their transaction.
                        self.dealloc_portals.retain(|(b, ..)| *b >= done);
                    }
                    let skipped = self.drop_stale_parses();
                    self.drop_stale_closes(&skipped);
                }
                _ => {
                    if let Ok((k, v)) = message::parameter_status(body) {
                        if self.service.spec.read_only
                            && k == "default_transaction_read_only"
                            && !v.eq_ignore_ascii_case("on")
                        {
                            self.detach(false);
                            return Err(Fatal::new(
                                sqlstate::READ_ONLY_SQL_TRANSACTION,
                                "terminating connection: the session was made read-write on a read-only service",
                            ));
                        }
                        if self.service.spec.read_only
                            && k == "client_encoding"
                            && pgwarden_wire::readonly::client_only_encoding(v.as_bytes())
                        {
                            self.detach(false);
                            return Err(Fatal::new(
                                sqlstate::READ_ONLY_SQL_TRANSACTION,
                                format!("terminating connection: client_encoding {v} is not allowed on a read-only service"),
                            ));
                        }
                        self.params.set(k, v);
                        if let Some(c) = self.attached.as_mut() {
                            c.conn.set_param(k, v);
                        }
                    }
                }
            }
            pos += total;
        }
        Ok(match out {
            Some(mut o) => {
                o.extend_from_slice(&buf[..pos]);
                buf.advance(pos);
                ToClient::Owned(o)
            }
            None => ToClient::Prefix(pos),
        })
    }

    /// An error `body` saying a prepared statement does not exist: where
    /// pgwarden listed it as prepared on the attached server, its list
    /// was wrong (a DEALLOCATE in SQL run at run time, say, which no check
    /// can read), and the statement goes from it, so that the next use
    /// prepares it there again instead of failing the same way for good.
    fn missing_statement(&mut self, body: &[u8]) {
        let Ok(fields) = message::error_fields_raw(body) else {
            return;
        };
        if message::find_raw_field(&fields, b'C') != Some(b"26000") {
            return;
        }
        // The client's own statement the message names, in whatever
        // language and quotes (the longest, should one name hold
        // another): one of another client's (in an error any client can
        // raise) is not this client's to drop.
        let Some(msg) = message::find_raw_field(&fields, b'M') else {
            return;
        };
        let Some(name) = self
            .statements
            .values()
            .map(|st| st.0.clone())
            .filter(|s| memchr::memmem::find(msg, s.as_bytes()).is_some())
            .max_by_key(|s| s.len())
        else {
            return;
        };
        let name = &*name;
        // A Parse of it still on its way (pgwarden's own, pipelined behind
        // the failed Bind) will make it.
        if self
            .replies
            .parses
            .iter()
            .any(|p| p.name.as_deref() == Some(name))
        {
            return;
        }
        if let Some(c) = self.attached.as_mut() {
            c.conn.prepared.remove(name);
        }
    }

    /// The server prepared the placeholder a `DEALLOCATE` of `sname` is to
    /// drop ([`Session::deallocating`]).
    fn placeholder_made(&mut self, sname: &str) {
        for d in self.replies.deallocs.iter_mut() {
            if &*d.sname == sname {
                d.stray = true;
            }
        }
    }

    /// The server dropped the client's statement `name` (`sname` there):
    /// forgotten, unless the client has prepared the name again since.
    fn dropped(&mut self, name: &str, sname: &Arc<str>) {
        if self.statements.get(name).is_some_and(|(s, ..)| s == sname) {
            self.statements.remove(name);
        }
        if let Some(c) = self.attached.as_mut() {
            c.conn.prepared.remove(sname);
        }
    }

    /// Closes of a completed batch were skipped (an error came first):
    /// the statements pgwarden meant to close are still on the server,
    /// except those whose Parse before the Close was skipped or failed too
    /// (`skipped`, from [`Session::drop_stale_parses`]), which never got
    /// there (a statement closed first and prepared again after was there
    /// all along); and a client's statement whose own Parse failed was
    /// never the client's.
    fn drop_stale_closes(&mut self, skipped: &[(Arc<str>, bool, u64)]) {
        while let Some(close) = self.replies.closes.front() {
            if close.batch >= self.replies.done {
                break;
            }
            let Some(close) = self.replies.closes.pop_front() else {
                break;
            };
            match close {
                SentClose {
                    own: Some(name),
                    seq,
                    ..
                } if !name.is_empty() => {
                    if skipped.iter().any(|(s, _, at)| **s == *name && *at < seq) {
                        continue;
                    }
                    if let Some(c) = self.attached.as_mut() {
                        c.conn.prepared.insert(&name);
                    }
                }
                SentClose {
                    restore: Some((name, st, here)),
                    seq,
                    ..
                } => {
                    let parse = skipped.iter().find(|(s, _, at)| *s == st.0 && *at < seq);
                    if parse.is_some_and(|(_, forget, _)| *forget) {
                        // Its Parse failed: the client has no such
                        // statement, as on PostgreSQL.
                        continue;
                    }
                    // The client's statement is still there, as it is on
                    // PostgreSQL when an error skips a Close; on this
                    // server only if it was before the batch.
                    if here && parse.is_none() {
                        if let Some(c) = self.attached.as_mut() {
                            c.conn.prepared.insert(&st.0);
                        }
                    }
                    self.statements.entry(name).or_insert(st);
                }
                _ => {}
            }
        }
    }

    /// Parses of a batch that has completed can no longer be answered
    /// (they failed, or an error made the server skip them). Returns the
    /// server-side names of those that named a statement pgwarden
    /// follows, with whether it was the client's own new statement, and
    /// where it was sent among the Parses and Closes.
    fn drop_stale_parses(&mut self) -> Vec<(Arc<str>, bool, u64)> {
        let mut skipped = Vec::new();
        while let Some(p) = self.replies.parses.front() {
            if p.batch >= self.replies.done {
                break;
            }
            let Some(p) = self.replies.parses.pop_front() else {
                break;
            };
            match &p.name {
                Some(sname) => {
                    if let Some(c) = self.attached.as_mut() {
                        c.conn.prepared.remove(sname);
                    }
                    if p.forget {
                        // The client has no such statement, as it would
                        // not on PostgreSQL, and a Close of it pipelined
                        // in a later batch brings nothing back if skipped.
                        self.statements.retain(|_, st| st.0 != *sname);
                        for c in self.replies.closes.iter_mut() {
                            if matches!(&c.restore, Some((_, st, _)) if st.0 == *sname) {
                                c.restore = None;
                            }
                        }
                    }
                    skipped.push((sname.clone(), p.forget, p.seq));
                }
                // The unnamed statement, unless parsed again since.
                None if p.unnamed_seq == self.unnamed_seq && p.unnamed_seq > 0 => {
                    if p.forget {
                        // A failed unnamed Parse leaves none, as it drops
                        // the previous one first.
                        self.unnamed_set = false;
                    } else {
                        self.unnamed_here = false;
                    }
                }
                None => {}
            }
        }
        skipped
    }
}

/// The ErrorResponse `body` with the server-side names of client
/// `client`'s statements ([`Session::server_name`],
/// [`Session::untracked_name`]) put back to the names the client knows
/// them by (`prepared statement "s1" already exists`); `None` when it
/// names none.
fn client_names(body: &[u8], client: u64) -> Option<BytesMut> {
    let prefix = format!("pgw{client}");
    memchr::memmem::find(body, prefix.as_bytes())?;
    let strip = |text: &str| -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(at) = rest.find(&prefix) {
            let after = &rest[at + prefix.len()..];
            // `pgw{client}u_{name}` or `pgw{client}_{n}_{name}`.
            let skip = if let Some(n) = after.strip_prefix("u_") {
                Some(after.len() - n.len())
            } else if let Some(n) = after.strip_prefix('_') {
                let digits = n.bytes().take_while(u8::is_ascii_digit).count();
                (digits > 0 && n[digits..].starts_with('_')).then_some(1 + digits + 1)
            } else {
                None
            };
            match skip {
                Some(k) => {
                    out.push_str(&rest[..at]);
                    rest = &after[k..];
                }
                None => {
                    out.push_str(&rest[..at + prefix.len()]);
                    rest = after;
                }
            }
        }
        out.push_str(rest);
        out
    };
    let fields = message::error_fields(body).ok()?;
    let mut msg = BytesMut::with_capacity(body.len() + 5);
    msg.put_u8(backend::ERROR_RESPONSE);
    msg.put_u32(0);
    for (ty, text) in fields {
        msg.put_u8(ty);
        msg.put_slice(strip(text).as_bytes());
        msg.put_u8(0);
    }
    msg.put_u8(0);
    let len = (msg.len() - 1) as u32;
    msg[1..5].copy_from_slice(&len.to_be_bytes());
    Some(msg)
}

/// Whether `tag` is a message a client may send once logged in; anything
/// else PostgreSQL answers with a FATAL error.
fn frontend_message(tag: u8) -> bool {
    matches!(
        tag,
        frontend::QUERY
            | frontend::PARSE
            | frontend::BIND
            | frontend::EXECUTE
            | frontend::DESCRIBE
            | frontend::CLOSE
            | frontend::SYNC
            | frontend::FLUSH
            | frontend::FUNCTION_CALL
            | frontend::TERMINATE
            | frontend::COPY_DATA
            | frontend::COPY_DONE
            | frontend::COPY_FAIL
    )
}

/// Whether the ErrorResponse `body` ends the server's session (severity
/// FATAL or PANIC).
fn ends_session(body: &[u8]) -> bool {
    // 'V' is the severity never translated; servers before 9.6 send 'S'
    // only.
    let fields = message::error_fields_raw(body).unwrap_or_default();
    let severity =
        message::find_raw_field(&fields, b'V').or_else(|| message::find_raw_field(&fields, b'S'));
    matches!(severity, Some(b"FATAL" | b"PANIC"))
}

/// Sets session parameters on a freshly borrowed server before the client's
/// first statement; the replies are the pool's business, not the client's.
async fn sync_params(c: &mut Checkout, sets: &str) -> Result<(), String> {
    if let Some((_, text)) = run_on_server(c, sets).await? {
        tracing::warn!(error = %text, "setting session parameters on a pooled connection failed");
    }
    Ok(())
}

/// Longest wait for a server to confirm `DISCARD ALL`.
const RESET_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs `sql` (simple protocol) on a server connection of pgwarden's own
/// and reads up to its ReadyForQuery, keeping ParameterStatus changes.
/// `Ok(Some((sqlstate, message)))`: the server answered with an error.
async fn run_on_server(c: &mut Checkout, sql: &str) -> Result<Option<(String, String)>, String> {
    // Its reads leave the socket's registration as they please.
    c.read_armed = false;
    let mut q = BytesMut::new();
    encode::query(&mut q, sql);
    c.conn
        .stream
        .write_all(&q)
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = BytesMut::with_capacity(1024);
    let mut error = None;
    loop {
        match message::split_message(&mut buf, 1 << 20) {
            Ok(Some((backend::READY_FOR_QUERY, _))) => return Ok(error),
            Ok(Some((backend::PARAMETER_STATUS, m))) => {
                if let Ok((k, v)) = message::parameter_status(&m[5..]) {
                    c.conn.set_param(k, v);
                }
            }
            Ok(Some((backend::ERROR_RESPONSE, m))) => {
                let fields = message::error_fields_raw(&m[5..]).unwrap_or_default();
                let text = message::find_raw_field(&fields, b'M')
                    .map_or("error".into(), |m| String::from_utf8_lossy(m).into_owned());
                let code = message::find_raw_field(&fields, b'C')
                    .map_or(sqlstate::INTERNAL_ERROR.code().into(), |c| {
                        String::from_utf8_lossy(c).into_owned()
                    });
                error = Some((code, text));
            }
            Ok(Some(_)) => {}
            Ok(None) => {
                if c.conn
                    .stream
                    .read_buf(&mut buf)
                    .await
                    .map_err(|e| e.to_string())?
                    == 0
                {
                    return Err("server closed the connection".into());
                }
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// A Close of the prepared statement `name`.
/// Leaves out of what goes to the client the message of `total` bytes
/// at `pos` in `buf`: what came before it moves to `out`, the rest of
/// `buf` is looked at from its start.
fn drop_message(out: &mut Option<BytesMut>, buf: &mut BytesMut, pos: &mut usize, total: usize) {
    let o = out.get_or_insert_with(BytesMut::new);
    o.extend_from_slice(&buf[..*pos]);
    buf.advance(*pos + total);
    *pos = 0;
}

fn put_close(out: &mut BytesMut, name: &str) {
    out.put_u8(frontend::CLOSE);
    out.put_u32((4 + 1 + name.len() + 1) as u32);
    out.put_u8(b'S');
    out.put_slice(name.as_bytes());
    out.put_u8(0);
}

fn put_parse(out: &mut BytesMut, name: &str, rest: &[u8]) {
    out.put_u8(frontend::PARSE);
    out.put_u32((4 + name.len() + 1 + rest.len()) as u32);
    out.put_slice(name.as_bytes());
    out.put_u8(0);
    out.put_slice(rest);
}

/// Functions (OIDs fixed in PostgreSQL's catalog) whose call through the
/// fast-path interface pins the client: `set_config` (its value may be
/// session-level) and the session advisory locks, in both signatures.
const PINNING_FUNCTIONS: [u32; 9] = [
    crate::session::SET_CONFIG_OID,
    2880,
    2881,
    2882,
    2883,
    2886,
    2887,
    2888,
    2889,
];

/// `ident` as a quoted SQL identifier. Statement names come from clients
/// and may hold a double quote: unescaped, it would end the identifier in
/// pgwarden's own SQL and run the rest.
fn quote_ident(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// The name an identifier written in SQL stands for, read as PostgreSQL
/// reads it: unquoted ones fold to lower case, quoted ones keep their case
/// with `""` for a quote. `None` for anything else (the server answers
/// such text itself).
fn sql_ident(word: &str) -> Option<String> {
    if let Some(inner) = word.strip_prefix('"') {
        let inner = inner.strip_suffix('"')?;
        let mut name = String::with_capacity(inner.len());
        let mut chars = inner.chars();
        while let Some(c) = chars.next() {
            if c == '"' && chars.next() != Some('"') {
                return None;
            }
            name.push(c);
        }
        return (!name.is_empty()).then_some(name);
    }
    let mut chars = word.chars();
    let first = chars.next()?;
    let start = first.is_ascii_alphabetic() || first == '_' || !first.is_ascii();
    let rest = chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$' || !c.is_ascii());
    (start && rest).then(|| word.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {

    /// A server's FATAL ends the client's session with the server's own
    /// words whatever their encoding: read as anything else, a LATIN1
    /// message (a German server) was followed by pgwarden's own FATAL.
    #[test]
    fn a_fatal_in_any_encoding_ends_the_session() {
        use super::ends_session;
        let latin1 = b"SFATAL\0VFATAL\0C57P01\0Mbeende Verbindung \xbbauf Anweisung\xab\0\0";
        assert!(ends_session(latin1));
        assert!(ends_session(b"SPANIC\0C XX000\0M\xe9\0\0"));
        // Servers before 9.6 send only the localized severity.
        assert!(ends_session(b"SFATAL\0Mx\0\0"));
        assert!(!ends_session(b"SFEHLER\0VERROR\0C42P01\0M\xbbt\xab\0\0"));
        assert!(!ends_session(b"garbage"));
    }

    #[test]
    fn statement_names_in_sql_are_read_and_written_as_postgresql_does() {
        use super::{quote_ident, sql_ident};
        assert_eq!(sql_ident("P_0").as_deref(), Some("p_0"));
        assert_eq!(sql_ident("\"P_0\"").as_deref(), Some("P_0"));
        assert_eq!(sql_ident("\"a\"\"b\"").as_deref(), Some("a\"b"));
        for bad in ["", "\"\"", "\"a\"b\"", "x\";SET", "1a", "a-b", "\"open"] {
            assert_eq!(sql_ident(bad), None, "{bad}");
        }
        assert_eq!(
            quote_ident("pgw1_2_x\";SET x=1;--"),
            "\"pgw1_2_x\"\";SET x=1;--\""
        );
    }

    #[test]
    fn errors_name_statements_as_the_client_does() {
        let error = |m: &str| {
            let mut b = Vec::new();
            for (t, v) in [(b'S', "ERROR"), (b'C', "42P05"), (b'M', m)] {
                b.push(t);
                b.extend_from_slice(v.as_bytes());
                b.push(0);
            }
            b.push(0);
            b
        };
        use super::message;
        let renamed = |m: &str, client: u64| {
            super::client_names(&error(m), client).map(|msg| {
                let fields = message::error_fields(&msg[5..]).unwrap();
                assert_eq!(
                    msg.len() - 1,
                    u32::from_be_bytes(msg[1..5].try_into().unwrap()) as usize
                );
                message::find_field(&fields, b'M').unwrap().to_string()
            })
        };
        assert_eq!(
            renamed("prepared statement \"pgw7_12_s1\" already exists", 7).as_deref(),
            Some("prepared statement \"s1\" already exists")
        );
        assert_eq!(
            renamed("prepared statement \"pgw7u_nope\" does not exist", 7).as_deref(),
            Some("prepared statement \"nope\" does not exist")
        );
        // Names with underscores and digits of their own stay whole.
        assert_eq!(
            renamed("\"pgw7_3___asyncpg_stmt_2__\" and \"pgw7_4_a_1_b\"", 7).as_deref(),
            Some("\"__asyncpg_stmt_2__\" and \"a_1_b\"")
        );
        // Another client's, or no such name: left alone.
        assert_eq!(
            renamed("prepared statement \"pgw71_2_x\"", 7).as_deref(),
            Some("prepared statement \"pgw71_2_x\"")
        );
        assert_eq!(renamed("relation \"t\" does not exist", 7), None);
    }

    #[test]
    fn syncs_ignored_during_copy_in_are_not_waited_for() {
        use super::{Replies, TxStatus};
        // Extended protocol, as libpq sends it: Parse/Bind/Execute/Sync,
        // the server takes data, then CopyDone and Sync.
        let mut r = Replies {
            status: Some(TxStatus::Idle),
            ..Replies::default()
        };
        r.pending = 1;
        r.sent = 1;
        r.copy_in_started();
        assert!(!r.idle(), "the COPY is still running");
        assert_eq!((r.pending, r.done), (0, 1));
        assert!(r.open_batch);
        // A simple-protocol COPY keeps its Query pending.
        let mut q = Replies {
            status: Some(TxStatus::Idle),
            kinds: 1,
            pending: 1,
            ..Replies::default()
        };
        q.copy_in_started();
        assert_eq!((q.pending, q.open_batch, q.copy_in), (1, false, true));
        // Data sent before the server asked for it: nothing is forgotten.
        let mut early = Replies {
            pending: 2,
            copy_ended: true,
            ..Replies::default()
        };
        early.copy_in_started();
        assert_eq!((early.pending, early.copy_in), (2, false));
    }
}

#[cfg(test)]
mod read_tests {
    use super::{read_client, ClientStream};
    use bytes::BytesMut;
    use std::future::Future;
    use std::task::Poll;
    use tokio::io::AsyncWriteExt;

    /// Spends the current task's budget (tokio's cooperative scheduling);
    /// false if the task has none to spend.
    fn spend_budget(cx: &mut std::task::Context<'_>) -> bool {
        for _ in 0..10_000 {
            match tokio::task::coop::poll_proceed(cx) {
                Poll::Ready(c) => c.made_progress(),
                Poll::Pending => return true,
            }
        }
        false
    }

    #[tokio::test]
    async fn only_a_read_that_registered_its_waker_arms() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut peer = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let mut client = ClientStream::Plain(listener.accept().await.unwrap().0);
        let mut buf = BytesMut::new();
        let mut armed = false;
        // Nothing to read, budget left: the read registers, and arms.
        std::future::poll_fn(|cx| {
            let read = std::pin::pin!(read_client(&mut client, &mut buf, &mut armed));
            assert!(read.poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        assert!(armed);
        // With the budget spent the read is refused before it looks at the
        // socket and registers nothing: arming then would leave the task
        // asleep when bytes come.
        armed = false;
        std::future::poll_fn(|cx| {
            assert!(
                spend_budget(cx),
                "the test runs inside a task with a budget"
            );
            let read = std::pin::pin!(read_client(&mut client, &mut buf, &mut armed));
            assert!(read.poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        assert!(!armed, "a read refused for budget must not arm");
        // The read then gets the bytes once they come.
        peer.write_all(b"xyz").await.unwrap();
        let n = crate::timer::timeout(
            std::time::Duration::from_secs(10),
            read_client(&mut client, &mut buf, &mut armed),
        )
        .await
        .expect("the bytes are read")
        .unwrap();
        assert_eq!((n, &buf[..]), (3, &b"xyz"[..]));
        assert!(!armed);
    }
}
