//! Protection modes: how much acknowledged data a failover may lose, and
//! how the leader keeps its synchronous standbys so that the answer holds.
//!
//! # The claim and the invariant
//!
//! The `sync` key is a *claim* about every commit acknowledged to a client
//! so far: **each one is held by at least `quorum` of the listed
//! `members`** ([`Claim`]). With `FIRST n (...)` every listed standby
//! acknowledges each commit, so `quorum` is the whole list; with
//! `sync_method = "quorum"`, `ANY k (s1, ..., sm)` lists every eligible
//! standby and `quorum` is k. A key without `quorum` (written before it
//! existed) claims the whole list.
//!
//! The election trusts the claim: while the cluster runs synchronously, a
//! member may be promoted automatically only if it is listed and, having
//! seen the WAL positions of at least m − quorum + 1 listed members (itself
//! included), it is the most advanced of them. Any `quorum` members holding
//! a commit and any m − quorum + 1 members share at least one member, so
//! the most advanced of those seen holds every acknowledged commit
//! ([`crate::election`]). For `FIRST` that is one member, itself: every
//! listed standby qualifies, as before quorum existed.
//!
//! The invariant every step keeps: **the published claim holds for every
//! commit acknowledged so far, and for every commit PostgreSQL can still
//! acknowledge under what it was last told** (`synchronous_standby_names`,
//! the *applied* configuration `(T, n)`, itself a claim: commits it
//! acknowledges are on n of T). A claim (S, q) implies a claim (U, r) when
//! r ≤ q − |S \ U|: copies outside U do not count ([`Claim::implies`]).
//!
//! # The order of each change
//!
//! Moving from the applied `(A, a)` and published `P` to a wanted
//! `(T, n)`, the leader takes one step at a time:
//!
//! 1. **Weaken the key first if PostgreSQL's next rule would not uphold
//!    it.** Commits acknowledged after the change are only known to be on n
//!    of T, so if `(T, n)` does not imply P, the key is first replaced by the
//!    strongest claim that both P (for commits so far) and `(T, n)` (for
//!    commits to come) imply.
//! 2. **Then change PostgreSQL**, and note the leader's WAL position L once
//!    the change is in effect: every commit acknowledged under the old rule
//!    lies before L.
//! 3. **Strengthen the key last, once the past is covered**: `(T, n)` is
//!    published only when P already implies it, or when at least n members
//!    of T have flushed WAL up to L (so every earlier commit is on n of T
//!    too).
//!
//! What that gives, case by case:
//!
//! * `FIRST`, a standby joins (`{a}` to `{a, b}`): PostgreSQL first, the key
//!   once b has caught up with L: a listed member must hold *every* commit.
//! * `FIRST`, a standby leaves (`{a, b}` to `{a}`): the key first (a alone
//!   still holds everything), then PostgreSQL.
//! * Quorum, the set grows (`ANY 1 (a, b)` to `ANY 1 (a, b, c)`): the
//!   **key first**. Under the new rule a commit may be on c alone, which a
//!   key listing only a and b would hide from the election; listing c
//!   before PostgreSQL counts its acknowledgements costs nothing, since c
//!   need not hold anything for the claim to stay true.
//! * Quorum, the set shrinks (`ANY 1 (a, b, c)` to `ANY 1 (a, b)`):
//!   **PostgreSQL first**, and the key only once a or b has flushed up to
//!   L: an earlier commit may have been acknowledged by c alone. Until then
//!   the key still lists c, and an election would need c's position too.
//! * Degrading (maximum availability, no standby left): the key records it
//!   first (no claim at all), then PostgreSQL stops waiting.
//! * Maximum protection with no standby at all, a new cluster included:
//!   PostgreSQL waits for [`NO_STANDBY`], a name no member can have, so no
//!   commit is acknowledged until a real standby is listed; the key says
//!   so (synchronous, blocked).
//!
//! Not `*`, which Patroni's strict mode uses: any standby (a `nosync` one,
//! a `pg_basebackup` streaming WAL) could then acknowledge commits that the
//! standby listed next lacks.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What a failover may cost in acknowledged writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protection {
    /// Asynchronous replication; failover candidates are bounded by
    /// `maximum_lag_on_failover`, and what they lack is lost.
    #[default]
    MaximumPerformance,
    /// Synchronous replication while a standby is there to acknowledge;
    /// without one the leader records that it runs asynchronously, then
    /// keeps serving writes.
    MaximumAvailability,
    /// Synchronous replication, always: without a standby, commits wait.
    MaximumProtection,
}

impl Protection {
    /// Whether the leader manages synchronous standbys at all.
    pub fn synchronous(self) -> bool {
        self != Protection::MaximumPerformance
    }
}

impl fmt::Display for Protection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protection::MaximumPerformance => "maximum_performance",
            Protection::MaximumAvailability => "maximum_availability",
            Protection::MaximumProtection => "maximum_protection",
        })
    }
}

/// How the names are written into `synchronous_standby_names`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMethod {
    /// `FIRST n (...)`.
    #[default]
    First,
    /// `ANY n (...)`.
    Quorum,
}

