//! Stopping a real PostgreSQL through the test kit's `Instance`.

use pgwarden_testkit::{StopMode, TestCluster};

/// An immediate stop is certain: a postmaster that does not exit (frozen
/// here by SIGSTOP, as a hung host would leave it) is killed with its
/// children after a bounded wait, instead of the stop failing after a
/// minute with the server still holding its port and its data.
#[test]
fn an_immediate_stop_kills_a_frozen_server() {
    let mut c = TestCluster::builder().replicas(0).start();
    let pid = c.node(0).postmaster_pid().expect("running");
    c.node(0).signal(nix::sys::signal::Signal::SIGSTOP).unwrap();
    let t0 = std::time::Instant::now();
    c.node(0).stop(StopMode::Immediate).unwrap();
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(30),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(c.node(0).postmaster_pid(), None);
    assert!(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err());
}
