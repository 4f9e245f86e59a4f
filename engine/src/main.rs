//! The `flashsale` binary: command-line parsing and start-up glue only. Each subcommand
//! validates its configuration here and hands typed values to the library.
//!
//! Exit codes (CONTRACT.md section 1): 0 success, 2 usage error (clap), 1 anything else.
//!
//! A panic in `flashsale serve` or `flashsale worker` aborts the process (after one
//! `tracing::error!` line): see [`fail_closed_on_panic`] for why, and why only here.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use flashsale_engine::app::config::{self, Config, Overrides};
use flashsale_engine::app::stack;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "flashsale", version, about = "Thread-per-core flash-sale reservation engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Private redis-server, PostgreSQL and nats-server on loopback (for development, tests
    /// and the demo).
    Stack {
        #[command(subcommand)]
        action: StackAction,
    },
    /// Apply the PostgreSQL schema (versioned, idempotent).
    Migrate(ConnArgs),
    /// The edge engine: glommio shards, HTTP and admin listeners, and the durable side.
    Serve(ServeArgs),
    /// The seed's scenario end to end: stack up, migrate, serve, create a hot-SKU activity,
    /// run the open-loop load generator, wait for the orders, print the report and the
    /// invariant verdict, stop everything it started.
    Demo(DemoArgs),
    /// The PostgreSQL worker pool (order-writer) and outbox publisher alone: no HTTP, no Redis.
    Worker(ConnWorkerArgs),
    /// The open-loop load generator (runs the `flashsale-loadgen` binary beside this one).
    Loadgen {
        /// Arguments for flashsale-loadgen (see `flashsale loadgen -- --help`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Control-plane calls against a running engine's admin listener (reconcile, activities).
    Admin(flashsale_engine::app::admin_cli::AdminArgs),
    /// A sale on the ha topology under a seeded fault schedule (kill, freeze, restart,
    /// partition, sometimes two at once) with an auditor: prints the schedule and the
    /// verdict; exit 0 when no invariant broke, 1 on any breach.
    Chaos(ChaosArgs),
}

#[derive(Args)]
struct ChaosArgs {
    /// The seed: the same one gives the same fault schedule.
    #[arg(long)]
    seed: u64,
    /// How long the sale runs (faults stop 5 s before the end).
    #[arg(long, default_value_t = 60)]
    duration_s: u64,
    /// Where the run's private servers keep their data (emptied first).
    #[arg(long, default_value = "/var/tmp/flashsale-chaos")]
    dir: PathBuf,
    /// The verdict as JSON (schedule, events, figures per round, answers, breaches).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Only `ha` (three nodes of every store).
    #[arg(long, default_value = "ha")]
    topology: String,
    /// Test only: switch one protection off in the instances (`scanner-off`), to show that
    /// the auditor sees a loss.
    #[arg(long, hide = true)]
    negative_control: Option<String>,
    /// Print the seed's schedule and stop (nothing is started).
    #[arg(long)]
    schedule_only: bool,
}

#[derive(Args)]
struct ConnWorkerArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// NATS URL (overrides FLASHSALE_NATS_URL).
    #[arg(long)]
    nats_url: Option<String>,
}

