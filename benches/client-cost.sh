#!/usr/bin/env bash
# benches/client-cost.sh — what the load generator costs per request, beside wrk (issue 25
# item 5): the instrument must not cost more than the reference client on the same box.
#
#   benches/client-cost.sh            # builds the two release binaries, 3 alternated rounds
#   ROUNDS=5 RATE=25000 benches/client-cost.sh
#
# What it does:
#  1. `cargo build --release -p flashsale-benches --bin flashsale-loadgen --bin flashsale-bare`
#     into $CARGO_TARGET_DIR (default /work/target-loadgen; SKIP_BUILD=1 skips it).
#  2. Starts `flashsale-bare --shards 1` (the bare glommio server: the engine's parser and
#     writer answering a fixed SOLD_OUT body). PIN=1 (default): the server's executor pinned
#     to core $SERVER_CPU and each client held to core $CLIENT_CPU by taskset, so the two never
#     share a core and the client's CPU is its own; PIN=0: everything floats (`--no-pin`, no
#     taskset) — noisier, closer to the demo.
#  3. $ROUNDS rounds, the order alternating (wrk first in odd rounds, the generator first in
#     even ones), each client for $DURATION_S s on $CONNECTIONS connections, no pipelining:
#     - wrk -t1 -c$CONNECTIONS -d${DURATION_S}s with a Lua script that only sets the method,
#       headers and body once (no per-request Lua): the same request shape as the generator's
#       (POST /v1/reservations, a bearer pass of a real pass's length, the JSON body).
#     - flashsale-loadgen --threads 1 --pipeline 1 --retry off, open loop at $RATE req/s, or,
#       when RATE is unset, at $RATE_FACTOR x the rate wrk achieved in the same round.
#       RATE_FACTOR=0.9 (default): paced just below what the server sustains, the
#       generator's job; the server then idles between requests, and on a VM every wake-up of
#       an idle server (charged to the sender's send) and of the generator costs several µs,
#       which a closed-loop wrk that keeps the server saturated never pays. RATE_FACTOR=1.3:
#       more than the server takes, so both clients keep it saturated: like for like.
#  4. CPU: utime + stime of the client's process from /proc/<pid>/stat, polled every 10 ms
#     while it runs (the last reading is at most 10 ms before it exits: the same small
#     under-count, at the idle tail, for both clients), divided by the requests answered
#     (wrk: "N requests"; the generator: `answered` of its JSON report). The generator also
#     reports its own CPU over the schedule alone (`client_cpu` in the report, when the binary
#     has it), printed beside for a cross-check.
#  5. Prints each round and the medians; writes everything to $OUT (JSON).
#
# Knobs (environment): ROUNDS DURATION_S CONNECTIONS RATE RATE_FACTOR PIN SERVER_CPU
# CLIENT_CPU USERS LOADGEN (another generator binary, e.g. an older build, for before/after)
# SKIP_BUILD CARGO_TARGET_DIR LOGS OUT.
#
# Keep it short on a shared box: 3 rounds x 2 clients x 5 s is about 40 s of load.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
DURATION_S=${DURATION_S:-5}
CONNECTIONS=${CONNECTIONS:-64}
RATE=${RATE:-}
RATE_FACTOR=${RATE_FACTOR:-0.9}
PIN=${PIN:-1}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
USERS=${USERS:-1000}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-loadgen}
BIN=$CARGO_TARGET_DIR/release
LOADGEN=${LOADGEN:-$BIN/flashsale-loadgen}
LOGS=${LOGS:-var/client-cost}
OUT=${OUT:-$LOGS/client-cost-$(date -u +%FT%H%M%SZ).json}

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    cargo build --release -p flashsale-benches --bin flashsale-loadgen --bin flashsale-bare >&2
fi
command -v wrk >/dev/null || { echo "client-cost: wrk missing: apt-get install -y wrk" >&2; exit 1; }
for b in "$BIN/flashsale-bare" "$LOADGEN"; do
    [ -x "$b" ] || { echo "client-cost: $b missing" >&2; exit 1; }
done
mkdir -p "$LOGS" "$(dirname "$OUT")"
TICKS=$(getconf CLK_TCK)

