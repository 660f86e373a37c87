//! [`EtcdDcs`]: the store operations on etcd v3.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, LeaseKeepAliveStream, LeaseKeeper,
    PutOptions, Txn, TxnOp, TxnResponse,
};
use serde_json::Value;
use tokio::sync::Mutex;

use crate::error::{DcsError, Result};
use crate::keys::{check_member, KeyLayout};
use crate::snapshot::{ClusterSnapshot, HistoryEntry, LeaseId, RawKv};
use crate::watch::{self, LeaderWatch, RequestWatch};

/// How often HTTP/2 pings probe a connection that carries a stream (a watch
/// or a keep-alive). etcd answers pings sent more often than every 5 s with
/// GOAWAY, so this stays well above that.
const PING_INTERVAL: Duration = Duration::from_secs(10);

/// How many times a read-modify-write retries after losing a race.
const CAS_ATTEMPTS: u32 = 5;

/// Open keep-alive streams by lease, reused so that a renewal is one round
/// trip on an existing stream instead of a new stream per renewal.
type Keepers = HashMap<LeaseId, (LeaseKeeper, LeaseKeepAliveStream)>;

/// The cluster's state in etcd, for one cluster under one namespace.
///
/// Cheap to clone; clones share the connection. Every method is bounded by
/// the `op_timeout` given to [`EtcdDcs::connect`] as a whole, retries
/// included: when it returns [`DcsError::Timeout`] etcd may still apply a
/// write that was sent, which is why every write that matters is a
/// compare-and-set whose outcome can be read back.
#[derive(Clone)]
pub struct EtcdDcs {
    /// Shared by every clone, so that [`EtcdDcs::reconnect`] reaches the
    /// API, the watches and the loop at once.
    client: Arc<arc_swap::ArcSwap<Client>>,
    keys: KeyLayout,
    op_timeout: Duration,
    keepers: Arc<Mutex<Keepers>>,
}

impl fmt::Debug for EtcdDcs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdDcs")
            .field("prefix", &self.keys.prefix())
            .field("op_timeout", &self.op_timeout)
            .finish_non_exhaustive()
    }
}

/// How the agent proves itself to etcd and checks etcd's certificate:
/// TLS (a CA, optionally a client certificate) and a user name and
/// password. The default is neither.
#[derive(Clone, Default)]
pub struct EtcdSecurity {
    /// PEM certificates of the CA that signed etcd's server certificates;
    /// set, the connection uses TLS (endpoints without a scheme become
    /// `https://`).
    pub ca_pem: Option<Vec<u8>>,
    /// PEM client certificate (chain) and private key, for etcd's
    /// `--client-cert-auth`.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// etcd user name and password (etcd's `auth enable`).
    pub user: Option<(String, String)>,
}

impl fmt::Debug for EtcdSecurity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdSecurity")
            .field("tls", &self.ca_pem.is_some())
            .field("client_certificate", &self.identity.is_some())
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish()
    }
}

impl EtcdDcs {
    /// Prepares a client for `endpoints` (`host:port` or `http://host:port`)
    /// and the cluster `cluster` under `namespace`
    /// ([`DEFAULT_NAMESPACE`](crate::DEFAULT_NAMESPACE) unless configured).
    ///
    /// Connections are made lazily, so this succeeds while etcd is down and
    /// fails only for invalid names or endpoints; the first operation then
    /// reports whether etcd answers.
    pub async fn connect(
        endpoints: &[String],
        namespace: &str,
        cluster: &str,
        op_timeout: Duration,
    ) -> Result<EtcdDcs> {
        Self::connect_with(
            endpoints,
            namespace,
            cluster,
            op_timeout,
            &EtcdSecurity::default(),
        )
        .await
    }

    /// [`connect`](Self::connect) with TLS and authentication. With a user
    /// the connection is not lazy: etcd must answer (and accept the
    /// password) for this to succeed.
    pub async fn connect_with(
        endpoints: &[String],
        namespace: &str,
        cluster: &str,
        op_timeout: Duration,
        security: &EtcdSecurity,
    ) -> Result<EtcdDcs> {
        let keys = KeyLayout::new(namespace, cluster)?;
        let client = new_client(endpoints, op_timeout, security).await?;
        Ok(EtcdDcs {
            client: Arc::new(arc_swap::ArcSwap::from_pointee(client)),
            keys,
            op_timeout,
            keepers: Arc::default(),
        })
    }