#[derive(Args)]
struct DemoArgs {
    /// Where the demo's private servers keep their data (outside the checkout, so that the
    /// `postgres` user can reach it when the checkout sits in a private home directory).
    #[arg(long, default_value = "/var/tmp/flashsale-demo")]
    dir: PathBuf,
    /// Units of the hot SKU (the seed: 10,000).
    #[arg(long, default_value_t = 10_000)]
    stock: u64,
    /// Distinct buyers (the seed's scenario scaled to this machine: at least 50,000).
    #[arg(long, default_value_t = 60_000)]
    users: u64,
    /// Arrival rate, requests per second (open loop).
    #[arg(long, default_value_t = 20_000)]
    rate: u64,
    /// Length of the run.
    #[arg(long, default_value_t = 15)]
    duration_s: u64,
    /// Share of requests that repeat an earlier request id of the same buyer (the seed: 10%).
    #[arg(long, default_value_t = 0.10)]
    duplicate_ratio: f64,
    /// Shards of the engine (default: half the cores, the rest for the load generator).
    #[arg(long)]
    shards: Option<usize>,
    /// Machine-readable report.
    #[arg(long, default_value = "var/demo-report.json")]
    json: PathBuf,
    /// Latency and throughput picture.
    #[arg(long, default_value = "var/demo-latency.svg")]
    svg: PathBuf,
    /// Servers per dependency: standalone, cluster (Redis Cluster 3+3) or ha (that, a 3-node
    /// NATS cluster and a PostgreSQL primary with 2 standbys).
    #[arg(long, default_value = "standalone")]
    topology: String,
    /// A fault injected a third of the way in: nats-leader, pg-primary (ha), redis-master
    /// (cluster, ha), instance (any: a second instance behind HAProxy, killed -9).
    #[arg(long)]
    fault: Option<String>,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// Redis URL (overrides FLASHSALE_REDIS_URL).
    #[arg(long)]
    redis_url: Option<String>,
    /// NATS URL (overrides FLASHSALE_NATS_URL).
    #[arg(long)]
    nats_url: Option<String>,
    /// Public listener (overrides FLASHSALE_HTTP_ADDR).
    #[arg(long)]
    http_addr: Option<String>,
    /// Admin listener (overrides FLASHSALE_ADMIN_ADDR).
    #[arg(long)]
    admin_addr: Option<String>,
    /// Number of shards (overrides FLASHSALE_SHARDS).
    #[arg(long)]
    shards: Option<usize>,
    /// Do not pin shards to cores (shared machines, laptops, CI).
    #[arg(long)]
    no_pin: bool,
    /// Start without FLASHSALE_PASS_KEYS using the well-known development key (never in
    /// production: anyone can mint passes).
    #[arg(long)]
    insecure_dev_auth: bool,
    /// Do not run the order-writer and outbox publisher in this process (run `flashsale
    /// worker` instead).
    #[arg(long)]
    no_worker: bool,
    /// Seconds between SIGTERM (readiness turns false, listeners stop accepting) and the
    /// stop: long enough for the load balancer's health check to take the instance out and
    /// for requests in flight to finish.
    #[arg(long, default_value_t = 5)]
    grace_s: u64,
}

#[derive(Subcommand)]
enum StackAction {
    /// Start (or reuse) the stack and write DIR/env with the three URLs.
    Up {
        #[arg(long, default_value = config::DEFAULT_STACK_DIR)]
        dir: PathBuf,
        /// standalone (one server each), cluster (Redis Cluster of 3 masters + 3 replicas;
        /// FLASHSALE_REDIS_URL lists every node) or ha (not available yet).
        #[arg(long, default_value = "standalone", value_parser = stack::Topology::parse)]
        topology: stack::Topology,
        /// Archive PostgreSQL's WAL into DIR/postgres/wal-archive (DIR/pg-standbys/wal-archive
        /// for ha), for `flashsale admin backup` and point-in-time restores; once on, it stays
        /// on for that data directory.
        #[arg(long)]
        archive_wal: bool,
    },
    /// Stop the stack's servers (only the processes it recorded).
    Down {
        #[arg(long, default_value = config::DEFAULT_STACK_DIR)]
        dir: PathBuf,
        /// Also delete the data directory.
        #[arg(long)]
        purge: bool,
    },
}

