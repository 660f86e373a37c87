//! Choosing a backend host for a new client connection.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ewma::duration_ms;
use crate::model::{Role, SyncState};
use crate::state::{HostState, Topology};

/// Tags that keep a replica out of plain replica load balancing.
const NO_BALANCE_TAGS: [&str; 3] = ["offline", "noloadbalance", FENCED_TAG];

/// The tag the HA agent gives a fenced member: it takes no reads of any
/// kind, whatever service asks (an operator's `noloadbalance` keeps a
/// server only out of plain replica load balancing).
pub const FENCED_TAG: &str = "fenced";

/// How to pick among several eligible hosts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Rotate over the hosts, optionally only those close to the fastest.
    #[default]
    #[serde(alias = "roundrobin")]
    RoundRobin,
    /// Always the host with the lowest smoothed RTT.
    Nearest,
}

/// A string that names no known value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseValueError {
    /// What kind of value was being parsed.
    pub what: &'static str,
    /// The rejected input.
    pub input: String,
    /// The accepted spellings, for the message.
    pub expected: &'static str,
}

impl fmt::Display for ParseValueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown {} {:?}, expected one of: {}",
            self.what, self.input, self.expected
        )
    }
}

impl std::error::Error for ParseValueError {}

impl FromStr for Strategy {
    type Err = ParseValueError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("round-robin") || t.eq_ignore_ascii_case("roundrobin") {
            Ok(Strategy::RoundRobin)
        } else if t.eq_ignore_ascii_case("nearest") {
            Ok(Strategy::Nearest)
        } else {
            Err(ParseValueError {
                what: "strategy",
                input: s.to_string(),
                expected: "round-robin, nearest",
            })
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Strategy::RoundRobin => "round-robin",
            Strategy::Nearest => "nearest",
        })
    }
}

/// What kind of host a client asked for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Want {
    /// The writable primary.
    Primary,
    /// Any load-balanced, up-to-date, undelayed replica.
    Replica,
    /// A synchronous (or quorum) standby.
    SyncStandby,
    /// A replica running with `recovery_min_apply_delay`.
    Delayed,
    /// Any live host carrying this tag.
    Tagged(String),
}

impl FromStr for Want {
    type Err = ParseValueError;

    /// Accepts `primary`, `replica`, `standby` or `sync`, `delayed`, and
    /// `tag:NAME` (case-insensitive keywords; the tag name is kept as written).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let is = |w: &str| t.eq_ignore_ascii_case(w);
        if is("primary") {
            Ok(Want::Primary)
        } else if is("replica") {
            Ok(Want::Replica)
        } else if is("standby") || is("sync") {
            Ok(Want::SyncStandby)
        } else if is("delayed") {
            Ok(Want::Delayed)
        } else if let Some(tag) = t
            .get(..4)
            .filter(|p| p.eq_ignore_ascii_case("tag:"))
            .map(|_| &t[4..])
            .filter(|tag| !tag.is_empty())
        {
            Ok(Want::Tagged(tag.to_string()))
        } else {
            Err(ParseValueError {
                what: "target",
                input: s.to_string(),
                expected: "primary, replica, standby, sync, delayed, tag:NAME",
            })
        }
    }
}

impl fmt::Display for Want {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Want::Primary => f.write_str("primary"),
            Want::Replica => f.write_str("replica"),
            Want::SyncStandby => f.write_str("standby"),
            Want::Delayed => f.write_str("delayed"),
            Want::Tagged(t) => write!(f, "tag:{t}"),
        }
    }
}

/// Knobs of host selection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelectPolicy {
    /// How to pick among eligible hosts.
    pub strategy: Strategy,
    /// Round robin prefers hosts whose RTT is within this much of the fastest.
    pub rtt_threshold: Duration,
    /// Whether the RTT window applies at all.
    pub rtt_threshold_enabled: bool,
    /// Send non-primary requests to the primary when nothing else qualifies,
    /// trading load for availability.
    pub fallback_to_primary: bool,
}

impl Default for SelectPolicy {
    fn default() -> Self {
        SelectPolicy {
            strategy: Strategy::RoundRobin,
            rtt_threshold: Duration::from_millis(20),
            rtt_threshold_enabled: true,
            fallback_to_primary: true,
        }
    }
}

/// Why no host could be chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoTarget {
    /// No live host is primary.
    NoPrimary,
    /// Several live hosts claim to be primary; choosing one could split writes.
    PrimaryConflict,
    /// No host qualifies and falling back to the primary was not possible.
    NoCandidate {
        /// What was asked for.
        want: Want,
    },
}

impl fmt::Display for NoTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NoTarget::NoPrimary => f.write_str("no primary is available"),
            NoTarget::PrimaryConflict => {
                f.write_str("several hosts claim to be primary; refusing to choose one")
            }
            NoTarget::NoCandidate { want } => write!(f, "no host is available for {want}"),
        }
    }
}