BARE_PID=""
cleanup() {
    if [ -n "$BARE_PID" ]; then
        kill "$BARE_PID" 2>/dev/null || true
        wait "$BARE_PID" 2>/dev/null || true
    fi
}
trap cleanup EXIT

NO_PIN=()
TASKSET=()
if [ "$PIN" = 1 ]; then
    TASKSET=(taskset -c "$CLIENT_CPU")
    SERVER_TASKSET=(taskset -c "$SERVER_CPU")
else
    NO_PIN=(--no-pin)
    SERVER_TASKSET=()
fi
# One shard; pinned, glommio places executor 0 on the first core of its CPU set.
"${SERVER_TASKSET[@]}" "$BIN/flashsale-bare" --shards 1 "${NO_PIN[@]}" >"$LOGS/bare.log" 2>&1 &
BARE_PID=$!
URL=""
for _ in $(seq 200); do
    URL=$(grep -oE 'http://[0-9.:]+' "$LOGS/bare.log" | head -1 || true)
    [ -n "$URL" ] && break
    sleep 0.05
done
[ -n "$URL" ] || { echo "client-cost: flashsale-bare did not start" >&2; cat "$LOGS/bare.log" >&2; exit 1; }
echo "client-cost: flashsale-bare $URL (pid $BARE_PID, pin=$PIN)" >&2

# The generator's request: a pass of a real pass's length (v1.dev.<user>.<activity>.<exp>.
# <43-character signature>), the body with a request id of the generator's shape.
PASS="v1.dev.123.10001.1790000000.$(printf 'A%.0s' $(seq 43))"
BODY='{"activity_id":10001,"sku_id":20001,"request_id":"lgabcdefg-123456","quantity":1}'
cat >"$LOGS/wrk.lua" <<EOF
wrk.method = "POST"
wrk.path = "/v1/reservations"
wrk.body = '$BODY'
wrk.headers["Authorization"] = "Bearer $PASS"
wrk.headers["Content-Type"] = "application/json"
EOF