#[derive(Args)]
struct ConnArgs {
    /// TOML configuration file (default: flashsale.toml when present).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Stack directory whose env file supplies default URLs.
    #[arg(long, default_value = config::DEFAULT_STACK_DIR)]
    stack_dir: PathBuf,
    /// PostgreSQL URL (overrides FLASHSALE_PG_URL).
    #[arg(long)]
    pg_url: Option<String>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flashsale: error: {e:#}");
            // Input a command refused before touching anything is a usage error, like clap's.
            if e.downcast_ref::<flashsale_engine::app::backup::UsageError>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Stack { action: StackAction::Up { dir, topology, archive_wal } } => {
            let wal = if archive_wal {
                stack::WalArchiving::On
            } else {
                stack::WalArchiving::AsConfigured
            };
            let env = stack::up_with_archiving(&dir, topology, wal)?;
            print!("{}", env.render());
            eprintln!(
                "stack up: data under {}, env written to {}",
                dir.display(),
                dir.join("env").display()
            );
            let archive = stack::archive_dir(&dir, topology);
            if archive.is_dir() {
                eprintln!("stack up: PostgreSQL archives its WAL into {}", archive.display());
            }
            Ok(())
        }
        Command::Stack { action: StackAction::Down { dir, purge } } => {
            let stopped = stack::down(&dir, purge)?;
            eprintln!(
                "stack down: stopped {}",
                if stopped.is_empty() { "nothing".to_string() } else { stopped.join(", ") }
            );
            Ok(())
        }
        Command::Serve(args) => serve(args),
        Command::Demo(args) => demo(args),
        Command::Chaos(args) => chaos(args),
        Command::Worker(args) => worker(args),
        Command::Loadgen { args } => {
            let status = std::process::Command::new(sibling_binary("flashsale-loadgen")?)
                .args(args)
                .status()
                .context("run flashsale-loadgen")?;
            std::process::exit(status.code().unwrap_or(1));
        }
        Command::Admin(args) => {
            let out = &mut std::io::stdout().lock();
            match flashsale_engine::app::admin_cli::run(args, &config::process_env(), out)? {
                0 => Ok(()),
                status => std::process::exit(i32::from(status)),
            }
        }
        Command::Migrate(args) => {
            let overrides = Overrides { pg_url: args.pg_url, ..Default::default() };
            let config = Config::load(
                args.config.as_deref(),
                &config::process_env(),
                &overrides,
                &args.stack_dir,
            )?;
            migrate(&config)
        }
    }
}

fn migrate(config: &Config) -> anyhow::Result<()> {
    flashsale_engine::app::serve::migrate(config)
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    use flashsale_engine::app::serve::{self, Pinning, ServeConfig};

    fail_closed_on_panic();
    negative_control_switch();

    let overrides = Overrides {
        redis_url: args.redis_url,
        pg_url: args.conn.pg_url,
        nats_url: args.nats_url,
        http_addr: args.http_addr,
        admin_addr: args.admin_addr,
        shards: args.shards,
    };
    let config = Config::load(
        args.conn.config.as_deref(),
        &config::process_env(),
        &overrides,
        &args.conn.stack_dir,
    )?;
    let pass_keys = pass_keys(&config, args.insecure_dev_auth)?;
    if config.admin_token.is_none() && !config.admin_addr.ip().is_loopback() {
        anyhow::bail!(
            "the admin listener {} is not on loopback: set FLASHSALE_ADMIN_TOKEN to expose it",
            config.admin_addr
        );
    }
    migrate(&config)?;
    let edge = edge_config(&config)?;
    let mut serve_config = ServeConfig {
        shards: config.shards,
        pins: config.pins.clone(),
        pinning: if args.no_pin { Pinning::Unpinned } else { Pinning::PinPerCore },
        http_addr: config.http_addr,
        admin_addr: config.admin_addr,
        pass_keys,
        admin_token: config.admin_token.clone(),
        edge,
        durable: serve::durable_config(&config),
        io_memory_bytes: 1 << 20,
        render_extra: Some(prometheus_recorder()?),
        tracing: config.tracing.clone(),
        worker: (!args.no_worker).then(|| serve::worker_config(&config)),
    };
    serve_config.check_host();
    let handle = serve::start(serve_config)?;
    eprintln!(
        "flashsale serve: {} shards, public http://{}, admin http://{}",
        config.shards, handle.http_addr, handle.admin_addr
    );
    wait_for_termination()?;
    tracing::info!("signal received: draining");
    handle.drain();
    std::thread::sleep(std::time::Duration::from_secs(args.grace_s));
    handle.shutdown();
    Ok(())
}

/// The user-pass keys `serve` checks passes with: FLASHSALE_PASS_KEYS, or with
/// `--insecure-dev-auth` the public development key; none at all refuses to start.
fn pass_keys(
    config: &Config,
    insecure_dev_auth: bool,
) -> anyhow::Result<flashsale_engine::logic::auth::PassKeys> {
    use flashsale_engine::logic::auth::PassKeys;
    match (&config.pass_keys, insecure_dev_auth) {
        (Some(keys), _) => PassKeys::parse(keys).context("FLASHSALE_PASS_KEYS"),
        (None, true) => {
            tracing::warn!(
                "--insecure-dev-auth: accepting passes signed with the public development key \
                 (kid `dev`); never use this in production"
            );
            Ok(PassKeys::parse(flashsale_engine::logic::auth::DEV_PASS_KEYS)?)
        }
        (None, false) => anyhow::bail!(
            "serve refuses to start without user-pass keys: set FLASHSALE_PASS_KEYS=kid:hexkey \
             (or pass --insecure-dev-auth for local development)"
        ),
    }
}

