#!/usr/bin/env bash
# The floors table (README "Floors"): each building block's own CPU for one sold unit's work
# done as leanly as it can be (benches/benches/floors.rs), then the engine's own use of
# PostgreSQL for the same rows at the same batch bound (the order_pipeline bench's default
# set-based case), in one run on this machine. The demo's CPU table (`./run demo`, its
# var/demo-report.json) gives the last column of the first table.
#   benches/floors.sh            # 3 rounds each; FLASHSALE_FLOORS_ROUNDS / _UNITS to change
set -euo pipefail
cd "$(dirname "$0")/.."
cargo bench -p flashsale-benches --bench floors
FLASHSALE_BENCH_CASES="${FLASHSALE_BENCH_CASES:-set:512:4}" \
    cargo bench -p flashsale-benches --bench order_pipeline