/// The protection settings of a cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncSettings {
    /// The mode.
    pub protection: Protection,
    /// How many standbys acknowledge each commit (at most).
    pub count: usize,
    /// `FIRST` or `ANY`.
    pub method: SyncMethod,
    /// In maximum availability, how long commits may wait with no
    /// acknowledging standby before the leader degrades to asynchronous
    /// replication (zero: at once). Ignored in the other modes.
    pub degrade_after: Duration,
}

impl Default for SyncSettings {
    fn default() -> Self {
        SyncSettings {
            protection: Protection::MaximumPerformance,
            count: 1,
            method: SyncMethod::First,
            degrade_after: Duration::ZERO,
        }
    }
}

/// The name `synchronous_standby_names` lists in maximum protection while
/// no standby can be: member names never contain `/`, so no standby ever
/// matches it and commits wait.
pub const NO_STANDBY: &str = "pgwarden/none";

/// The `sync` key: the leader's synchronous replication state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SyncState {
    /// The leader that wrote it; a state left by an earlier leader says
    /// nothing about the current one.
    pub leader: String,
    /// Whether the cluster runs in a synchronous mode.
    pub synchronous: bool,
    /// Standbys among which every acknowledged commit is held `quorum`
    /// times: while `synchronous` and not degraded, the only members that
    /// may be promoted automatically.
    pub members: Vec<String>,
    /// How many of `members` hold each acknowledged commit; absent (a key
    /// written before quorum commit existed): all of them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quorum: Option<usize>,
    /// Since when (Unix ms) the leader runs asynchronously for want of a
    /// standby, in maximum availability.
    pub degraded_since_ms: Option<u64>,
    /// Since when (Unix ms) commits wait with no acknowledging standby.
    pub blocked_since_ms: Option<u64>,
}

impl SyncState {
    /// Whether promotion is restricted to [`SyncState::members`].
    pub fn restricts_promotion(&self) -> bool {
        self.synchronous && self.degraded_since_ms.is_none()
    }

    /// The claim this state makes.
    pub fn claim(&self) -> Claim {
        if !self.restricts_promotion() {
            return Claim::none();
        }
        Claim::new(
            self.members.clone(),
            self.quorum.unwrap_or(self.members.len()),
        )
    }
}

/// "Every acknowledged commit is held by at least `quorum` of `members`."
/// A quorum of zero claims nothing, and lets nobody be promoted while the
/// cluster runs synchronously.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claim {
    /// The standbys.
    pub members: Vec<String>,
    /// How many of them hold each commit, at most `members.len()`.
    pub quorum: usize,
}

impl Claim {
    /// A claim, with the quorum capped at the number of members; a claim
    /// of nothing lists nobody.
    pub fn new(members: Vec<String>, quorum: usize) -> Claim {
        let quorum = quorum.min(members.len());
        if quorum == 0 {
            return Claim::none();
        }
        Claim { members, quorum }
    }

    /// The claim of nothing.
    pub fn none() -> Claim {
        Claim::default()
    }

    /// How many listed members' positions an election must see to know
    /// which of them holds every acknowledged commit: any `quorum` members
    /// and any `members − quorum + 1` share one. `None` for a claim of
    /// nothing, after which no member can be shown to hold everything.
    pub fn needed(&self) -> Option<usize> {
        (self.quorum > 0).then(|| self.members.len() - self.quorum + 1)
    }

    /// Whether this claim being true makes `weaker` true: every set of
    /// `quorum` members keeps at least `weaker.quorum` within
    /// `weaker.members`, however many of its members are not there.
    pub fn implies(&self, weaker: &Claim) -> bool {
        if weaker.quorum == 0 {
            return true;
        }
        let outside = self
            .members
            .iter()
            .filter(|m| !weaker.members.contains(m))
            .count();
        self.quorum >= outside + weaker.quorum
    }

    /// The strongest claim both `a` and `b` imply, for a key that must
    /// stay true across a change from one to the other. Among the
    /// candidate member sets (both lists, either, their overlap) it prefers
    /// one an election can satisfy while the most members are missing; when
    /// one of the two implies the other, that is the other.
    pub fn common(a: &Claim, b: &Claim) -> Claim {
        let union: Vec<String> = a
            .members
            .iter()
            .chain(b.members.iter().filter(|m| !a.members.contains(m)))
            .cloned()
            .collect();
        let overlap: Vec<String> = a
            .members
            .iter()
            .filter(|m| b.members.contains(m))
            .cloned()
            .collect();
        let within = |c: &Claim, u: &[String]| {
            let outside = c.members.iter().filter(|m| !u.contains(m)).count();
            c.quorum.saturating_sub(outside)
        };
        [union, b.members.clone(), a.members.clone(), overlap]
            .into_iter()
            .map(|u| {
                let q = within(a, &u).min(within(b, &u));
                Claim::new(u, q)
            })
            .filter(|c| c.quorum > 0)
            // An election succeeds with up to quorum − 1 listed members
            // missing: the largest quorum first, then the shortest list
            // (members not listed cannot be missing).
            .min_by_key(|c| (std::cmp::Reverse(c.quorum), c.members.len()))
            .unwrap_or_else(Claim::none)
    }

    fn same_as(&self, other: &Claim) -> bool {
        self.quorum == other.quorum && same_set(&self.members, &other.members)
    }
}

fn same_set(a: &[String], b: &[String]) -> bool {
    a.len() == b.len() && a.iter().all(|m| b.contains(m))
}