/// The edge's configuration: the library's defaults for this `Config`, with the control key
/// and the payment key.
fn edge_config(config: &Config) -> anyhow::Result<flashsale_engine::shard::EdgeConfig> {
    let mut edge = flashsale_engine::app::serve::edge_config(config)?;
    edge.control = control_config(config)?;
    if let Some(hex_key) = &config.payment_key {
        let key = flashsale_io::key::HmacKey::from_hex(hex_key)
            .map_err(|e| anyhow::anyhow!("FLASHSALE_PAYMENT_KEY: {e}"))?;
        edge.payment_key = Some(key);
    }
    Ok(edge)
}

/// The control key and the mode state file (CONTRACT.md section 2).
fn control_config(
    config: &Config,
) -> anyhow::Result<flashsale_engine::durable::modes::ControlConfig> {
    let key = match &config.control_key {
        Some(hex) => Some(
            flashsale_engine::logic::modes::control_key(hex).map_err(|e| anyhow::anyhow!("{e}"))?,
        ),
        None => {
            tracing::warn!(
                "FLASHSALE_CONTROL_KEY is not set: every SKU NORMAL, mode changes refused"
            );
            None
        }
    };
    Ok(flashsale_engine::durable::modes::ControlConfig {
        key,
        state_file: Some(config.mode_state_file.clone()),
        modes: flashsale_engine::logic::modes::ModeConfig::default(),
    })
}

/// Blocks until SIGTERM or SIGINT.
fn wait_for_termination() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        Ok(())
    })
}

/// A binary built beside this one (same target directory), e.g. `flashsale-loadgen`.
fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locate the flashsale binary")?;
    let dir = exe.parent().context("binary without a directory")?;
    let path = dir.join(name);
    anyhow::ensure!(
        path.is_file(),
        "{} not found: build it with `cargo build --release -p flashsale-benches --bin {name}` \
         (./run does this)",
        path.display()
    );
    Ok(path)
}

/// `flashsale demo`: `app::demo` does every step.
fn demo(args: DemoArgs) -> anyhow::Result<()> {
    use flashsale_engine::app::demo::{self, DemoPlan, Fault};
    use flashsale_engine::app::stack::Topology;
    let plan = DemoPlan {
        dir: args.dir,
        stock: args.stock,
        users: args.users,
        rate: args.rate,
        duration_s: args.duration_s,
        duplicate_ratio: args.duplicate_ratio,
        shards: args.shards,
        json: args.json,
        svg: args.svg,
        topology: Topology::parse(&args.topology).map_err(anyhow::Error::msg)?,
        fault: args.fault.as_deref().map(Fault::parse).transpose().map_err(anyhow::Error::msg)?,
        loadgen: sibling_binary("flashsale-loadgen")?,
        engine: std::env::current_exe().context("the flashsale binary's path")?,
    };
    demo::run(&plan)
}

/// `FLASHSALE_TEST_FAILPOINT=<name>`: one negative-control failpoint switched on (`return`)
/// for this process — `flashsale chaos --negative-control` sets it on its instances. Only
/// in builds with the `failpoints` feature (the workspace's test builds); never in a release.
#[cfg(feature = "failpoints")]
fn negative_control_switch() {
    if let Ok(name) = std::env::var("FLASHSALE_TEST_FAILPOINT") {
        match fail::cfg(&name, "return") {
            Ok(()) => tracing::warn!(failpoint = %name, "negative control: a protection is OFF"),
            Err(e) => tracing::error!(failpoint = %name, error = %e, "negative control refused"),
        }
    }
}

#[cfg(not(feature = "failpoints"))]
fn negative_control_switch() {}