impl std::error::Error for NoTarget {}

/// A host [`Selector::peek`] chose, and the round-robin turn it chose it
/// at, which [`Selector::advance`] takes once it is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peeked {
    /// Index of the host in the topology.
    pub index: usize,
    turn: usize,
}

/// Picks hosts according to a [`SelectPolicy`].
///
/// Shared between connection handlers: the round-robin position is atomic,
/// so selection needs only `&self`.
#[derive(Debug)]
pub struct Selector {
    policy: SelectPolicy,
    counter: AtomicUsize,
    /// Dynamic override of `policy.rtt_threshold` in microseconds;
    /// `NO_OVERRIDE` when unset. Atomic so an operator can retune the
    /// window while connections are being routed, without a restart.
    threshold_override: AtomicU64,
    /// Dynamic override of `policy.rtt_threshold_enabled`: 0 unset, 1 off, 2 on.
    enabled_override: AtomicU8,
}

const NO_OVERRIDE: u64 = u64::MAX;

impl Default for Selector {
    fn default() -> Self {
        Selector::new(SelectPolicy::default())
    }
}

impl Selector {
    /// A selector starting its rotation at the first eligible host.
    pub fn new(policy: SelectPolicy) -> Self {
        Selector {
            policy,
            counter: AtomicUsize::new(0),
            threshold_override: AtomicU64::new(NO_OVERRIDE),
            enabled_override: AtomicU8::new(0),
        }
    }