/// What `synchronous_standby_names` makes PostgreSQL wait for: `num` of
/// `names`. Nothing (asynchronous) when `num` is zero.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncConfig {
    /// The standbys named.
    pub names: Vec<String>,
    /// How many of them acknowledge each commit.
    pub num: usize,
}

impl SyncConfig {
    /// Asynchronous replication.
    pub fn none() -> SyncConfig {
        SyncConfig::default()
    }

    /// Commits wait for a standby that cannot exist.
    pub fn blocked() -> SyncConfig {
        SyncConfig {
            names: vec![NO_STANDBY.to_string()],
            num: 1,
        }
    }

    /// Whether commits are acknowledged without any standby.
    pub fn is_async(&self) -> bool {
        self.num == 0 || self.names.is_empty()
    }

    /// Whether this is [`SyncConfig::blocked`].
    pub fn is_blocked(&self) -> bool {
        self.names.iter().any(|n| n == NO_STANDBY)
    }

    /// What PostgreSQL guarantees for each commit it acknowledges under
    /// this configuration; `None` when it acknowledges none at all
    /// (blocked), which upholds any claim.
    fn claim(&self) -> Option<Claim> {
        (!self.is_blocked()).then(|| Claim::new(self.names.clone(), self.num))
    }

    /// The `synchronous_standby_names` value, empty for none.
    pub fn standby_names(&self, method: SyncMethod) -> String {
        if self.is_async() {
            return String::new();
        }
        let names: Vec<String> = self
            .names
            .iter()
            .map(|m| format!("\"{}\"", m.replace('"', "\"\"")))
            .collect();
        let keyword = match method {
            SyncMethod::First => "FIRST",
            SyncMethod::Quorum => "ANY",
        };
        format!("{keyword} {} ({})", self.num, names.join(", "))
    }

    fn same_as(&self, other: &SyncConfig) -> bool {
        self.num == other.num && same_set(&self.names, &other.names)
    }
}

/// What the leader wants PostgreSQL to wait for, given the standbys that
/// may acknowledge commits (`candidates`, best first) and what it applied
/// last: `FIRST` keeps the standbys already waited for and fills up to
/// `count` from the best of the rest; quorum lists every candidate and
/// waits for `count` of them (all, if fewer); with no candidate, maximum
/// protection waits for [`NO_STANDBY`] and the other modes for nobody.
pub fn wanted_config(
    settings: &SyncSettings,
    applied: &SyncConfig,
    candidates: &[String],
) -> SyncConfig {
    let count = settings.count.max(1);
    if !settings.protection.synchronous() {
        return SyncConfig::none();
    }
    let names: Vec<String> = match settings.method {
        SyncMethod::First => {
            let mut t: Vec<String> = applied
                .names
                .iter()
                .filter(|m| candidates.contains(m))
                .cloned()
                .collect();
            for c in candidates {
                if t.len() >= count {
                    break;
                }
                if !t.contains(c) {
                    t.push(c.clone());
                }
            }
            t.truncate(count);
            t
        }
        SyncMethod::Quorum => {
            let mut t = candidates.to_vec();
            // A stable order, so a reordering is no change.
            t.sort();
            t.dedup();
            t
        }
    };
    if names.is_empty() {
        return if settings.protection == Protection::MaximumProtection {
            SyncConfig::blocked()
        } else {
            SyncConfig::none()
        };
    }
    let num = match settings.method {
        SyncMethod::First => names.len(),
        SyncMethod::Quorum => count.min(names.len()),
    };
    SyncConfig { names, num }
}

/// What the leader observes of its own replication.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncObservation {
    /// What PostgreSQL was last told to wait for by this agent.
    pub applied: SyncConfig,
    /// The leader's WAL position once `applied` was in effect: every commit
    /// acknowledged under an earlier configuration lies before it. `None`
    /// until it has been read.
    pub applied_at: Option<u64>,
    /// Members streaming from this leader that may be synchronous (not
    /// tagged `nosync`), best first.
    pub candidates: Vec<String>,
    /// How far each streaming standby has flushed WAL.
    pub flushed: Vec<(String, u64)>,
    /// How long commits have had too few standbys to acknowledge them,
    /// while PostgreSQL waits for some.
    pub blocked_for: Option<Duration>,
}

impl SyncObservation {
    /// Whether at least `n` of `names` have flushed up to `applied_at`.
    fn covered(&self, names: &[String], n: usize) -> bool {
        let Some(at) = self.applied_at else {
            return n == 0;
        };
        let caught_up = names
            .iter()
            .filter(|m| self.flushed.iter().any(|(f, lsn)| f == *m && *lsn >= at))
            .count();
        caught_up >= n
    }
}

/// One step towards the wanted synchronous replication; the leader takes
/// one per loop until it gets [`SyncStep::Nothing`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SyncStep {
    /// In line with the settings.
    Nothing,
    /// Write the `sync` key.
    Publish {
        /// The standbys listed.
        members: Vec<String>,
        /// How many of them hold each acknowledged commit.
        quorum: usize,
        /// Record asynchronous operation (maximum availability without a
        /// standby).
        degraded: bool,
    },
    /// Make PostgreSQL wait as given.
    Apply(SyncConfig),
}

impl SyncStep {
    fn publish(claim: Claim, degraded: bool) -> SyncStep {
        SyncStep::Publish {
            members: claim.members,
            quorum: claim.quorum,
            degraded,
        }
    }
}