    /// Connects anew, to `endpoints` with `security` (a reloaded `[etcd]`:
    /// moved endpoints, renewed certificates, a rotated password), and
    /// switches every clone of this handle over once the connection stands;
    /// on error the old connection stays. Leases live in etcd, not in the
    /// connection, so the leader key and the members' keys are unaffected;
    /// a watch moves over when its stream next breaks.
    pub async fn reconnect(&self, endpoints: &[String], security: &EtcdSecurity) -> Result<()> {
        const OP: &str = "reconnect";
        let client = new_client(endpoints, self.op_timeout, security).await?;
        // A connection without a user is lazy: read one of the cluster's
        // keys through it first, so that a mistyped endpoint or a
        // certificate etcd refuses never replaces a working connection.
        let mut kv = client.kv_client();
        let key = self.keys.leader();
        self.bounded(OP, async move {
            kv.get(key, None).await.map_err(etcd(OP))?;
            Ok(())
        })
        .await?;
        self.client.store(Arc::new(client));
        // Keep-alive streams belong to the old connection.
        self.keepers.lock().await.clear();
        Ok(())
    }
}

/// A connected etcd client (lazy without a user, see
/// [`EtcdDcs::connect_with`]).
async fn new_client(
    endpoints: &[String],
    op_timeout: Duration,
    security: &EtcdSecurity,
) -> Result<Client> {
    if endpoints.is_empty() {
        return Err(DcsError::NoEndpoints);
    }
    // No per-request timeout in the channel: it would also cut the
    // long-lived watch stream. Each operation is bounded here instead.
    let mut options = ConnectOptions::new()
        .with_connect_timeout(op_timeout)
        .with_keep_alive(PING_INTERVAL, op_timeout.max(Duration::from_secs(1)));
    if let Some(ca) = &security.ca_pem {
        let mut tls =
            etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(ca));
        if let Some((cert, key)) = &security.identity {
            tls = tls.identity(etcd_client::Identity::from_pem(cert, key));
        }
        options = options.with_tls(tls);
    }
    if let Some((user, password)) = &security.user {
        // etcd's tokens expire (5 minutes by default): log in again
        // rather than fail every request from then on.
        options = options
            .with_user(user.clone(), password.clone())
            .with_auto_token_refresh(true);
    }
    bound("connect", op_timeout, async {
        Client::connect(endpoints, Some(options))
            .await
            .map_err(etcd("connect"))
    })
    .await
}

impl EtcdDcs {
    /// The keys of this cluster.
    pub fn keys(&self) -> &KeyLayout {
        &self.keys
    }