    /// Takes up the round robin where `previous` (the selector this one
    /// replaces, on a reload) left it, with the dynamic overrides set on
    /// it: a reload does not send the next clients back to the first
    /// host.
    pub fn continue_from(&self, previous: &Selector) {
        self.counter
            .store(previous.counter.load(Ordering::Relaxed), Ordering::Relaxed);
        self.threshold_override.store(
            previous.threshold_override.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        self.enabled_override.store(
            previous.enabled_override.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
    }

    /// Overrides the static RTT threshold from now on (`None` restores it).
    pub fn set_rtt_threshold_override(&self, threshold: Option<Duration>) {
        let v = threshold.map_or(NO_OVERRIDE, |d| {
            u64::try_from(d.as_micros()).unwrap_or(NO_OVERRIDE - 1)
        });
        self.threshold_override.store(v, Ordering::Relaxed);
    }

    /// Overrides whether the RTT window applies (`None` restores the policy).
    pub fn set_rtt_threshold_enabled_override(&self, enabled: Option<bool>) {
        let v = match enabled {
            None => 0,
            Some(false) => 1,
            Some(true) => 2,
        };
        self.enabled_override.store(v, Ordering::Relaxed);
    }

    /// The RTT threshold in force: the dynamic override, else the policy's.
    pub fn rtt_threshold(&self) -> Duration {
        match self.threshold_override.load(Ordering::Relaxed) {
            NO_OVERRIDE => self.policy.rtt_threshold,
            us => Duration::from_micros(us),
        }
    }

    /// Whether the RTT window is in force.
    pub fn rtt_threshold_enabled(&self) -> bool {
        match self.enabled_override.load(Ordering::Relaxed) {
            1 => false,
            2 => true,
            _ => self.policy.rtt_threshold_enabled,
        }
    }

    /// The policy in force.
    pub fn policy(&self) -> &SelectPolicy {
        &self.policy
    }

    /// Chooses a host for `want`, returning its index in `topo`.
    pub fn select(&self, topo: &Topology, want: &Want) -> Result<usize, NoTarget> {
        self.choose(topo, want, true)
    }

    /// The host [`select`](Self::select) would choose now, without taking
    /// a turn of the round robin: for a caller that may not use it, and
    /// calls [`advance`](Self::advance) when it does.
    pub fn peek(&self, topo: &Topology, want: &Want) -> Result<Peeked, NoTarget> {
        let turn = self.counter.load(Ordering::Relaxed);
        self.choose_at(topo, want, turn)
            .map(|index| Peeked { index, turn })
    }

    /// Takes the turn of the round robin at which `peeked` was chosen for
    /// `want`, now that it was used. Taken once however many callers
    /// peeked at that turn at the same moment (each thread has its own),
    /// so that they move the round on by one host, not by one each, which
    /// would skip hosts for good when clients come in pairs. Nothing for
    /// the primary or the nearest host, which take no turns: the counter
    /// is shared by every worker thread, and writing it on each
    /// transaction would move its cache line between cores for nothing.
    pub fn advance(&self, want: &Want, peeked: Peeked) {
        if *want != Want::Primary && self.policy.strategy == Strategy::RoundRobin {
            let _ = self.counter.compare_exchange(
                peeked.turn,
                peeked.turn.wrapping_add(1),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// The hosts eligible for `want` (as [`eligible`](Self::eligible)), in
    /// the order the strategy prefers them: with round robin, those within
    /// the RTT window first, then the others by RTT; with `nearest`, by
    /// RTT. Hosts of unknown RTT come after those of known RTT. For trying
    /// the next host when the one chosen fails: `after` is that one, as
    /// [`peek`](Self::peek) chose it. The window's other hosts then come in
    /// turn from a place that moves on with the round robin's turn, so that
    /// clients moving off a failing host spread over the window as the
    /// round robin would, rather than all landing on one host.
    pub fn preference_order(
        &self,
        topo: &Topology,
        want: &Want,
        after: Option<Peeked>,
    ) -> Vec<usize> {
        let mut hosts = self.eligible(topo, want);
        let rtt = |i: usize| topo.hosts()[i].rtt.get();
        let window: Vec<usize> = match self.policy.strategy {
            Strategy::RoundRobin if self.rtt_threshold_enabled() => {
                rtt_window(topo, &hosts, self.rtt_threshold())
            }
            Strategy::RoundRobin => hosts.clone(),
            Strategy::Nearest => Vec::new(),
        };
        // Within the window the round robin treats all alike: by index,
        // or after a failure the others rotated by the failed pick's turn.
        let mut in_turn: Vec<usize> = window.clone();
        in_turn.sort_unstable();
        if let Some(f) = after {
            in_turn.retain(|&i| i != f.index);
            if !in_turn.is_empty() {
                let by = f.turn % in_turn.len();
                in_turn.rotate_left(by);
            }
        }
        let place = |i: usize| in_turn.iter().position(|&w| w == i).unwrap_or(usize::MAX);
        hosts.sort_by(|&a, &b| {
            let key = |i: usize| (!window.contains(&i), rtt(i).is_none());
            key(a).cmp(&key(b)).then_with(|| {
                if window.contains(&a) {
                    place(a).cmp(&place(b))
                } else {
                    rtt(a)
                        .unwrap_or(f64::INFINITY)
                        .total_cmp(&rtt(b).unwrap_or(f64::INFINITY))
                        .then(a.cmp(&b))
                }
            })
        });
        hosts
    }

    fn choose(&self, topo: &Topology, want: &Want, advance: bool) -> Result<usize, NoTarget> {
        if *want != Want::Primary && advance && self.policy.strategy == Strategy::RoundRobin {
            let turn = self.counter.fetch_add(1, Ordering::Relaxed);
            return self.choose_at(topo, want, turn);
        }
        self.choose_at(topo, want, self.counter.load(Ordering::Relaxed))
    }

    /// The host chosen for `want` at round-robin turn `turn`.
    fn choose_at(&self, topo: &Topology, want: &Want, turn: usize) -> Result<usize, NoTarget> {
        if *want == Want::Primary {
            return primary_or_reason(topo);
        }
        let candidates = candidates(topo, want);
        if candidates.is_empty() {
            return match topo.primary() {
                Some(p) if self.policy.fallback_to_primary => Ok(p),
                _ => Err(NoTarget::NoCandidate { want: want.clone() }),
            };
        }
        Ok(match self.policy.strategy {
            Strategy::Nearest => nearest(topo, &candidates),
            Strategy::RoundRobin => {
                let window = if self.rtt_threshold_enabled() {
                    rtt_window(topo, &candidates, self.rtt_threshold())
                } else {
                    candidates
                };
                window[turn % window.len()]
            }
        })
    }

    /// The hosts `want` could currently be served by, including the
    /// primary fallback; for display, not affected by the strategy.
    pub fn eligible(&self, topo: &Topology, want: &Want) -> Vec<usize> {
        if *want == Want::Primary {
            return topo.primary().into_iter().collect();
        }
        let c = candidates(topo, want);
        if c.is_empty() && self.policy.fallback_to_primary {
            return topo.primary().into_iter().collect();
        }
        c
    }
}

fn primary_or_reason(topo: &Topology) -> Result<usize, NoTarget> {
    match topo.primary() {
        Some(p) => Ok(p),
        None if topo.conflict() => Err(NoTarget::PrimaryConflict),
        None => Err(NoTarget::NoPrimary),
    }
}

/// Hosts that qualify for `want` on their own merits, in index order.
fn candidates(topo: &Topology, want: &Want) -> Vec<usize> {
    // A replica not following the primary may miss what was written there,
    // whatever role is asked for.
    let live_replica =
        |h: &HostState| h.alive && h.role == Role::Replica && h.off_primary.is_none();
    let hosts = topo.hosts();
    let server = |i: usize| hosts[i].duplicate_of.unwrap_or(i);
    // A server kept out of load balancing under one of its names is kept
    // out under all: under the HA agent a member's noloadbalance or fenced
    // state lands on the entry of its published address, while the
    // configured list may name the same server otherwise.
    let no_balance = |i: usize| {
        (0..hosts.len()).any(|j| {
            (j == i || (hosts[j].alive && server(j) == server(i)))
                && NO_BALANCE_TAGS.iter().any(|t| hosts[j].config.has_tag(t))
        })
    };
    // Fenced by the HA agent: no reads of any kind, under any of its names.
    let fenced = |i: usize| {
        (0..hosts.len()).any(|j| {
            (j == i || (hosts[j].alive && server(j) == server(i)))
                && hosts[j].config.has_tag(FENCED_TAG)
        })
    };
    let ok = |i: usize| match want {
        Want::Primary => false,
        Want::Replica => {
            let h = &hosts[i];
            live_replica(h) && !h.lag_excluded && !h.delayed && !no_balance(i)
        }
        Want::Delayed => live_replica(&hosts[i]) && hosts[i].delayed && !fenced(i),
        Want::SyncStandby => {
            // Reads without replication lag: a delayed replica listed as
            // synchronous still applies its WAL late.
            let h = &hosts[i];
            live_replica(h)
                && !h.lag_excluded
                && !h.delayed
                && !fenced(i)
                && matches!(h.sync_state, Some(SyncState::Sync | SyncState::Quorum))
        }
        Want::Tagged(tag) => {
            // A primary that is not the cluster's (left on an old timeline
            // by a promotion, one of two in conflict, one without the
            // leader key) holds data that diverged: no reads there either.
            let h = &hosts[i];
            h.alive
                && h.config.has_tag(tag)
                && !(h.role == Role::Replica && h.off_primary.is_some())
                && (h.role != Role::Primary || topo.reaches_primary(i))
                && (tag == FENCED_TAG || !fenced(i))
        }
    };
    // A server listed under two names takes its share once: its second
    // name counts only where the first does not qualify (e.g. when only
    // the second carries the tag asked for).
    (0..hosts.len())
        .filter(|&i| ok(i) && !hosts[i].duplicate_of.is_some_and(ok))
        .collect()
}

/// Candidates within `threshold` of the fastest known RTT. Hosts without an
/// estimate only count when no host has one; a sole candidate is always
/// its own minimum, so the window never empties a non-empty set.
fn rtt_window(topo: &Topology, candidates: &[usize], threshold: Duration) -> Vec<usize> {
    let rtt = |i: usize| topo.hosts()[i].rtt.get();
    let Some(min) = candidates
        .iter()
        .filter_map(|&i| rtt(i))
        .min_by(f64::total_cmp)
    else {
        return candidates.to_vec();
    };
    let limit = min + duration_ms(threshold);
    candidates
        .iter()
        .copied()
        .filter(|&i| rtt(i).is_some_and(|r| r <= limit))
        .collect()
}

fn nearest(topo: &Topology, candidates: &[usize]) -> usize {
    let key = |i: usize| topo.hosts()[i].rtt.get().unwrap_or(f64::INFINITY);
    // min_by keeps the first of equal elements, so ties go to the lowest index.
    candidates
        .iter()
        .copied()
        .min_by(|&a, &b| key(a).total_cmp(&key(b)))
        .expect("called with at least one candidate")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{
        HostConfig, LagLimit, Observation, ProbeResult, ReplicationRow, TopologyConfig,
    };
    use crate::state::tests::{cfg, primary_obs, replica_obs};
    use std::collections::BTreeMap;
    use std::time::Instant;

    /// One host of a synthetic cluster: `Some(obs)` alive, `None` dead.
    struct Spec {
        config: HostConfig,
        probe: Option<Observation>,
    }

    fn primary(name: &str) -> Spec {
        Spec {
            config: cfg(name),
            probe: Some(primary_obs(1, 1000)),
        }
    }

    fn replica(name: &str, rtt_ms: u64) -> Spec {
        Spec {
            config: cfg(name),
            probe: Some(replica_obs(name, 1000, rtt_ms)),
        }
    }

    fn dead(mut s: Spec) -> Spec {
        // Seen alive once so the role is known, then lost.
        s.config.tags.push("__dead".into());
        s
    }

    /// `pg_stat_replication` rows of streaming quorum standbys.
    fn quorum_rows(names: &[&str]) -> Vec<ReplicationRow> {
        names
            .iter()
            .map(|n| ReplicationRow {
                application_name: n.to_string(),
                state: "streaming".into(),
                sync_state: "quorum".into(),
                replay_lsn: None,
                slot_name: None,
            })
            .collect()
    }

    fn build(specs: Vec<Spec>, config: TopologyConfig) -> Topology {
        let now = Instant::now();
        let mut t = Topology::new(specs.iter().map(|s| s.config.clone()).collect(), config);
        for (i, s) in specs.iter().enumerate() {
            if let Some(o) = &s.probe {
                t.apply(i, ProbeResult::Ok(o.clone()), now);
            }
            if s.config.has_tag("__dead") {
                t.apply(i, ProbeResult::Down("down".into()), now);
            }
        }
        t
    }

    fn cluster(specs: Vec<Spec>) -> Topology {
        build(specs, TopologyConfig::default())
    }

    fn policy(f: impl FnOnce(&mut SelectPolicy)) -> Selector {
        let mut p = SelectPolicy::default();
        f(&mut p);
        Selector::new(p)
    }

    /// How often each host is chosen over `n` calls.
    fn tally(sel: &Selector, t: &Topology, want: &Want, n: usize) -> BTreeMap<usize, usize> {
        let mut m = BTreeMap::new();
        for _ in 0..n {
            *m.entry(sel.select(t, want).unwrap()).or_default() += 1;
        }
        m
    }

    fn chosen(sel: &Selector, t: &Topology, want: &Want) -> Vec<usize> {
        tally(sel, t, want, 60).into_keys().collect()
    }

    #[test]
    fn parse_strategy_and_want() {
        for (s, v) in [
            ("round-robin", Strategy::RoundRobin),
            ("roundrobin", Strategy::RoundRobin),
            ("Nearest", Strategy::Nearest),
        ] {
            assert_eq!(s.parse::<Strategy>(), Ok(v));
        }
        assert!("fastest".parse::<Strategy>().is_err());
        for (s, v) in [
            ("primary", Want::Primary),
            ("replica", Want::Replica),
            ("standby", Want::SyncStandby),
            ("SYNC", Want::SyncStandby),
            ("delayed", Want::Delayed),
            ("tag:Backup", Want::Tagged("Backup".into())),
        ] {
            assert_eq!(s.parse::<Want>(), Ok(v.clone()), "{s}");
            assert_eq!(v.to_string().parse::<Want>(), Ok(v));
        }
        for bad in ["", "tag:", "leader"] {
            let e = bad.parse::<Want>().unwrap_err();
            assert!(e.to_string().contains("expected one of"), "{e}");
        }
    }

    #[test]
    fn primary_selection_and_reasons() {
        let sel = Selector::default();
        let t = cluster(vec![replica("r", 1), primary("p")]);
        assert_eq!(sel.select(&t, &Want::Primary), Ok(1));
        let t = cluster(vec![replica("r", 1), dead(primary("p"))]);
        assert_eq!(sel.select(&t, &Want::Primary), Err(NoTarget::NoPrimary));
        assert_eq!(sel.eligible(&t, &Want::Primary), Vec::<usize>::new());
        let t = cluster(vec![primary("a"), primary("b")]);
        assert_eq!(
            sel.select(&t, &Want::Primary),
            Err(NoTarget::PrimaryConflict)
        );
        assert!(NoTarget::PrimaryConflict.to_string().contains("several"));
        assert_eq!(
            NoTarget::NoCandidate {
                want: Want::Delayed
            }
            .to_string(),
            "no host is available for delayed"
        );
    }

    #[test]
    fn dead_replica_keeps_role_but_is_not_selectable() {
        let t = cluster(vec![primary("p"), dead(replica("r", 1)), replica("s", 5)]);
        assert_eq!(t.hosts()[1].role, Role::Replica);
        assert_eq!(chosen(&Selector::default(), &t, &Want::Replica), [2]);
    }

    #[test]
    fn rtt_window_table() {
        // (description, hosts, policy tweak, expected set of chosen hosts)
        type Tweak = fn(&mut SelectPolicy);
        let none: Tweak = |_| {};
        let table: Vec<(&str, Vec<Spec>, Tweak, Vec<usize>)> = vec![
            (
                "slow replica outside the window",
                vec![primary("p"), replica("fast", 1), replica("slow", 31)],
                none,
                vec![1],
            ),
            (
                "fast one dead: slow one rather than the primary",
                vec![primary("p"), dead(replica("fast", 1)), replica("slow", 31)],
                none,
                vec![2],
            ),
            (
                "both dead: primary fallback",
                vec![
                    primary("p"),
                    dead(replica("fast", 1)),
                    dead(replica("slow", 31)),
                ],
                none,
                vec![0],
            ),
            (
                "threshold disabled: both",
                vec![primary("p"), replica("fast", 1), replica("slow", 31)],
                |p| p.rtt_threshold_enabled = false,
                vec![1, 2],
            ),
            (
                "wide threshold: both",
                vec![primary("p"), replica("fast", 1), replica("slow", 31)],
                |p| p.rtt_threshold = Duration::from_millis(30),
                vec![1, 2],
            ),
            (
                "threshold zero: only ties",
                vec![
                    primary("p"),
                    replica("a", 4),
                    replica("b", 5),
                    replica("c", 4),
                ],
                |p| p.rtt_threshold = Duration::ZERO,
                vec![1, 3],
            ),
            (
                "nearest: lowest",
                vec![
                    primary("p"),
                    replica("a", 9),
                    replica("b", 3),
                    replica("c", 4),
                ],
                |p| p.strategy = Strategy::Nearest,
                vec![2],
            ),
            (
                "nearest tie: lowest index",
                vec![
                    primary("p"),
                    replica("a", 9),
                    replica("b", 3),
                    replica("c", 3),
                ],
                |p| p.strategy = Strategy::Nearest,
                vec![2],
            ),
        ];
        for (what, specs, tweak, want) in table {
            let t = cluster(specs);
            let sel = policy(tweak);
            assert_eq!(chosen(&sel, &t, &Want::Replica), want, "{what}");
        }
    }

    #[test]
    fn fallback_disabled_gives_no_candidate() {
        let t = cluster(vec![primary("p"), dead(replica("r", 1))]);
        let sel = policy(|p| p.fallback_to_primary = false);
        assert_eq!(
            sel.select(&t, &Want::Replica),
            Err(NoTarget::NoCandidate {
                want: Want::Replica
            })
        );
        assert!(sel.eligible(&t, &Want::Replica).is_empty());
        assert_eq!(Selector::default().eligible(&t, &Want::Replica), [0]);
        // Fallback needs a primary.
        let t = cluster(vec![dead(primary("p"))]);
        assert!(matches!(
            Selector::default().select(&t, &Want::Replica),
            Err(NoTarget::NoCandidate { .. })
        ));
    }

    #[test]
    fn round_robin_is_even() {
        let t = cluster(vec![
            primary("p"),
            replica("a", 2),
            replica("b", 10),
            replica("c", 21),
            replica("far", 40),
        ]);
        let sel = Selector::default();
        let m = tally(&sel, &t, &Want::Replica, 300);
        assert_eq!(m, BTreeMap::from([(1, 100), (2, 100), (3, 100)]));
        assert_eq!(sel.eligible(&t, &Want::Replica), [1, 2, 3, 4]);
    }

    #[test]
    fn dynamic_threshold_overrides_take_effect_at_once() {
        let t = cluster(vec![primary("p"), replica("fast", 1), replica("slow", 31)]);
        let sel = Selector::default();
        assert_eq!(sel.rtt_threshold(), Duration::from_millis(20));
        assert_eq!(
            tally(&sel, &t, &Want::Replica, 10),
            BTreeMap::from([(1, 10)]),
            "a default selector has no override"
        );
        let t2 = cluster(vec![primary("p"), replica("a", 1), replica("b", 11)]);
        assert_eq!(
            tally(&sel, &t2, &Want::Replica, 10),
            BTreeMap::from([(1, 5), (2, 5)])
        );
        assert_eq!(
            tally(&sel, &t, &Want::Replica, 10),
            BTreeMap::from([(1, 10)])
        );
        sel.set_rtt_threshold_override(Some(Duration::from_millis(40)));
        assert_eq!(sel.rtt_threshold(), Duration::from_millis(40));
        assert_eq!(
            tally(&sel, &t, &Want::Replica, 10),
            BTreeMap::from([(1, 5), (2, 5)])
        );
        sel.set_rtt_threshold_override(None);
        assert_eq!(
            tally(&sel, &t, &Want::Replica, 10),
            BTreeMap::from([(1, 10)])
        );
        sel.set_rtt_threshold_enabled_override(Some(false));
        assert!(!sel.rtt_threshold_enabled());
        assert_eq!(
            tally(&sel, &t, &Want::Replica, 10),
            BTreeMap::from([(1, 5), (2, 5)])
        );
        sel.set_rtt_threshold_enabled_override(None);
        assert_eq!(
            tally(&sel, &t, &Want::Replica, 10),
            BTreeMap::from([(1, 10)])
        );
    }

    #[test]
    fn peek_takes_no_turn_advance_takes_one() {
        let t = cluster(vec![primary("p"), replica("a", 1), replica("b", 1)]);
        let sel = Selector::new(SelectPolicy::default());
        let first = sel.peek(&t, &Want::Replica).unwrap();
        assert_eq!(
            sel.peek(&t, &Want::Replica),
            Ok(first),
            "a peek moves nothing"
        );
        assert_eq!(sel.select(&t, &Want::Replica), Ok(first.index));
        let second = sel.peek(&t, &Want::Replica).unwrap();
        assert_ne!(second.index, first.index, "select took the turn");
        sel.advance(&Want::Replica, second);
        assert_eq!(
            sel.peek(&t, &Want::Replica).map(|p| p.index),
            Ok(first.index),
            "advance took one"
        );
    }

    /// Clients that peek at the same moment get the same host, but move
    /// the round on by one, not one each: in pairs they would otherwise
    /// skip every other host for good.
    #[test]
    fn simultaneous_peeks_take_one_turn_between_them() {
        let t = cluster(vec![primary("p"), replica("a", 1), replica("b", 1)]);
        let sel = Selector::default();
        let mut seen = BTreeMap::new();
        for _ in 0..6 {
            let x = sel.peek(&t, &Want::Replica).unwrap();
            let y = sel.peek(&t, &Want::Replica).unwrap();
            assert_eq!(x, y);
            sel.advance(&Want::Replica, x);
            sel.advance(&Want::Replica, y);
            *seen.entry(x.index).or_insert(0) += 2;
        }
        assert_eq!(seen, BTreeMap::from([(1, 6), (2, 6)]));
    }

    /// After a failed connection the next host tried is the next the
    /// strategy prefers: within the RTT window first, then by RTT.
    #[test]
    fn the_hosts_to_try_next_come_in_the_strategys_order() {
        let t = cluster(vec![
            primary("p"),
            replica("r1", 1),
            replica("r2", 80),
            replica("r3", 2),
            replica("r4", 40),
        ]);
        let sel = Selector::default();
        assert_eq!(sel.preference_order(&t, &Want::Replica, None), [1, 3, 4, 2]);
        let nearest = policy(|p| p.strategy = Strategy::Nearest);
        assert_eq!(
            nearest.preference_order(&t, &Want::Replica, None),
            [1, 3, 4, 2]
        );
        let no_window = policy(|p| p.rtt_threshold_enabled = false);
        assert_eq!(
            no_window.preference_order(&t, &Want::Replica, None),
            [1, 2, 3, 4]
        );
        assert_eq!(sel.preference_order(&t, &Want::Primary, None), [0]);
        // After a failing host, the window's others from a place that
        // moves on with the failed pick's turn: clients leaving that host
        // spread over the others rather than all landing on one.
        let failed = |index, turn| Some(Peeked { index, turn });
        let firsts: std::collections::BTreeSet<usize> = (0..3)
            .map(|turn| no_window.preference_order(&t, &Want::Replica, failed(2, turn))[0])
            .collect();
        assert_eq!(firsts, [1, 3, 4].into());
        assert_eq!(
            no_window.preference_order(&t, &Want::Replica, failed(2, 1)),
            [3, 4, 1, 2]
        );
        assert_eq!(
            sel.preference_order(&t, &Want::Replica, failed(1, 5)),
            [3, 1, 4, 2]
        );
        assert_eq!(
            nearest.preference_order(&t, &Want::Replica, failed(1, 0)),
            [1, 3, 4, 2],
            "nearest takes no turns"
        );
    }

    #[test]
    fn candidate_filters() {
        let now = Instant::now();
        let mut tagged = replica("tagged", 1);
        tagged.config.tags = vec!["noloadbalance".into(), "backup".into()];
        let mut off = replica("off", 1);
        off.config.tags = vec!["OFFLINE".into()];
        let mut delayed = replica("delayed", 1);
        if let Some(o) = delayed.probe.as_mut() {
            o.min_apply_delay = Duration::from_secs(3600);
        }
        let mut lagging = replica("lagging", 1);
        if let Some(o) = lagging.probe.as_mut() {
            o.replay_lsn = Some(0);
        }
        let mut p = primary("p");
        p.config.tags = vec!["backup".into()];
        if let Some(o) = p.probe.as_mut() {
            o.synchronous_standby_names = Some("ANY 1 (lagging, plain)".into());
            o.replication = quorum_rows(&["lagging", "plain"]);
        }
        let specs = vec![
            p,
            tagged,
            off,
            delayed,
            lagging,
            replica("plain", 1),
            dead(replica("gone", 1)),
        ];
        let mut t = build(
            specs,
            TopologyConfig {
                max_replica_lag: Some(LagLimit {
                    bytes: Some(10),
                    time: None,
                }),
                lag_hold: Duration::from_secs(10),
                ..TopologyConfig::default()
            },
        );
        // Re-apply the primary so every replica's lag is evaluated.
        let obs = t.host(0).unwrap().observation().unwrap().clone();
        t.apply(0, ProbeResult::Ok(obs), now);
        assert!(t.hosts()[4].lag_excluded);
        assert!(t.quorum_commit());
        let sel = policy(|p| p.rtt_threshold_enabled = false);
        for (want, expect) in [
            (Want::Replica, vec![5]),
            (Want::Delayed, vec![3]),
            (Want::SyncStandby, vec![5]),
            (Want::Tagged("backup".into()), vec![0, 1]),
            (Want::Tagged("nothing".into()), vec![0]),
        ] {
            assert_eq!(sel.eligible(&t, &want), expect, "{want}");
            assert_eq!(chosen(&sel, &t, &want), expect, "{want}");
        }
    }

    #[test]
    fn fenced_delayed_and_stale_servers_stay_out_of_special_services() {
        let delay = |mut s: Spec| {
            if let Some(o) = s.probe.as_mut() {
                o.min_apply_delay = Duration::from_secs(3600);
            }
            s
        };
        let tag = |mut s: Spec, tags: &[&str]| {
            s.config.tags = tags.iter().map(|t| t.to_string()).collect();
            s
        };
        let mut p = primary("p");
        if let Some(o) = p.probe.as_mut() {
            o.timeline = Some(2);
            o.synchronous_standby_names = Some("ANY 1 (delayed, fenced, etl)".into());
            o.replication = quorum_rows(&["delayed", "fenced", "etl"]);
        }
        let on_timeline_2 = |mut s: Spec| {
            if let Some(o) = s.probe.as_mut() {
                o.timeline = Some(2);
            }
            s
        };
        let specs = vec![
            p,
            on_timeline_2(delay(replica("delayed", 1))),
            on_timeline_2(delay(tag(
                replica("fenced", 1),
                &["fenced", "noloadbalance", "etl"],
            ))),
            on_timeline_2(tag(replica("etl", 1), &["etl"])),
            // Still on the old timeline: not following the primary.
            tag(replica("stale", 1), &["etl"]),
            // An operator's noloadbalance keeps a server out of replica
            // reads only.
            on_timeline_2(tag(replica("backup", 1), &["noloadbalance", "backup"])),
        ];
        let mut t = build(specs, TopologyConfig::default());
        let obs = t.host(0).unwrap().observation().unwrap().clone();
        t.apply(0, ProbeResult::Ok(obs), Instant::now());
        assert!(t.hosts()[4].off_primary.is_some());
        let sel = policy(|p| p.rtt_threshold_enabled = false);
        for (want, expect) in [
            // Reads without lag: the delayed quorum member is left out.
            (Want::SyncStandby, vec![3]),
            // The fenced delayed replica is left out.
            (Want::Delayed, vec![1]),
            // Fenced, and not following the primary: left out.
            (Want::Tagged("etl".into()), vec![3]),
            (Want::Tagged("backup".into()), vec![5]),
            (Want::Replica, vec![3]),
        ] {
            assert_eq!(sel.eligible(&t, &want), expect, "{want}");
        }
    }

    #[test]
    fn a_tagged_service_reads_from_no_primary_but_the_clusters() {
        let tag = |mut s: Spec| {
            s.config.tags = vec!["offline".into()];
            s
        };
        let on_timeline_2 = |mut s: Spec| {
            if let Some(o) = s.probe.as_mut() {
                o.timeline = Some(2);
            }
            s
        };
        // The old primary, left on timeline 1 by a promotion, still runs.
        let t = cluster(vec![tag(primary("old")), on_timeline_2(primary("new"))]);
        assert_eq!(t.primary(), Some(1));
        let sel = Selector::default();
        let offline = Want::Tagged("offline".into());
        // Only by the fallback to the cluster's primary.
        assert_eq!(sel.eligible(&t, &offline), [1]);
        assert_eq!(sel.select(&t, &offline), Ok(1));
        // Two primaries on one timeline: neither is the cluster's.
        let t = cluster(vec![tag(primary("a")), primary("b")]);
        assert!(t.conflict());
        assert!(sel.eligible(&t, &offline).is_empty());
        assert!(sel.select(&t, &offline).is_err());
        // The cluster's own primary, tagged, still serves the tag.
        let t = cluster(vec![tag(primary("p")), replica("r", 1)]);
        assert_eq!(sel.eligible(&t, &offline), [0]);
    }

    #[test]
    fn a_server_kept_out_under_one_name_is_kept_out_under_all() {
        let id = |started_us| {
            Some(crate::model::InstanceId {
                system_identifier: 7,
                started_us,
                port: 5432,
            })
        };
        let mut p = primary_obs(1, 1000);
        p.instance = id(1);
        let mut r = replica_obs("r", 1000, 1);
        r.instance = id(2);
        let mut s = replica_obs("s", 1000, 1);
        s.instance = id(3);
        // r as configured, then as the HA agent adds it from its member
        // record, fenced (noloadbalance); s, a replica in service.
        let mut member = cfg("10.0.0.2");
        member.tags.push("noloadbalance".into());
        let configs = vec![cfg("p"), cfg("r.example"), member, cfg("s")];
        let mut t = Topology::new(configs, TopologyConfig::default());
        let now = Instant::now();
        for (i, o) in [(0, &p), (1, &r), (2, &r), (3, &s)] {
            t.apply(i, ProbeResult::Ok(o.clone()), now);
        }
        assert_eq!(t.hosts()[2].duplicate_of, Some(1));
        let sel = Selector::default();
        assert_eq!(sel.eligible(&t, &Want::Replica), [3]);
        // Asked for by name or tag, it still serves.
        assert_eq!(sel.eligible(&t, &Want::Tagged("noloadbalance".into())), [2]);
    }

    #[test]
    fn shared_across_threads() {
        let t = cluster(vec![primary("p"), replica("a", 1), replica("b", 1)]);
        let sel = Selector::default();
        let total: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        (0..100)
                            .filter(|_| sel.select(&t, &Want::Replica) == Ok(1))
                            .count()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(total, 200);
    }
}
