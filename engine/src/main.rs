//! The `flashsale` binary: command-line parsing and start-up glue only. Each subcommand
//! validates its configuration here and hands typed values to the library.
//!
//! Exit codes (CONTRACT.md section 1): 0 success, 2 usage error (clap), 1 anything else.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use flashsale_engine::config::{self, Config, Overrides};
use flashsale_engine::stack;

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
}

#[derive(Subcommand)]
enum StackAction {
    /// Start (or reuse) the stack and write DIR/env with the three URLs.
    Up {
        #[arg(long, default_value = config::DEFAULT_STACK_DIR)]
        dir: PathBuf,
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
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Stack { action: StackAction::Up { dir } } => {
            let env = stack::up(&dir)?;
            print!("{}", env.render());
            eprintln!(
                "stack up: data under {}, env written to {}",
                dir.display(),
                dir.join("env").display()
            );
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
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let (mut client, connection) =
            tokio_postgres::connect(&config.pg_url, tokio_postgres::NoTls)
                .await
                .with_context(|| format!("connect to PostgreSQL at {}", config.pg_url))?;
        let driver = tokio::spawn(connection);
        let report = flashsale_pg_worker::migrate(&mut client).await?;
        println!(
            "migrate: schema at version {} (applied now: {:?})",
            report.current_version, report.applied
        );
        drop(client);
        let _ = driver.await;
        Ok(())
    })
}