/// The next step for the leader, from the published state (`None` if the
/// key is missing or another leader's) and what it observes; see the
/// module documentation for the order of steps.
pub fn plan_sync(
    settings: &SyncSettings,
    published: Option<&SyncState>,
    obs: &SyncObservation,
) -> SyncStep {
    let current = published.map_or_else(Claim::none, SyncState::claim);
    if !settings.protection.synchronous() {
        let clear = published.is_some_and(|p| !p.synchronous && p.members.is_empty());
        let stale = !clear;
        return if stale {
            SyncStep::publish(Claim::none(), false)
        } else if !obs.applied.is_async() {
            SyncStep::Apply(SyncConfig::none())
        } else {
            SyncStep::Nothing
        };
    }
    let degraded = published.is_some_and(|p| p.degraded_since_ms.is_some());
    let listed = published.is_some_and(|p| p.synchronous);
    let mut wanted = wanted_config(settings, &obs.applied, &obs.candidates);
    if wanted.is_async() {
        // Maximum availability with nobody to acknowledge: degrade once
        // commits have waited long enough (at once if they wait for
        // nobody), recorded before PostgreSQL stops waiting.
        let may_degrade =
            obs.applied.is_async() || obs.blocked_for.is_some_and(|b| b >= settings.degrade_after);
        if !may_degrade {
            return SyncStep::Nothing;
        }
        return if !degraded {
            SyncStep::publish(Claim::none(), true)
        } else if !obs.applied.is_async() {
            SyncStep::Apply(SyncConfig::none())
        } else {
            SyncStep::Nothing
        };
    }
    if wanted.is_blocked() && !obs.applied.is_async() {
        // Strict mode with nobody left: commits already wait for the
        // standbys PostgreSQL was told about, who still hold everything
        // acknowledged; keep them rather than churn.
        wanted = obs.applied.clone();
    }
    if !wanted.same_as(&obs.applied) {
        // Commits acknowledged under the new rule must uphold the key.
        return match wanted.claim() {
            Some(next) if !next.implies(&current) => {
                SyncStep::publish(Claim::common(&current, &next), false)
            }
            _ => SyncStep::Apply(wanted),
        };
    }
    // PostgreSQL is in line; bring the key there, strengthening it only
    // once the commits acknowledged before the change are covered.
    let target = match wanted.claim() {
        Some(c) => c,
        // Blocked: nothing more is acknowledged, so the key stays what it
        // is, but it must say the cluster runs synchronously.
        None => current.clone(),
    };
    let in_line = listed && !degraded && current.same_as(&target);
    if in_line {
        return SyncStep::Nothing;
    }
    if current.implies(&target) || obs.covered(&target.members, target.quorum) {
        SyncStep::publish(target, false)
    } else if !listed {
        // A new leader says at once that it runs synchronously (its
        // connection managers wait for that), claiming nothing until the
        // standbys have caught up. A degraded key may stay until then: it
        // claims nothing either.
        SyncStep::publish(Claim::none(), false)
    } else {
        SyncStep::Nothing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn claim(members: &[&str], quorum: usize) -> Claim {
        Claim::new(names(members), quorum)
    }

    fn config(v: &[&str], num: usize) -> SyncConfig {
        SyncConfig {
            names: names(v),
            num,
        }
    }

    fn settings(p: Protection, method: SyncMethod, count: usize) -> SyncSettings {
        SyncSettings {
            protection: p,
            count,
            method,
            ..SyncSettings::default()
        }
    }

    fn first(p: Protection) -> SyncSettings {
        settings(p, SyncMethod::First, 1)
    }

    fn state(members: &[&str], quorum: Option<usize>) -> SyncState {
        SyncState {
            leader: "n1".into(),
            synchronous: true,
            members: names(members),
            quorum,
            ..SyncState::default()
        }
    }

    /// PostgreSQL applied `applied` (in effect at WAL position 100) with
    /// `candidates` streaming, each flushed to the given position.
    fn obs(applied: SyncConfig, candidates: &[(&str, u64)]) -> SyncObservation {
        SyncObservation {
            applied,
            applied_at: Some(100),
            candidates: candidates.iter().map(|(n, _)| n.to_string()).collect(),
            flushed: candidates
                .iter()
                .map(|(n, l)| (n.to_string(), *l))
                .collect(),
            blocked_for: None,
        }
    }

    fn publish(members: &[&str], quorum: usize) -> SyncStep {
        SyncStep::Publish {
            members: names(members),
            quorum,
            degraded: false,
        }
    }

    #[test]
    fn a_claim_implies_another_when_enough_copies_stay_inside_it() {
        let cases = [
            // (strong, weak, implied)
            (claim(&["a", "b"], 2), claim(&["a"], 1), true),
            (claim(&["a", "b"], 2), claim(&["a", "b"], 1), true),
            (claim(&["a", "b"], 1), claim(&["a", "b", "c"], 1), true),
            (claim(&["a", "b", "c"], 1), claim(&["a", "b"], 1), false),
            (claim(&["a", "b", "c"], 2), claim(&["a", "b"], 1), true),
            (claim(&["a", "b", "c"], 2), claim(&["a", "b"], 2), false),
            (claim(&["a"], 1), claim(&["a", "b"], 2), false),
            (claim(&["a"], 1), claim(&["b"], 1), false),
            (Claim::none(), claim(&["a"], 1), false),
            (Claim::none(), Claim::none(), true),
            (claim(&["a"], 1), Claim::none(), true),
        ];
        for (strong, weak, want) in cases {
            assert_eq!(strong.implies(&weak), want, "{strong:?} => {weak:?}");
        }
        // Quorum is capped, and zero lists nobody.
        assert_eq!(claim(&["a"], 3), claim(&["a"], 1));
        assert_eq!(claim(&["a", "b"], 0), Claim::none());
    }

    #[test]
    fn an_election_needs_members_minus_quorum_plus_one_positions() {
        assert_eq!(claim(&["a", "b"], 2).needed(), Some(1), "FIRST: itself");
        assert_eq!(claim(&["a", "b"], 1).needed(), Some(2));
        assert_eq!(claim(&["a", "b", "c"], 2).needed(), Some(2));
        assert_eq!(claim(&["a", "b", "c"], 1).needed(), Some(3));
        assert_eq!(Claim::none().needed(), None);
        // A key written before quorum existed claims all its members.
        assert_eq!(state(&["a", "b"], None).claim(), claim(&["a", "b"], 2));
        let degraded = SyncState {
            degraded_since_ms: Some(1),
            ..state(&["a"], Some(1))
        };
        assert_eq!(degraded.claim(), Claim::none());
        let v: SyncState = serde_json::from_str(r#"{"synchronous":true,"members":["a"]}"#).unwrap();
        assert_eq!(v.quorum, None);
        assert!(!serde_json::to_string(&v).unwrap().contains("quorum"));
    }

    #[test]
    fn the_claim_across_a_change_is_implied_by_both_sides() {
        let cases = [
            // A FIRST standby leaving: the one left alone.
            (claim(&["a", "b"], 2), claim(&["a"], 1), claim(&["a"], 1)),
            // A quorum growing: everyone, the smaller quorum.
            (
                claim(&["a", "b"], 1),
                claim(&["a", "b", "c"], 1),
                claim(&["a", "b", "c"], 1),
            ),
            // Growing FIRST 2 into ANY 2 of three: the new rule's claim
            // holds for the past too.
            (
                claim(&["a", "b"], 2),
                claim(&["a", "b", "c"], 2),
                claim(&["a", "b", "c"], 2),
            ),
            // Shrinking ANY 2 of three to both of two: the old claim, which
            // the new rule upholds.
            (
                claim(&["a", "b", "c"], 2),
                claim(&["a", "b"], 2),
                claim(&["a", "b", "c"], 2),
            ),
            // Nothing in common.
            (claim(&["a"], 1), claim(&["b"], 1), claim(&["a", "b"], 1)),
            (Claim::none(), claim(&["a"], 1), Claim::none()),
        ];
        for (a, b, want) in cases {
            let c = Claim::common(&a, &b);
            assert!(c.same_as(&want), "{a:?} / {b:?}: {c:?}");
            assert!(a.implies(&c) && b.implies(&c), "{a:?} / {b:?}: {c:?}");
        }
    }

    #[test]
    fn the_common_claim_is_implied_by_both_for_every_small_pair() {
        let all = ["a", "b", "c", "d"];
        let claims: Vec<Claim> = (1..16u32)
            .flat_map(|mask| {
                let members: Vec<&str> = all
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, m)| *m)
                    .collect();
                (0..=members.len()).map(move |q| claim(&members, q))
            })
            .collect();
        for a in &claims {
            for b in &claims {
                let c = Claim::common(a, b);
                assert!(a.implies(&c) && b.implies(&c), "{a:?} / {b:?}: {c:?}");
                // Nothing is lost when one side already implies the other.
                if a.implies(b) {
                    assert!(c.implies(b) || b.quorum == 0, "{a:?} / {b:?}: {c:?}");
                }
            }
        }
    }

    #[test]
    fn wanted_standbys_by_method_and_mode() {
        let p = Protection::MaximumProtection;
        let cand = names(&["n4", "n2", "n3"]);
        // FIRST keeps the standby already waited for, fills from the best.
        assert_eq!(
            wanted_config(
                &settings(p, SyncMethod::First, 2),
                &config(&["n3"], 1),
                &cand
            ),
            config(&["n3", "n4"], 2)
        );
        // Quorum lists everyone, sorted, and waits for k of them.
        assert_eq!(
            wanted_config(
                &settings(p, SyncMethod::Quorum, 1),
                &SyncConfig::none(),
                &cand
            ),
            config(&["n2", "n3", "n4"], 1)
        );
        assert_eq!(
            wanted_config(
                &settings(p, SyncMethod::Quorum, 2),
                &SyncConfig::none(),
                &cand
            ),
            config(&["n2", "n3", "n4"], 2)
        );
        // k is at most the number of standbys.
        assert_eq!(
            wanted_config(
                &settings(p, SyncMethod::Quorum, 3),
                &SyncConfig::none(),
                &names(&["n2"])
            ),
            config(&["n2"], 1)
        );
        // Nobody: strict mode blocks, the others do not wait.
        assert_eq!(
            wanted_config(&first(p), &SyncConfig::none(), &[]),
            SyncConfig::blocked()
        );
        assert_eq!(
            wanted_config(
                &first(Protection::MaximumAvailability),
                &SyncConfig::none(),
                &[]
            ),
            SyncConfig::none()
        );
        assert_eq!(
            wanted_config(
                &first(Protection::MaximumPerformance),
                &SyncConfig::none(),
                &cand
            ),
            SyncConfig::none()
        );
    }

    #[test]
    fn standby_names_as_postgresql_reads_them() {
        assert_eq!(SyncConfig::none().standby_names(SyncMethod::First), "");
        assert_eq!(
            config(&["n2", "a\"b"], 2).standby_names(SyncMethod::First),
            "FIRST 2 (\"n2\", \"a\"\"b\")"
        );
        assert_eq!(
            config(&["n2", "n3"], 1).standby_names(SyncMethod::Quorum),
            "ANY 1 (\"n2\", \"n3\")"
        );
        assert_eq!(
            SyncConfig::blocked().standby_names(SyncMethod::First),
            "FIRST 1 (\"pgwarden/none\")"
        );
        assert!(SyncConfig::blocked().is_blocked() && !SyncConfig::blocked().is_async());
    }

    #[test]
    fn first_a_new_standby_is_waited_for_before_it_is_listed() {
        let s = first(Protection::MaximumAvailability);
        let mut degraded = state(&[], Some(0));
        degraded.degraded_since_ms = Some(1);
        // PostgreSQL first.
        assert_eq!(
            plan_sync(&s, Some(&degraded), &obs(SyncConfig::none(), &[("n2", 0)])),
            SyncStep::Apply(config(&["n2"], 1))
        );
        // Listed only once it has flushed past the change.
        let waiting = obs(config(&["n2"], 1), &[("n2", 99)]);
        assert_eq!(plan_sync(&s, Some(&degraded), &waiting), SyncStep::Nothing);
        let caught_up = obs(config(&["n2"], 1), &[("n2", 100)]);
        assert_eq!(
            plan_sync(&s, Some(&degraded), &caught_up),
            publish(&["n2"], 1)
        );
        assert_eq!(
            plan_sync(&s, Some(&state(&["n2"], Some(1))), &caught_up),
            SyncStep::Nothing
        );
        // Until the position is read, nothing counts as caught up.
        let unread = SyncObservation {
            applied_at: None,
            ..caught_up
        };
        assert_eq!(plan_sync(&s, Some(&degraded), &unread), SyncStep::Nothing);
    }

    #[test]
    fn first_a_lost_standby_is_unlisted_before_it_is_replaced() {
        let s = first(Protection::MaximumAvailability);
        // n2 stopped streaming, n3 can replace it. Each commit will be on
        // one of the two, so the key says just that...
        let o = obs(config(&["n2"], 1), &[("n3", 0)]);
        assert_eq!(
            plan_sync(&s, Some(&state(&["n2"], Some(1))), &o),
            publish(&["n2", "n3"], 1)
        );
        // ...then PostgreSQL waits for n3, which is listed alone once it has
        // caught up.
        let both = state(&["n2", "n3"], Some(1));
        assert_eq!(
            plan_sync(&s, Some(&both), &o),
            SyncStep::Apply(config(&["n3"], 1))
        );
        let o = obs(config(&["n3"], 1), &[("n3", 99)]);
        assert_eq!(plan_sync(&s, Some(&both), &o), SyncStep::Nothing);
        let o = obs(config(&["n3"], 1), &[("n3", 150)]);
        assert_eq!(plan_sync(&s, Some(&both), &o), publish(&["n3"], 1));
        // Of two, the one left stays listed across the change.
        let two = settings(Protection::MaximumProtection, SyncMethod::First, 2);
        let o = obs(config(&["n2", "n3"], 2), &[("n2", 100)]);
        assert_eq!(
            plan_sync(&two, Some(&state(&["n2", "n3"], Some(2))), &o),
            publish(&["n2"], 1)
        );
        assert_eq!(
            plan_sync(&two, Some(&state(&["n2"], Some(1))), &o),
            SyncStep::Apply(config(&["n2"], 1))
        );
    }

    #[test]
    fn quorum_a_growing_set_is_published_before_postgresql_counts_it() {
        let s = settings(Protection::MaximumProtection, SyncMethod::Quorum, 1);
        let p = state(&["n2", "n3"], Some(1));
        let o = obs(config(&["n2", "n3"], 1), &[("n2", 0), ("n3", 0), ("n4", 0)]);
        // n4 may soon acknowledge commits alone: the key names it first.
        assert_eq!(plan_sync(&s, Some(&p), &o), publish(&["n2", "n3", "n4"], 1));
        let p = state(&["n2", "n3", "n4"], Some(1));
        assert_eq!(
            plan_sync(&s, Some(&p), &o),
            SyncStep::Apply(config(&["n2", "n3", "n4"], 1))
        );
        let o = obs(
            config(&["n2", "n3", "n4"], 1),
            &[("n2", 0), ("n3", 0), ("n4", 0)],
        );
        assert_eq!(plan_sync(&s, Some(&p), &o), SyncStep::Nothing);
    }

    #[test]
    fn quorum_a_shrinking_set_is_unpublished_only_once_the_rest_caught_up() {
        let s = settings(Protection::MaximumProtection, SyncMethod::Quorum, 1);
        let p = state(&["n2", "n3", "n4"], Some(1));
        // n4 is gone: PostgreSQL first (ANY 1 of the two left upholds the
        // key, which lists them)...
        let o = obs(config(&["n2", "n3", "n4"], 1), &[("n2", 0), ("n3", 0)]);
        assert_eq!(
            plan_sync(&s, Some(&p), &o),
            SyncStep::Apply(config(&["n2", "n3"], 1))
        );
        // ...and n4 stays listed while a commit acknowledged by it alone
        // may be missing from both others.
        let o = obs(config(&["n2", "n3"], 1), &[("n2", 99), ("n3", 60)]);
        assert_eq!(plan_sync(&s, Some(&p), &o), SyncStep::Nothing);
        let o = obs(config(&["n2", "n3"], 1), &[("n2", 100), ("n3", 60)]);
        assert_eq!(plan_sync(&s, Some(&p), &o), publish(&["n2", "n3"], 1));
    }

    #[test]
    fn quorum_two_of_three_losing_one_needs_both_others_caught_up() {
        let s = settings(Protection::MaximumProtection, SyncMethod::Quorum, 2);
        let p = state(&["n2", "n3", "n4"], Some(2));
        let o = obs(config(&["n2", "n3", "n4"], 2), &[("n2", 0), ("n3", 0)]);
        assert_eq!(
            plan_sync(&s, Some(&p), &o),
            SyncStep::Apply(config(&["n2", "n3"], 2))
        );
        let o = obs(config(&["n2", "n3"], 2), &[("n2", 100), ("n3", 99)]);
        assert_eq!(plan_sync(&s, Some(&p), &o), SyncStep::Nothing);
        let o = obs(config(&["n2", "n3"], 2), &[("n2", 100), ("n3", 100)]);
        assert_eq!(plan_sync(&s, Some(&p), &o), publish(&["n2", "n3"], 2));
    }

    #[test]
    fn strict_mode_blocks_commits_until_a_standby_is_listed() {
        let s = first(Protection::MaximumProtection);
        // A new cluster's leader with nobody to wait for: PostgreSQL waits
        // for a standby no member can be...
        assert_eq!(
            plan_sync(&s, None, &obs(SyncConfig::none(), &[])),
            SyncStep::Apply(SyncConfig::blocked())
        );
        // ...and the key says the cluster runs synchronously, listing
        // nobody.
        let blocked = obs(SyncConfig::blocked(), &[]);
        assert_eq!(
            plan_sync(&s, None, &blocked),
            SyncStep::Publish {
                members: vec![],
                quorum: 0,
                degraded: false
            }
        );
        assert_eq!(
            plan_sync(&s, Some(&state(&[], Some(0))), &blocked),
            SyncStep::Nothing
        );
        // The first standby: waited for, then listed.
        let o = obs(SyncConfig::blocked(), &[("n2", 0)]);
        assert_eq!(
            plan_sync(&s, Some(&state(&[], Some(0))), &o),
            SyncStep::Apply(config(&["n2"], 1))
        );
        let o = obs(config(&["n2"], 1), &[("n2", 100)]);
        assert_eq!(
            plan_sync(&s, Some(&state(&[], Some(0))), &o),
            publish(&["n2"], 1)
        );
        // Losing it again: commits keep waiting for it, it stays listed.
        let o = obs(config(&["n2"], 1), &[]);
        assert_eq!(
            plan_sync(&s, Some(&state(&["n2"], Some(1))), &o),
            SyncStep::Nothing
        );
    }

    #[test]
    fn without_standbys_availability_degrades_after_the_timeout() {
        let blocked = SyncObservation {
            blocked_for: Some(Duration::from_secs(3)),
            ..obs(config(&["n2"], 1), &[])
        };
        let p = state(&["n2"], Some(1));
        let s = first(Protection::MaximumAvailability);
        // Recorded first...
        assert_eq!(
            plan_sync(&s, Some(&p), &blocked),
            SyncStep::Publish {
                members: vec![],
                quorum: 0,
                degraded: true
            }
        );
        // ...then PostgreSQL stops waiting.
        let mut degraded = state(&[], Some(0));
        degraded.degraded_since_ms = Some(1);
        assert_eq!(
            plan_sync(&s, Some(&degraded), &blocked),
            SyncStep::Apply(SyncConfig::none())
        );
        let bounded = SyncSettings {
            degrade_after: Duration::from_secs(10),
            ..s
        };
        assert_eq!(plan_sync(&bounded, Some(&p), &blocked), SyncStep::Nothing);
    }

    #[test]
    fn performance_mode_clears_any_synchronous_state() {
        let s = first(Protection::MaximumPerformance);
        let o = obs(config(&["n2"], 1), &[("n2", 100)]);
        assert_eq!(
            plan_sync(&s, Some(&state(&["n2"], Some(1))), &o),
            SyncStep::Publish {
                members: vec![],
                quorum: 0,
                degraded: false
            }
        );
        let clear = SyncState {
            leader: "n1".into(),
            ..SyncState::default()
        };
        assert_eq!(
            plan_sync(&s, Some(&clear), &o),
            SyncStep::Apply(SyncConfig::none())
        );
        assert_eq!(
            plan_sync(&s, Some(&clear), &obs(SyncConfig::none(), &[("n2", 0)])),
            SyncStep::Nothing
        );
    }

    /// A small deterministic generator, so the simulation needs no crate.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    /// Runs a leader through random joins, losses, commits and catch-up,
    /// taking the planner's steps, and checks after every event that the
    /// published claim holds for every commit acknowledged so far: the
    /// property the election relies on.
    fn simulate(s: SyncSettings, seed: u64) {
        let mut rng = Rng(seed);
        let all = names(&["a", "b", "c", "d"]);
        let mut streaming: Vec<String> = Vec::new();
        let mut flushed: Vec<(String, u64)> = all.iter().map(|n| (n.clone(), 0)).collect();
        let mut lsn = 0u64;
        let mut pending: Vec<u64> = Vec::new();
        let mut acked: Vec<u64> = Vec::new();
        let mut applied = SyncConfig::none();
        let mut applied_at: Option<u64> = None;
        let mut key: Option<SyncState> = None;
        let flush_of =
            |f: &[(String, u64)], n: &str| f.iter().find(|(m, _)| m == n).map_or(0, |(_, l)| *l);
        for step in 0..3_000 {
            match rng.below(10) {
                0 => {
                    let n = &all[rng.below(4) as usize];
                    if !streaming.contains(n) {
                        streaming.push(n.clone());
                    }
                }
                1 => {
                    let n = all[rng.below(4) as usize].clone();
                    streaming.retain(|m| *m != n);
                }
                2 | 3 => {
                    lsn += 1;
                    pending.push(lsn);
                }
                4..=6 => {
                    // Streaming standbys receive WAL at their own pace.
                    for (n, f) in flushed.iter_mut() {
                        if streaming.contains(n) && *f < lsn && rng.below(2) == 0 {
                            *f += 1 + rng.below(lsn - *f);
                        }
                    }
                }
                _ => {
                    let o = SyncObservation {
                        applied: applied.clone(),
                        applied_at,
                        candidates: streaming.clone(),
                        flushed: flushed
                            .iter()
                            .filter(|(n, _)| streaming.contains(n))
                            .cloned()
                            .collect(),
                        // Blocked long enough to degrade at once.
                        blocked_for: Some(Duration::from_secs(60)),
                    };
                    if applied_at.is_none() {
                        applied_at = Some(lsn);
                    }
                    match plan_sync(&s, key.as_ref(), &o) {
                        SyncStep::Nothing => {}
                        SyncStep::Publish {
                            members,
                            quorum,
                            degraded,
                        } => {
                            key = Some(SyncState {
                                leader: "l".into(),
                                synchronous: s.protection.synchronous(),
                                members,
                                quorum: Some(quorum),
                                degraded_since_ms: degraded.then_some(1),
                                blocked_since_ms: None,
                            });
                        }
                        SyncStep::Apply(c) => {
                            applied = c;
                            applied_at = None;
                        }
                    }
                }
            }
            // PostgreSQL acknowledges what its current rule allows.
            pending.retain(|&c| {
                let copies = applied
                    .names
                    .iter()
                    .filter(|n| flush_of(&flushed, n) >= c)
                    .count();
                let ok = !applied.is_blocked() && copies >= applied.num;
                if ok {
                    acked.push(c);
                }
                !ok
            });
            // Flushing is in order, so the newest commit acknowledged has
            // the fewest copies: checking it checks them all.
            let claim = key.as_ref().map_or_else(Claim::none, SyncState::claim);
            if let Some(&c) = acked.iter().max() {
                let copies = claim
                    .members
                    .iter()
                    .filter(|n| flush_of(&flushed, n) >= c)
                    .count();
                assert!(
                    copies >= claim.quorum,
                    "{s:?} seed {seed} step {step}: commit {c} on {copies} of {claim:?}"
                );
            }
            if s.protection == Protection::MaximumProtection {
                assert!(
                    !key.as_ref().is_some_and(|k| k.degraded_since_ms.is_some()),
                    "strict mode never degrades"
                );
            }
        }
        assert!(!acked.is_empty() || s.protection == Protection::MaximumProtection);
    }

    #[test]
    fn every_step_keeps_the_published_claim_true() {
        for protection in [
            Protection::MaximumAvailability,
            Protection::MaximumProtection,
        ] {
            for method in [SyncMethod::First, SyncMethod::Quorum] {
                for count in 1..=3 {
                    for seed in 1..=20 {
                        simulate(settings(protection, method, count), seed * 7919);
                    }
                }
            }
        }
    }

    #[test]
    fn with_steady_standbys_the_key_settles_on_the_wanted_set() {
        let s = settings(Protection::MaximumProtection, SyncMethod::Quorum, 2);
        let mut key: Option<SyncState> = None;
        let mut o = obs(SyncConfig::none(), &[("c", 100), ("a", 100), ("b", 100)]);
        for _ in 0..10 {
            match plan_sync(&s, key.as_ref(), &o) {
                SyncStep::Nothing => break,
                SyncStep::Publish {
                    members, quorum, ..
                } => key = Some(state(&[], Some(quorum))).map(|k| SyncState { members, ..k }),
                SyncStep::Apply(c) => o.applied = c,
            }
        }
        let k = key.unwrap();
        assert_eq!((k.members, k.quorum), (names(&["a", "b", "c"]), Some(2)));
        assert_eq!(
            o.applied.standby_names(SyncMethod::Quorum),
            "ANY 2 (\"a\", \"b\", \"c\")"
        );
    }
}
