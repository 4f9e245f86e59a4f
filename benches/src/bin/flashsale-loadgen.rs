//! `flashsale-loadgen`: the open-loop load generator (`flashsale loadgen` execs this binary).
//! Parsing and exit codes only; everything else is `flashsale_benches::loadgen`.
//!
//! Exit codes (CONTRACT.md section 1): 0 the run completed and every checked invariant held,
//! 1 the run failed, a checked invariant was violated, or (with `--pg-url`) the orders did not
//! drain in time; 2 usage errors. With `--max-rate-search`: 0 when the search completed
//! (whatever rate it found), 1 when it could not run, 2 usage errors.

use std::process::ExitCode;

use clap::Parser;
use flashsale_benches::loadgen::{self, cli::Args, LoadError};

fn main() -> ExitCode {
    let args = Args::parse(); // exits 2 on usage errors, 0 on --help / --version
    if let Some(search) = args.search_config() {
        return match search
            .map_err(LoadError::from)
            .and_then(|search| loadgen::search::run(args.into_config(), search))
        {
            Ok(report) => {
                print!("{}", report.render_text());
                ExitCode::SUCCESS
            }
            Err(e) => error_exit(e),
        };
    }
    match loadgen::run(args.into_config()) {
        Ok(report) => {
            print!("{}", report.render_text());
            if report.invariants.ok == Some(false) {
                eprintln!("flashsale-loadgen: invariants violated (see above)");
                return ExitCode::FAILURE;
            }
            // Checked before the orders were all made: the verdict covers a moving target, so
            // a run that was asked to wait for them and could not is not a success.
            if report.invariants.drained == Some(false) {
                eprintln!(
                    "flashsale-loadgen: the asynchronous path did not drain within \
                     --drain-timeout-s (is the order worker running?)"
                );
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => error_exit(e),
    }
}

/// Usage errors exit 2, everything else 1 (CONTRACT.md section 1).
fn error_exit(e: LoadError) -> ExitCode {
    eprintln!("flashsale-loadgen: error: {e}");
    match e {
        LoadError::Config(_) => ExitCode::from(2),
        _ => ExitCode::FAILURE,
    }
}
