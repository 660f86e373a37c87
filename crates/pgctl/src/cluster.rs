use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use crate::{Instance, InstanceSpec, PgBinaries, Result, RunAs};

/// Which replicas are synchronous, in `synchronous_standby_names` terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyncSpec {
    /// `FIRST n (replicas…)`: priority-based synchronous replication.
    First(u32),
    /// `ANY n (replicas…)`: quorum commit.
    Any(u32),
    /// A literal `synchronous_standby_names` value.
    Raw(String),
}

/// The shape of a local streaming-replication cluster.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// Directory under which every data directory is created.
    pub base_dir: PathBuf,
    /// One port per node: the first is the primary's, the others replicas'.
    pub ports: Vec<u16>,
    /// Synchronous replication over the (non-delayed) replicas, if any.
    pub sync: Option<SyncSpec>,
    /// Makes the last replica a delayed one (`recovery_min_apply_delay`).
    pub delayed: Option<Duration>,
    /// Settings for every node (e.g. `fsync = off` in tests).
    pub settings: BTreeMap<String, String>,
    /// See [`InstanceSpec::die_with_parent`].
    pub die_with_parent: bool,
    /// Name of the bootstrap superuser.
    pub superuser: String,
}

impl ClusterSpec {
    /// A primary plus `ports.len() - 1` replicas under `base_dir`.
    pub fn new(base_dir: impl Into<PathBuf>, ports: Vec<u16>) -> Self {
        Self {
            base_dir: base_dir.into(),
            ports,
            sync: None,
            delayed: None,
            settings: BTreeMap::new(),
            die_with_parent: false,
            superuser: "postgres".into(),
        }
    }

    /// The `synchronous_standby_names` value this spec asks for.
    pub fn sync_standby_names(&self) -> Option<String> {
        let names: Vec<String> = (1..self.ports.len())
            .filter(|i| self.delayed.is_none() || *i != self.ports.len() - 1)
            .map(node_name)
            .collect();
        match &self.sync {
            None => None,
            Some(SyncSpec::First(n)) => Some(format!("FIRST {n} ({})", names.join(", "))),
            Some(SyncSpec::Any(n)) => Some(format!("ANY {n} ({})", names.join(", "))),
            Some(SyncSpec::Raw(s)) => Some(s.clone()),
        }
    }
}

/// The member name of node `i` (0 is the initial primary): `node1`, `node2`…
pub fn node_name(i: usize) -> String {
    format!("node{}", i + 1)
}

/// A running local cluster: `nodes[0]` starts as the primary.
#[derive(Debug)]
pub struct LocalCluster {
    spec: ClusterSpec,
    nodes: Vec<Instance>,
}

impl LocalCluster {
    /// Creates and starts the cluster: initdb of the primary, then a
    /// pg_basebackup clone per replica, then synchronous replication if asked.
    pub fn start(spec: ClusterSpec, bins: &PgBinaries, run_as: &RunAs) -> Result<Self> {
        std::fs::create_dir_all(&spec.base_dir).map_err(crate::io_err(&spec.base_dir))?;
        run_as.own(&spec.base_dir)?;
        let mut nodes = Vec::with_capacity(spec.ports.len());
        for (i, port) in spec.ports.iter().enumerate() {
            let name = node_name(i);
            let mut ispec = InstanceSpec::new(&name, spec.base_dir.join(&name), *port);
            ispec.settings = spec.settings.clone();
            ispec.die_with_parent = spec.die_with_parent;
            // Local clusters are throwaway: tests and the standalone demo.
            ispec.no_sync = true;
            if i > 0 && i == spec.ports.len() - 1 {
                if let Some(d) = spec.delayed {
                    ispec.settings.insert(
                        "recovery_min_apply_delay".into(),
                        format!("{}ms", d.as_millis()),
                    );
                }
            }
            let mut inst = Instance::new(ispec, bins.clone(), run_as.clone());
            if i == 0 {
                inst.initdb(&spec.superuser)?;
            } else {
                let primary: &Instance = &nodes[0];
                inst.basebackup(primary.host(), primary.port(), &spec.superuser)?;
            }
            inst.start()?;
            nodes.push(inst);
        }
        let mut cluster = Self { spec, nodes };
        if let Some(ssn) = cluster.spec.sync_standby_names() {
            cluster.set_sync_standby_names(&ssn)?;
        }
        Ok(cluster)
    }

    /// The spec the cluster was built from.
    pub fn spec(&self) -> &ClusterSpec {
        &self.spec
    }

    /// All nodes; index 0 was the first primary.
    pub fn nodes(&self) -> &[Instance] {
        &self.nodes
    }

    /// One node, mutable for stop/start/promote.
    pub fn node(&mut self, i: usize) -> &mut Instance {
        &mut self.nodes[i]
    }

    /// `host:port` of every node, in node order.
    pub fn addrs(&self) -> Vec<String> {
        self.nodes.iter().map(Instance::addr).collect()
    }

    /// Sets `synchronous_standby_names` on node 0 and reloads it.
    pub fn set_sync_standby_names(&mut self, value: &str) -> Result<()> {
        let primary = &mut self.nodes[0];
        primary.set_setting("synchronous_standby_names", value)?;
        primary.reload()
    }

    /// Stops every node (fast mode), replicas first.
    pub fn stop_all(&mut self) -> Result<()> {
        let mut first_err = None;
        for n in self.nodes.iter_mut().rev() {
            if let Err(e) = n.stop(crate::StopMode::Fast) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}
