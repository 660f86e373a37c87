//! `pgwarden`: a PostgreSQL high-availability connection manager.
//!
//! The binary is thin: it parses the command line, sets up logging and the
//! runtime, and hands over to the library crates.

mod agent_cmd;
mod ctl;
mod demo;
mod run_cmd;
mod topology_cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// PostgreSQL high-availability connection manager.
#[derive(Debug, Parser)]
#[command(name = "pgwarden", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the connection manager in front of a cluster (standalone mode).
    Run(run_cmd::Args),
    /// Probe a cluster and show its topology, or the hosts a selector picks.
    Topology(topology_cmd::Args),
    /// Run the HA agent of one node, with its connection manager.
    Agent(agent_cmd::Args),
    /// Start a local demo cluster (a primary and replicas) and watch it.
    Demo(demo::Args),
    /// Operate an HA cluster through a member's REST API.
    Ctl(ctl::Args),
    /// Internal: started by the agent while it leads; stops its PostgreSQL
    /// if the agent dies.
    #[command(hide = true)]
    Fence(FenceArgs),
}

/// Options of the internal `pgwarden fence`.
#[derive(Debug, clap::Args)]
struct FenceArgs {
    /// The agent to watch.
    #[arg(long)]
    agent_pid: i32,
    /// The data directory whose postmaster to stop.
    #[arg(long)]
    data_dir: std::path::PathBuf,
}

/// glibc's allocator, with the worker threads' short lists of the aligned
/// blocks each connection takes (see `pgwarden_proxy::Allocator`).
#[global_allocator]
static ALLOCATOR: pgwarden_proxy::Allocator = pgwarden_proxy::Allocator;

fn main() -> ExitCode {
    pgwarden_proxy::tune_allocator();
    let cli = Cli::parse();
    // `run` and `agent` set logging up from their file's [log] section.
    if !matches!(cli.command, Command::Run(_) | Command::Agent(_)) {
        init_logging(None);
    }
    if matches!(cli.command, Command::Run(_) | Command::Agent(_)) {
        catch_early_hangup();
    }
    match cli.command {
        Command::Fence(args) => {
            pgwarden_agent::fence::run(args.agent_pid, args.data_dir);
            return ExitCode::SUCCESS;
        }
        Command::Run(args) => return report(run_cmd::run(args)),
        Command::Agent(args) => return report(agent_cmd::run(args)),
        _ => {}
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pgwarden: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Topology(args) => runtime.block_on(topology_cmd::run(args)),
        Command::Demo(args) => demo::run(args, &runtime),
        Command::Ctl(args) => runtime.block_on(ctl::run(args)),
        Command::Run(_) | Command::Agent(_) | Command::Fence(_) => unreachable!("handled above"),
    };
    run_cmd::finish(runtime);
    report(result)
}

fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pgwarden: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A SIGHUP that came before the running process listened for it.
static EARLY_HANGUP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn note_hangup(_: nix::libc::c_int) {
    EARLY_HANGUP.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Until `serve` listens for SIGHUP, its default action would end the
/// process: a reload sent by a service manager or a log rotation in the
/// first moments of a start would look like a clean exit. It is noted
/// instead, and `serve` reloads once it runs ([`early_hangup`]).
#[allow(unsafe_code)]
fn catch_early_hangup() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(note_hangup),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    // SAFETY: the handler only stores to an atomic, which is
    // async-signal-safe; tokio's own handler, installed later, calls it
    // as the previous one, which does no harm.
    if let Err(e) = unsafe { sigaction(Signal::SIGHUP, &action) } {
        // Logging is not set up yet.
        eprintln!("pgwarden: cannot catch SIGHUP during start-up: {e}");
    }
}

/// Whether a SIGHUP came before the caller listened for it (taken once).
pub(crate) fn early_hangup() -> bool {
    EARLY_HANGUP.swap(false, std::sync::atomic::Ordering::SeqCst)
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM, the two ways operators and
/// service managers ask a process to stop. Both are caught from the call
/// on, not from the first poll of the future.
pub(crate) fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// Logs go to stderr so that stdout carries only the command's output
/// (tables, JSON lines) and can be piped. `RUST_LOG`, when set, filters
/// instead of `[log] level`.
pub(crate) fn init_logging(log: Option<&pgwarden_config::LogConfig>) {
    let level = log.map_or("info", |l| l.level.as_str());
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if log.is_some_and(|l| l.format == pgwarden_config::LogFormat::Json) {
        builder.json().init();
    } else {
        builder.init();
    }
}