    /// The bound on every operation.
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// Claims the right to bootstrap the cluster by creating the
    /// `initialize` key with `sysid`, if no one has.
    ///
    /// Atomic: one transaction guarded by the key not existing, so of any
    /// number of concurrent callers exactly one gets `true`.
    pub async fn initialize_race(&self, sysid: &str) -> Result<bool> {
        let key = self.keys.initialize();
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, sysid, None)]);
        Ok(self.txn("initialize race", txn).await?.succeeded())
    }

    /// Gives up a won bootstrap race (the bootstrap failed), so another member
    /// may try. Deletes the `initialize` key only if it still holds `sysid`.
    pub async fn cancel_initialize(&self, sysid: &str) -> Result<bool> {
        let key = self.keys.initialize();
        let txn = Txn::new()
            .when([Compare::value(key.as_str(), CompareOp::Equal, sysid)])
            .and_then([TxnOp::delete(key, None)]);
        Ok(self.txn("cancel initialize", txn).await?.succeeded())
    }

    /// Replaces the `initialize` key's value `claim` with `sysid`, once the
    /// member that won the race with a placeholder knows the system
    /// identifier of the database it created. Atomic: only if the key still
    /// holds `claim`.
    pub async fn finish_initialize(&self, claim: &str, sysid: &str) -> Result<bool> {
        let key = self.keys.initialize();
        let txn = Txn::new()
            .when([Compare::value(key.as_str(), CompareOp::Equal, claim)])
            .and_then([TxnOp::put(key, sysid, None)]);
        Ok(self.txn("finish initialize", txn).await?.succeeded())
    }

    /// Creates a lease of `ttl`, rounded up to whole seconds. etcd may raise
    /// very short TTLs to its own minimum (about 2 s with default settings).
    pub async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId> {
        let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let secs = i64::try_from(secs)
            .ok()
            .filter(|s| *s > 0)
            .ok_or(DcsError::InvalidTtl(ttl))?;
        let mut client = self.client();
        self.bounded("lease grant", async move {
            let resp = client
                .lease_grant(secs, None)
                .await
                .map_err(etcd("lease grant"))?;
            Ok(LeaseId(resp.id()))
        })
        .await
    }

    /// Renews `lease` once and returns the TTL it now has left.
    ///
    /// Any error, timeout included, means the renewal cannot be counted on;
    /// [`DcsError::LeaseNotFound`] means the lease is gone for good and every
    /// key bound to it with it.
    pub async fn keep_alive_once(&self, lease: LeaseId) -> Result<Duration> {
        self.bounded("lease keep-alive", self.keep_alive_inner(lease))
            .await
    }

    /// Revokes `lease`, deleting every key bound to it at once; for a clean
    /// shutdown, so others need not wait out the TTL. Revoking a lease that
    /// is already gone succeeds.
    pub async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        self.keepers.lock().await.remove(&lease);
        let mut client = self.client();
        self.bounded("lease revoke", async move {
            match client.lease_revoke(lease.0).await {
                Ok(_) => Ok(()),
                Err(e) if is_lease_not_found(&e) => Ok(()),
                Err(e) => Err(etcd("lease revoke")(e)),
            }
        })
        .await
    }

    /// Stops keeping `lease`'s renewal stream, without revoking it: the
    /// lease runs out on its own, and keys moved off it meanwhile stay.
    pub async fn forget_lease(&self, lease: LeaseId) {
        self.keepers.lock().await.remove(&lease);
    }

    /// Takes the leader key for `name`, bound to `lease`, if no one holds it.
    ///
    /// Atomic: one transaction that writes only if the key does not exist, so
    /// of any number of concurrent callers at most one gets `true`.
    pub async fn acquire_leader(&self, name: &str, lease: LeaseId) -> Result<bool> {
        check_member(name)?;
        let key = self.keys.leader();
        let txn = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key,
                name,
                Some(PutOptions::new().with_lease(lease.0)),
            )]);
        Ok(self.txn("acquire leader", txn).await?.succeeded())
    }

    /// Renews `lease` and then checks, in one transaction, that the leader key
    /// still holds `name` bound to that same lease.
    ///
    /// `Ok(true)`: still the leader, with the lease's TTL restarted.
    /// `Ok(false)`: the key is gone, someone else's, or bound to another lease
    /// (a leftover of an earlier run); the caller is not the leader. An error
    /// means the answer is unknown, which the caller must treat as a failed
    /// renewal.
    pub async fn renew_leader(&self, name: &str, lease: LeaseId) -> Result<bool> {
        check_member(name)?;
        let key = self.keys.leader();
        self.bounded("renew leader", async {
            match self.keep_alive_inner(lease).await {
                Ok(_) => {}
                Err(DcsError::LeaseNotFound(_)) => return Ok(false),
                Err(e) => return Err(e),
            }
            let txn = Txn::new().when([
                Compare::value(key.as_str(), CompareOp::Equal, name),
                Compare::lease(key.as_str(), CompareOp::Equal, lease.0),
            ]);
            Ok(self.txn_inner("renew leader", txn).await?.succeeded())
        })
        .await
    }

    /// Runs `work` while renewing the leader key that `name` holds under
    /// `lease` every `every`, calling `renewed` after each renewal that
    /// worked with the moment it was sent (the lease runs from no earlier
    /// than that); returns what `work` returns.
    ///
    /// For work that must end before anyone else may lead, such as a
    /// leader stopping PostgreSQL for a switchover: the CHECKPOINT and the
    /// shutdown can outlast the lease, and a candidate promoted while the
    /// old primary still takes writes would make two primaries. A failed
    /// renewal is tried again at the next tick; once the key is found lost
    /// it is left alone.
    pub async fn hold_leader_while<T>(
        &self,
        name: &str,
        lease: LeaseId,
        every: Duration,
        mut renewed: impl FnMut(std::time::Instant),
        work: impl Future<Output = T>,
    ) -> T {
        let keep = async {
            loop {
                tokio::time::sleep(every).await;
                let sent = std::time::Instant::now();
                match self.renew_leader(name, lease).await {
                    Ok(true) => renewed(sent),
                    Ok(false) => {
                        tracing::warn!("the leader key was lost while its holder was busy");
                        return std::future::pending::<()>().await;
                    }
                    Err(e) => tracing::warn!(error = %e, "leader lease renewal failed"),
                }
            }
        };
        tokio::select! {
            out = work => out,
            () = keep => unreachable!("renewing never ends by itself"),
        }
    }

    /// Binds the leader key, held by `name` through lease `from`, to lease
    /// `to` instead, in one transaction: the key never disappears, so no
    /// one else can take it meanwhile. A new TTL comes into force this way.
    ///
    /// `Ok(true)`: the key now holds `name` bound to `to` (also when an
    /// earlier call whose answer was lost already moved it). `Ok(false)`:
    /// the key is gone or someone else's, or bound to another lease.
    pub async fn rebind_leader(&self, name: &str, from: LeaseId, to: LeaseId) -> Result<bool> {
        check_member(name)?;
        let key = self.keys.leader();
        let txn = Txn::new()
            .when([
                Compare::value(key.as_str(), CompareOp::Equal, name),
                Compare::lease(key.as_str(), CompareOp::Equal, from.0),
            ])
            .and_then([TxnOp::put(
                key.as_str(),
                name,
                Some(PutOptions::new().with_lease(to.0)),
            )]);
        if self.txn("rebind leader", txn).await?.succeeded() {
            return Ok(true);
        }
        let txn = Txn::new().when([
            Compare::value(key.as_str(), CompareOp::Equal, name),
            Compare::lease(key.as_str(), CompareOp::Equal, to.0),
        ]);
        Ok(self.txn("rebind leader", txn).await?.succeeded())
    }

    /// Deletes the leader key if it holds `name`, whichever lease it is bound
    /// to. Atomic (compare-and-delete), so it never removes a key another
    /// member took meanwhile. `Ok(false)`: the key was not `name`'s.
    pub async fn release_leader(&self, name: &str) -> Result<bool> {
        check_member(name)?;
        let key = self.keys.leader();
        let txn = Txn::new()
            .when([Compare::value(key.as_str(), CompareOp::Equal, name)])
            .and_then([TxnOp::delete(key, None)]);
        Ok(self.txn("release leader", txn).await?.succeeded())
    }

    /// The candidate's half of a switchover: takes the leader key for `to`,
    /// bound to the candidate's own `lease`, and consumes the request.
    ///
    /// The protocol, which never lets two members hold the key:
    /// 1. the operator (through any member's API) writes a `failover` request
    ///    naming the `candidate` and, for a switchover, the `from_leader`;
    /// 2. the old leader stops accepting writes, then deletes the leader key
    ///    with [`release_leader`](Self::release_leader);
    /// 3. the candidate calls this; other members do not try to acquire the
    ///    key while a request names someone else.
    ///
    /// The key is never handed from lease to lease: the candidate writes it
    /// only once it is absent, so the old leader can never renew a key the
    /// candidate holds, and the candidate never holds a key it cannot renew.
    ///
    /// Atomic: reads the request, then in one transaction requires that the
    /// leader key is absent and the request is unchanged since it was read,
    /// puts the key and deletes the request. `Ok(false)` if the request is
    /// missing, names another candidate, names a `from_leader` other than
    /// `from`, or changed meanwhile, or if the key is still held.
    pub async fn take_over_leader(&self, from: &str, to: &str, lease: LeaseId) -> Result<bool> {
        check_member(to)?;
        let leader = self.keys.leader();
        let failover = self.keys.failover();
        self.bounded("take over leader", async {
            let mut kv = self.client().kv_client();
            let resp = kv
                .get(failover.as_str(), None)
                .await
                .map_err(etcd("take over leader"))?;
            let Some(req) = resp.kvs().first() else {
                return Ok(false);
            };
            let request: Value =
                serde_json::from_slice(req.value()).map_err(|source| DcsError::Malformed {
                    key: failover.clone(),
                    source,
                })?;
            let candidate_ok = request.get("candidate").and_then(Value::as_str) == Some(to);
            let from_ok = match request.get("from_leader") {
                None | Some(Value::Null) => true,
                Some(v) => v.as_str() == Some(from),
            };
            if !candidate_ok || !from_ok {
                return Ok(false);
            }
            let txn = Txn::new()
                .when([
                    Compare::create_revision(leader.as_str(), CompareOp::Equal, 0),
                    Compare::mod_revision(failover.as_str(), CompareOp::Equal, req.mod_revision()),
                ])
                .and_then([
                    TxnOp::put(
                        leader.as_str(),
                        to,
                        Some(PutOptions::new().with_lease(lease.0)),
                    ),
                    TxnOp::delete(failover.as_str(), None),
                ]);
            Ok(self.txn_inner("take over leader", txn).await?.succeeded())
        })
        .await
    }

    /// Publishes `name`'s state, bound to `lease` so that it disappears when
    /// the member stops renewing. A plain put: each member writes only its
    /// own key.
    pub async fn publish_member(&self, name: &str, state: &Value, lease: LeaseId) -> Result<()> {
        let key = self.keys.member(name)?;
        let value = encode(&key, state)?;
        self.put(
            "publish member",
            key,
            value,
            Some(PutOptions::new().with_lease(lease.0)),
        )
        .await
    }

    /// Removes `name`'s published state, e.g. when it leaves the cluster.
    pub async fn delete_member(&self, name: &str) -> Result<()> {
        let key = self.keys.member(name)?;
        self.delete("delete member", key).await
    }

    /// Reads the whole cluster: one range read over the cluster's prefix (so
    /// every key is from one revision), then a TTL query for the leader's
    /// lease. Keys that do not decode are skipped and listed in
    /// [`ClusterSnapshot::malformed`] rather than failing the read.
    pub async fn read_cluster(&self) -> Result<ClusterSnapshot> {
        const OP: &str = "read cluster";
        let mut client = self.client();
        let prefix = self.keys.prefix().to_string();
        let keys = &self.keys;
        self.bounded(OP, async move {
            let resp = client
                .get(prefix, Some(GetOptions::new().with_prefix()))
                .await
                .map_err(etcd(OP))?;
            let revision = resp.header().map_or(0, |h| h.revision());
            let mut snap = ClusterSnapshot::from_kvs(
                keys,
                revision,
                resp.kvs().iter().map(|kv| RawKv {
                    key: kv.key(),
                    value: kv.value(),
                    lease: kv.lease(),
                    mod_revision: kv.mod_revision(),
                    create_revision: kv.create_revision(),
                }),
            );
            if let Some(leader) = snap.leader.as_mut().filter(|l| l.lease.0 != 0) {
                leader.ttl_left = match client.lease_time_to_live(leader.lease.0, None).await {
                    // etcd reports -1 for a lease that has just expired and
                    // whose keys are being deleted.
                    Ok(ttl) => Some(Duration::from_secs(u64::try_from(ttl.ttl()).unwrap_or(0))),
                    Err(e) if is_lease_not_found(&e) => Some(Duration::ZERO),
                    Err(e) => return Err(etcd(OP)(e)),
                };
            }
            Ok(snap)
        })
        .await
    }

    /// Follows the leader key: see [`LeaderWatch`]. The watch runs in a task
    /// of the current tokio runtime until the returned value is dropped.
    pub async fn watch_leader(&self) -> LeaderWatch {
        watch::spawn_leader(self.clone())
    }

    /// Follows the `failover` key, so that an agent learns of a switchover
    /// request written through another member's API at once rather than
    /// on its next loop. Runs like [`watch_leader`](Self::watch_leader).
    pub async fn watch_failover(&self) -> RequestWatch {
        watch::spawn_request(self.clone())
    }

    /// Replaces the dynamic settings unconditionally.
    pub async fn put_config(&self, config: &Value) -> Result<()> {
        let key = self.keys.config();
        let value = encode(&key, config)?;
        self.put("put config", key, value, None).await
    }

    /// Replaces the dynamic settings only if they have not changed since
    /// they were read at `revision` ([`ClusterSnapshot::config_revision`];
    /// zero: only if there are none). Atomic; `Ok(false)` on a conflict.
    pub async fn compare_and_put_config(&self, config: &Value, revision: i64) -> Result<bool> {
        let key = self.keys.config();
        let value = encode(&key, config)?;
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.as_str(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::put(key, value, None)]);
        Ok(self.txn("put config", txn).await?.succeeded())
    }

    /// Appends one promotion to the history.
    ///
    /// Atomic per attempt: read, append, and write back only if the key is
    /// unchanged since the read; concurrent appends are retried, so none is
    /// lost. Fails with [`DcsError::Conflict`] after repeated lost races and
    /// with [`DcsError::Malformed`] rather than overwrite a history it cannot
    /// read.
    pub async fn append_history(&self, entry: &HistoryEntry) -> Result<()> {
        const OP: &str = "append history";
        let key = self.keys.history();
        self.bounded(OP, async {
            let mut kv = self.client().kv_client();
            for _ in 0..CAS_ATTEMPTS {
                let resp = kv.get(key.as_str(), None).await.map_err(etcd(OP))?;
                let (mut history, revision) = match resp.kvs().first() {
                    Some(cur) => (
                        serde_json::from_slice::<Vec<HistoryEntry>>(cur.value()).map_err(
                            |source| DcsError::Malformed {
                                key: key.clone(),
                                source,
                            },
                        )?,
                        cur.mod_revision(),
                    ),
                    None => (Vec::new(), 0),
                };
                history.push(entry.clone());
                let value = encode(&key, &history)?;
                let txn = Txn::new()
                    .when([Compare::mod_revision(
                        key.as_str(),
                        CompareOp::Equal,
                        revision,
                    )])
                    .and_then([TxnOp::put(key.as_str(), value, None)]);
                if self.txn_inner(OP, txn).await?.succeeded() {
                    return Ok(());
                }
            }
            Err(DcsError::Conflict {
                key: key.clone(),
                attempts: CAS_ATTEMPTS,
            })
        })
        .await
    }

    /// Writes a switchover or failover request, replacing any pending one.
    pub async fn put_failover(&self, request: &Value) -> Result<()> {
        let key = self.keys.failover();
        let value = encode(&key, request)?;
        self.put("put failover", key, value, None).await
    }

    /// Deletes the pending request, if any (a cancelled or finished
    /// switchover).
    pub async fn delete_failover(&self) -> Result<()> {
        self.delete("delete failover", self.keys.failover()).await
    }

    /// The old leader's half of a switchover: deletes the leader key if it
    /// holds `name` and, in the same transaction, marks the request read at
    /// `revision` as released (`"released": true`), which tells the
    /// candidate that the key was handed over rather than lost. `Ok(false)`
    /// if the key is not `name`'s or the request changed or is gone; the
    /// key is then left alone.
    pub async fn hand_over_leader(&self, name: &str, revision: i64) -> Result<bool> {
        check_member(name)?;
        let leader = self.keys.leader();
        let failover = self.keys.failover();
        self.bounded("hand over leader", async {
            let mut kv = self.client().kv_client();
            let resp = kv
                .get(failover.as_str(), None)
                .await
                .map_err(etcd("hand over leader"))?;
            let Some(req) = resp.kvs().first().filter(|r| r.mod_revision() == revision) else {
                return Ok(false);
            };
            let mut request: Value =
                serde_json::from_slice(req.value()).map_err(|source| DcsError::Malformed {
                    key: failover.clone(),
                    source,
                })?;
            let Some(fields) = request.as_object_mut() else {
                return Ok(false);
            };
            fields.insert("released".into(), Value::Bool(true));
            let value = encode(&failover, &request)?;
            let txn = Txn::new()
                .when([
                    Compare::value(leader.as_str(), CompareOp::Equal, name),
                    Compare::mod_revision(failover.as_str(), CompareOp::Equal, revision),
                ])
                .and_then([
                    TxnOp::delete(leader.as_str(), None),
                    TxnOp::put(failover.as_str(), value, None),
                ]);
            Ok(self.txn_inner("hand over leader", txn).await?.succeeded())
        })
        .await
    }

    /// Deletes the pending request only if it is the one read at
    /// `revision` ([`ClusterSnapshot::failover_revision`]), so a request
    /// written meanwhile survives. Atomic; `Ok(false)` if the key changed
    /// or is gone.
    pub async fn delete_failover_if(&self, revision: i64) -> Result<bool> {
        let key = self.keys.failover();
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.as_str(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::delete(key, None)]);
        Ok(self.txn("delete failover", txn).await?.succeeded())
    }

    /// Publishes the leader's WAL position, but only while the leader key
    /// holds `leader`, so a deposed leader cannot overwrite its successor's.
    /// Atomic; `Ok(false)` if `leader` does not hold the key.
    pub async fn put_status(&self, leader: &str, status: &Value) -> Result<bool> {
        let key = self.keys.status();
        self.put_as_leader("put status", leader, key, status).await
    }

    /// Publishes the synchronous replication state, under the same guard as
    /// [`put_status`](Self::put_status).
    pub async fn put_sync(&self, leader: &str, sync: &Value) -> Result<bool> {
        let key = self.keys.sync();
        self.put_as_leader("put sync", leader, key, sync).await
    }

    async fn put_as_leader(
        &self,
        op: &'static str,
        leader: &str,
        key: String,
        value: &Value,
    ) -> Result<bool> {
        check_member(leader)?;
        let value = encode(&key, value)?;
        let txn = Txn::new()
            .when([Compare::value(self.keys.leader(), CompareOp::Equal, leader)])
            .and_then([TxnOp::put(key, value, None)]);
        Ok(self.txn(op, txn).await?.succeeded())
    }

    async fn put(
        &self,
        op: &'static str,
        key: String,
        value: Vec<u8>,
        options: Option<PutOptions>,
    ) -> Result<()> {
        let mut kv = self.client().kv_client();
        self.bounded(op, async move {
            kv.put(key, value, options).await.map_err(etcd(op))?;
            Ok(())
        })
        .await
    }

    async fn delete(&self, op: &'static str, key: String) -> Result<()> {
        let mut kv = self.client().kv_client();
        self.bounded(op, async move {
            kv.delete(key, None).await.map_err(etcd(op))?;
            Ok(())
        })
        .await
    }

    async fn txn(&self, op: &'static str, txn: Txn) -> Result<TxnResponse> {
        self.bounded(op, self.txn_inner(op, txn)).await
    }

    async fn txn_inner(&self, op: &'static str, txn: Txn) -> Result<TxnResponse> {
        self.client().kv_client().txn(txn).await.map_err(etcd(op))
    }

    /// One renewal, unbounded (callers bound it). The stream is taken out of
    /// the cache while in use and put back only after a complete exchange:
    /// a renewal cut short by a time-out would otherwise leave its late
    /// answer in the stream, to be mistaken for the next renewal's.
    async fn keep_alive_inner(&self, lease: LeaseId) -> Result<Duration> {
        const OP: &str = "lease keep-alive";
        let cached = self.keepers.lock().await.remove(&lease);
        let (mut keeper, mut stream) = match cached {
            Some(pair) => pair,
            None => match self.client().lease_client().keep_alive(lease.0).await {
                Ok(pair) => pair,
                Err(e) if is_lease_not_found(&e) => return Err(DcsError::LeaseNotFound(lease)),
                Err(e) => return Err(etcd(OP)(e)),
            },
        };
        // Opening the stream renewed once already but does not report the
        // TTL, so a new stream costs one extra renewal; later ones do not.
        keeper.keep_alive().await.map_err(etcd(OP))?;
        let resp = stream.message().await.map_err(etcd(OP))?.ok_or_else(|| {
            etcd(OP)(etcd_client::Error::LeaseKeepAliveError(
                "keep-alive stream closed".into(),
            ))
        })?;
        let ttl = u64::try_from(resp.ttl()).unwrap_or(0);
        if ttl == 0 {
            return Err(DcsError::LeaseNotFound(lease));
        }
        self.keepers.lock().await.insert(lease, (keeper, stream));
        Ok(Duration::from_secs(ttl))
    }

    pub(crate) async fn bounded<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        bound(op, self.op_timeout, fut).await
    }

    pub(crate) fn client(&self) -> Client {
        Client::clone(&self.client.load())
    }
}

async fn bound<T>(
    op: &'static str,
    after: Duration,
    fut: impl Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(after, fut)
        .await
        .unwrap_or(Err(DcsError::Timeout { op, after }))
}

pub(crate) fn etcd(op: &'static str) -> impl FnOnce(etcd_client::Error) -> DcsError {
    move |source| DcsError::Etcd { op, source }
}

fn encode<T: serde::Serialize>(key: &str, value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|source| DcsError::Malformed {
        key: key.into(),
        source,
    })
}

/// etcd reports an unknown lease as a gRPC error on some calls and the
/// client library as its own error on keep-alive; both mean the same.
fn is_lease_not_found(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => s.message().contains("lease not found"),
        etcd_client::Error::LeaseKeepAliveError(m) => m.contains("lease not found"),
        _ => false,
    }
}