/// `flashsale chaos`: `app::chaos` does every step; exit 1 on any breach.
fn chaos(args: ChaosArgs) -> anyhow::Result<()> {
    use flashsale_engine::app::chaos::{self, ChaosPlan};
    anyhow::ensure!(args.topology == "ha", "flashsale chaos runs on --topology ha only");
    if args.schedule_only {
        let bounds = chaos::schedule::Bounds::default();
        let schedule =
            chaos::schedule::Schedule::from_seed(args.seed, args.duration_s * 1_000, &bounds);
        print!("{}", schedule.render());
        return Ok(());
    }
    let negative_control =
        args.negative_control.as_deref().map(chaos::NegativeControl::parse).transpose();
    let negative_control = negative_control.map_err(anyhow::Error::msg)?;
    anyhow::ensure!(
        negative_control.is_none() || cfg!(feature = "failpoints"),
        "--negative-control needs a build with the failpoints feature (a workspace test build)"
    );
    let plan = ChaosPlan {
        negative_control,
        seed: args.seed,
        duration_s: args.duration_s,
        dir: args.dir,
        json: args.json,
        engine: std::env::current_exe().context("the flashsale binary's path")?,
    };
    let verdict = chaos::run(&plan)?;
    if !verdict.breaches.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}

/// `flashsale worker`: the durable pipeline alone, scaled separately from the edge.
fn worker(args: ConnWorkerArgs) -> anyhow::Result<()> {
    fail_closed_on_panic();
    let overrides =
        Overrides { pg_url: args.conn.pg_url, nats_url: args.nats_url, ..Default::default() };
    let config = Config::load(
        args.conn.config.as_deref(),
        &config::process_env(),
        &overrides,
        &args.conn.stack_dir,
    )?;
    migrate(&config)?;
    let worker_config = flashsale_engine::app::serve::worker_config(&config);
    let handle = flashsale_pg_worker::worker::start(worker_config)
        .map_err(|e| anyhow::anyhow!("start the worker: {e}"))?;
    eprintln!("flashsale worker: consuming SECKILL_ORDERS into {}", config.pg_url);
    wait_for_termination()?;
    tracing::info!("signal received: finishing the batch in hand, then stopping");
    handle.shutdown().map_err(|e| anyhow::anyhow!("worker shutdown: {e}"))?;
    Ok(())
}

/// Installs the process-wide recorder of the `metrics` crate (the worker, the log client) and
/// returns its renderer, appended to the edge's own counters on `/metrics`.
fn prometheus_recorder() -> anyhow::Result<Box<dyn Fn() -> String + Send + Sync>> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("install the Prometheus recorder")?;
    Ok(Box::new(move || handle.render()))
}

/// Makes every panic of this process stop the whole process: one `tracing::error!` line with
/// the message, the thread and the location (and a backtrace when `RUST_BACKTRACE` asks for
/// one), then `abort`. Installed by `serve` and `worker`, the two commands that acknowledge
/// anything.
///
/// Why: the release assertions on the sale's invariants (`logic/partition.rs`,
/// `logic/reconcile.rs`, the permits and bounds of `logic/submit.rs`, and those of the other
/// crates) panic where going on would mean oversell, a double order, a lost reservation or a
/// false `ok`. Left to unwind, such a panic ends one glommio shard or one tokio task (tokio
/// keeps a task's panic in its `JoinHandle`), and the rest of the process carries on: the other
/// shards keep answering buyers, the worker keeps committing and acking, redis-sync keeps
/// applying. Fail closed instead: nothing is answered or acknowledged after the breach. What is
/// in flight at that moment is what a `kill -9` leaves, which the design survives (an
/// unacknowledged message is redelivered, a reservation without an answer is republished by
/// the scanner, an unknown outcome is never guessed), and the log line names what broke.
///
/// Why only here, not in the library: the in-process engine of the integration tests
/// (`tests/src`) and the unit tests run the same code, and there a panic must stay an ordinary
/// panic: one failed test (or a `#[should_panic]` one that passes), not an aborted test binary.
fn fail_closed_on_panic() {
    std::panic::set_hook(Box::new(|info| {
        // `PanicHookInfo::payload_as_str` is newer than the workspace's rust-version.
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(a panic without a message)");
        let location = info.location().map_or_else(String::new, ToString::to_string);
        let thread = std::thread::current();
        let thread = thread.name().unwrap_or("(unnamed)");
        let backtrace = std::backtrace::Backtrace::capture();
        if backtrace.status() == std::backtrace::BacktraceStatus::Captured {
            tracing::error!(
                thread,
                location,
                "panic, aborting (fail closed): {message}\n{backtrace}"
            );
        } else {
            tracing::error!(thread, location, "panic, aborting (fail closed): {message}");
        }
        std::process::abort();
    }));
}