# Runs "$@" in the background and prints the CPU seconds of that process (utime + stime
# from /proc/<pid>/stat, its last reading before it exits). Its output goes to $RUN_LOG.
cpu_of() {
    "$@" >"$RUN_LOG" 2>&1 &
    local pid=$! last="" line
    while [ -r "/proc/$pid/stat" ]; do
        if read -r line <"/proc/$pid/stat" 2>/dev/null; then
            # Fields after the last ')': state is field 3, utime 14, stime 15.
            line=${line##*) }
            set -- $line
            [ "$1" = Z ] || last=$(( ${12} + ${13} ))
        fi
        sleep 0.01
    done
    wait "$pid" || { echo "client-cost: $* failed:" >&2; cat "$RUN_LOG" >&2; return 1; }
    awk -v t="$last" -v hz="$TICKS" 'BEGIN { printf "%.3f", t / hz }'
}

run_wrk() {
    local round=$1
    RUN_LOG="$LOGS/wrk-$round.txt"
    WRK_CPU=$(cpu_of "${TASKSET[@]}" wrk -t1 -c"$CONNECTIONS" -d"${DURATION_S}s" \
        -s "$LOGS/wrk.lua" "$URL")
    WRK_REQ=$(awk '/requests in/ { print $1 }' "$RUN_LOG")
    WRK_RPS=$(awk '/^Requests\/sec/ { print $2 }' "$RUN_LOG")
    WRK_ERR=$(awk '/Non-2xx|Socket errors/ { print }' "$RUN_LOG" | tr '\n' ' ')
}

run_loadgen() {
    local round=$1 rate=$2
    RUN_LOG="$LOGS/loadgen-$round.txt"
    LG_CPU=$(cpu_of "${TASKSET[@]}" "$LOADGEN" --target "$URL" --rate "$rate" \
        --duration-s "$DURATION_S" --connections "$CONNECTIONS" --pipeline 1 --threads 1 \
        --users "$USERS" --duplicate-ratio 0 --retry off --quiet --run-id "cc$round" \
        --json "$LOGS/loadgen-$round.json")
    LG_REQ=$(jq -r .answered "$LOGS/loadgen-$round.json")
    LG_RPS=$(jq -r .achieved_rps "$LOGS/loadgen-$round.json")
    LG_P99=$(jq -r .latency_ms.p99 "$LOGS/loadgen-$round.json")
    LG_SELF=$(jq -r '.client_cpu.us_per_answer // "null"' "$LOGS/loadgen-$round.json")
}

us_per() { awk -v c="$1" -v n="$2" 'BEGIN { if (n > 0) printf "%.2f", c * 1e6 / n; else print "null" }'; }

ROWS=()
for round in $(seq "$ROUNDS"); do
    order=(wrk loadgen)
    [ $((round % 2)) = 0 ] && order=(loadgen wrk)
    # The generator's rate comes from wrk's in the same round: in even rounds wrk runs second,
    # so the previous round's wrk rate is used (the first round always starts with wrk).
    for client in "${order[@]}"; do
        if [ "$client" = wrk ]; then
            run_wrk "$round"
            echo "round $round wrk: $WRK_REQ requests, $WRK_RPS req/s, $WRK_CPU s CPU = $(us_per "$WRK_CPU" "$WRK_REQ") us/request $WRK_ERR" >&2
        else
            rate=${RATE:-$(awk -v r="$WRK_RPS" -v f="$RATE_FACTOR" 'BEGIN { printf "%d", r * f }')}
            run_loadgen "$round" "$rate"
            echo "round $round loadgen at $rate req/s: $LG_REQ answered, $LG_RPS req/s, p99 $LG_P99 ms, $LG_CPU s CPU = $(us_per "$LG_CPU" "$LG_REQ") us/request (own report: $LG_SELF us over the schedule)" >&2
        fi
    done
    ROWS+=("$(jq -n --argjson round "$round" \
        --argjson wrk_cpu_s "$WRK_CPU" --argjson wrk_requests "$WRK_REQ" --argjson wrk_rps "$WRK_RPS" \
        --argjson lg_rate "$rate" --argjson lg_cpu_s "$LG_CPU" --argjson lg_answered "$LG_REQ" \
        --argjson lg_rps "$LG_RPS" --argjson lg_p99 "$LG_P99" --argjson lg_self "$LG_SELF" '{
          round: $round,
          wrk: {cpu_s: $wrk_cpu_s, requests: $wrk_requests, rps: $wrk_rps,
                us_per_request: (($wrk_cpu_s * 1e6 / $wrk_requests) * 100 | round / 100)},
          loadgen: {rate: $lg_rate, cpu_s: $lg_cpu_s, answered: $lg_answered, rps: $lg_rps,
                    p99_ms: $lg_p99, self_reported_us_per_answer: $lg_self,
                    us_per_request: (($lg_cpu_s * 1e6 / $lg_answered) * 100 | round / 100)}}')")
done

CPU_MODEL=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p')
printf '%s\n' "${ROWS[@]}" | jq -s \
    --arg date "$(date -u +%FT%TZ)" --arg cpu "$CPU_MODEL" --arg kernel "$(uname -r)" \
    --arg pin "$PIN" --arg loadgen "$LOADGEN" --argjson connections "$CONNECTIONS" \
    --argjson duration_s "$DURATION_S" --arg rate "${RATE:-}" --argjson rate_factor "$RATE_FACTOR" '
    def median: sort | if length == 0 then null elif length % 2 == 1 then .[length / 2 | floor]
        else (.[length / 2 - 1] + .[length / 2]) / 2 end;
    {date: $date, machine: {cpu: $cpu, kernel: $kernel},
     setup: {server: "flashsale-bare --shards 1", pinned: ($pin == "1"),
             connections: $connections, duration_s: $duration_s, pipeline: 1,
             loadgen_rate: (if $rate == "" then "\($rate_factor) x the wrk rate" else $rate end),
             loadgen: $loadgen, wrk: "wrk -t1 (static Lua request)"},
     wrk_us_per_request_median: (map(.wrk.us_per_request) | median),
     loadgen_us_per_request_median: (map(.loadgen.us_per_request) | median),
     wrk_rps_median: (map(.wrk.rps) | median),
     loadgen_rps_median: (map(.loadgen.rps) | median),
     rounds: .}' >"$OUT"
jq -r '"medians of \(.rounds | length): wrk \(.wrk_us_per_request_median) us/request at \(.wrk_rps_median) req/s; flashsale-loadgen \(.loadgen_us_per_request_median) us/request at \(.loadgen_rps_median) req/s"' "$OUT"
echo "client-cost: written to $OUT" >&2
