#!/usr/bin/env bash
# benches/client-cost.sh — what the load generator costs per request, beside wrk (issue 25
# item 5): the instrument must not cost more than the reference client on the same box.
#
#   benches/client-cost.sh                 # builds the two release binaries, 5 alternated rounds
#   ROUNDS=3 RATE_FACTORS="0.9" benches/client-cost.sh
#   LOADGEN_BEFORE=/path/to/older/flashsale-loadgen benches/client-cost.sh   # before/after too
#
# What it does:
#  1. `cargo build --release -p flashsale-benches --bin flashsale-loadgen --bin flashsale-bare`
#     into $CARGO_TARGET_DIR (default target; SKIP_BUILD=1 skips it). wrk is Debian's `wrk`
#     package: without it the script stops at once and says how to install it.
#  2. Starts `flashsale-bare --shards 1` (the bare glommio server: the engine's parser and
#     writer answering a fixed SOLD_OUT body), the same server for every client. PIN=1
#     (default): the server's executor pinned to core $SERVER_CPU and each client held to core
#     $CLIENT_CPU by taskset, so the two never share a core and the client's CPU is its own;
#     PIN=0: everything floats (`--no-pin`, no taskset) — noisier, closer to the demo.
#  3. $ROUNDS rounds; in each, every client runs once for $DURATION_S s on $CONNECTIONS
#     connections, no pipelining, and the order rotates from round to round (A/B alternation:
#     the machine is shared and its speed drifts within minutes):
#     - wrk -t1 -c$CONNECTIONS -d${DURATION_S}s with a Lua script that only sets the method,
#       headers and body once (no per-request Lua): the same request shape as the generator's
#       (POST /v1/reservations, a bearer pass of a real pass's length, the JSON body).
#     - flashsale-loadgen --threads 1 --pipeline 1 --retry off, open loop, once per factor of
#       $RATE_FACTORS at that factor × the rate wrk achieved in the same round (the previous
#       round's when wrk runs later in this one), or at $RATE when set:
#       0.9 — paced just below what the server sustains: the generator's job. The server then
#         idles between requests, and on this VM every wake-up of an idle vCPU costs the
#         side that causes it several µs (a `send` to an idle server pays for waking it),
#         which a closed-loop wrk that keeps the server saturated never pays.
#       1.3 — more than the server takes, so both clients keep it saturated: like for like.
#     - with LOADGEN_BEFORE set, that binary too at each factor (before/after in one session).
#  4. CPU: utime + stime of the client's process from /proc/<pid>/stat, polled every 10 ms
#     while it runs (the last reading is at most 10 ms before it exits: the same small
#     under-count, at the idle tail, for both clients), divided by the requests answered
#     (wrk: "N requests"; the generator: `answered` of its JSON report). The generator also
#     reports its own CPU over the schedule alone (`client_cpu` in its report), printed beside
#     for a cross-check.
#  5. Prints each run, then per client and factor the median µs per request and the median of
#     the per-round ratios to wrk (< 1: cheaper than wrk); writes everything to $OUT (JSON).
#
# Knobs (environment): ROUNDS DURATION_S CONNECTIONS RATE RATE_FACTORS PIN SERVER_CPU
# CLIENT_CPU USERS LOADGEN LOADGEN_BEFORE SKIP_BUILD CARGO_TARGET_DIR LOGS OUT.
#
# Keep it short on a shared box: 5 rounds × 3 clients × 4 s is about a minute and a half.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-5}
DURATION_S=${DURATION_S:-4}
CONNECTIONS=${CONNECTIONS:-64}
RATE=${RATE:-}
RATE_FACTORS=${RATE_FACTORS:-0.9 1.3}
PIN=${PIN:-1}
SERVER_CPU=${SERVER_CPU:-0}
CLIENT_CPU=${CLIENT_CPU:-1}
USERS=${USERS:-1000}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
BIN=$CARGO_TARGET_DIR/release
LOADGEN=${LOADGEN:-$BIN/flashsale-loadgen}
LOADGEN_BEFORE=${LOADGEN_BEFORE:-}
LOGS=${LOGS:-var/client-cost}
OUT=${OUT:-$LOGS/client-cost-$(date -u +%FT%H%M%SZ).json}

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    cargo build --release -p flashsale-benches --bin flashsale-loadgen --bin flashsale-bare >&2
fi
if ! command -v wrk >/dev/null; then
    echo "client-cost: wrk is not installed, so there is nothing to compare with." >&2
    echo "client-cost: install it with: apt-get install -y wrk   (Debian package 'wrk')" >&2
    exit 1
fi
for b in "$BIN/flashsale-bare" "$LOADGEN" ${LOADGEN_BEFORE:+"$LOADGEN_BEFORE"}; do
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
    local name=$1 bin=$2 rate=$3
    RUN_LOG="$LOGS/$name.txt"
    LG_CPU=$(cpu_of "${TASKSET[@]}" "$bin" --target "$URL" --rate "$rate" \
        --duration-s "$DURATION_S" --connections "$CONNECTIONS" --pipeline 1 --threads 1 \
        --users "$USERS" --duplicate-ratio 0 --retry off --quiet --run-id "cc$RANDOM" \
        --json "$LOGS/$name.json")
    LG_REQ=$(jq -r .answered "$LOGS/$name.json")
    LG_RPS=$(jq -r .achieved_rps "$LOGS/$name.json")
    LG_P50=$(jq -r .latency_ms.p50 "$LOGS/$name.json")
    LG_P99=$(jq -r .latency_ms.p99 "$LOGS/$name.json")
    LG_SELF=$(jq -r '.client_cpu.us_per_answer // "null"' "$LOGS/$name.json")
}

us_per() { awk -v c="$1" -v n="$2" 'BEGIN { if (n > 0) printf "%.2f", c * 1e6 / n; else print "null" }'; }

# The clients of one round: wrk, then the generator (and the older one) at each factor.
CLIENTS=(wrk)
for f in $RATE_FACTORS; do
    CLIENTS+=("loadgen@$f")
    [ -n "$LOADGEN_BEFORE" ] && CLIENTS+=("before@$f")
done

ROWS=()
WRK_RPS=""
for round in $(seq "$ROUNDS"); do
    # Rotate the order: round r starts with client r - 1 (mod n); round 1 starts with wrk,
    # whose rate the generators' rates come from.
    n=${#CLIENTS[@]}
    order=()
    for k in $(seq 0 $((n - 1))); do order+=("${CLIENTS[$(((round - 1 + k) % n))]}"); done
    RUNS=()
    for client in "${order[@]}"; do
        if [ "$client" = wrk ]; then
            run_wrk "$round"
            WRK_US=$(us_per "$WRK_CPU" "$WRK_REQ")
            echo "round $round wrk: $WRK_REQ requests, $WRK_RPS req/s, $WRK_CPU s CPU = $WRK_US us/request $WRK_ERR" >&2
            RUNS+=("$(jq -n --arg client wrk --argjson cpu_s "$WRK_CPU" --argjson requests "$WRK_REQ" \
                --argjson rps "$WRK_RPS" --argjson us "$WRK_US" \
                '{client: $client, cpu_s: $cpu_s, requests: $requests, rps: $rps, us_per_request: $us}')")
            continue
        fi
        kind=${client%@*} factor=${client#*@}
        bin=$LOADGEN
        [ "$kind" = before ] && bin=$LOADGEN_BEFORE
        rate=${RATE:-$(awk -v r="$WRK_RPS" -v f="$factor" 'BEGIN { printf "%d", r * f }')}
        run_loadgen "$kind-$factor-$round" "$bin" "$rate"
        LG_US=$(us_per "$LG_CPU" "$LG_REQ")
        echo "round $round $kind x$factor at $rate req/s: $LG_REQ answered, $LG_RPS req/s, p50 $LG_P50 / p99 $LG_P99 ms, $LG_CPU s CPU = $LG_US us/request (own report: $LG_SELF us over the schedule)" >&2
        RUNS+=("$(jq -n --arg client "$kind" --argjson factor "$factor" --argjson rate "$rate" \
            --argjson cpu_s "$LG_CPU" --argjson requests "$LG_REQ" --argjson rps "$LG_RPS" \
            --argjson p50 "$LG_P50" --argjson p99 "$LG_P99" --argjson self "$LG_SELF" \
            --argjson us "$LG_US" '{client: $client, rate_factor: $factor, rate: $rate,
              cpu_s: $cpu_s, requests: $requests, rps: $rps, p50_ms: $p50, p99_ms: $p99,
              self_reported_us_per_answer: $self, us_per_request: $us}')")
    done
    ROWS+=("$(printf '%s\n' "${RUNS[@]}" | jq -s --argjson round "$round" '
        (map(select(.client == "wrk"))[0].us_per_request) as $wrk
        | {round: $round, runs: map(if .client == "wrk" then . else
            . + {ratio_to_wrk: ((.us_per_request / $wrk) * 1000 | round / 1000)} end)}')")
done

CPU_MODEL=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p')
printf '%s\n' "${ROWS[@]}" | jq -s \
    --arg date "$(date -u +%FT%TZ)" --arg cpu "$CPU_MODEL" --arg kernel "$(uname -r)" \
    --arg pin "$PIN" --arg loadgen "$LOADGEN" --arg before "$LOADGEN_BEFORE" \
    --argjson connections "$CONNECTIONS" --argjson duration_s "$DURATION_S" \
    --arg rate "${RATE:-}" --arg factors "$RATE_FACTORS" '
    def median: sort | if length == 0 then null elif length % 2 == 1 then .[length / 2 | floor]
        else (.[length / 2 - 1] + .[length / 2]) / 2 end;
    (map(.runs[]) ) as $all
    | {date: $date, machine: {cpu: $cpu, kernel: $kernel},
       setup: {server: "flashsale-bare --shards 1", pinned: ($pin == "1"),
               connections: $connections, duration_s: $duration_s, pipeline: 1,
               loadgen_rate: (if $rate == "" then "\($factors) x the wrk rate" else $rate end),
               loadgen: $loadgen, loadgen_before: (if $before == "" then null else $before end),
               wrk: "wrk -t1 (static Lua request)"},
       medians: {wrk: {us_per_request: ($all | map(select(.client == "wrk") | .us_per_request) | median),
                       rps: ($all | map(select(.client == "wrk") | .rps) | median)},
                 generators: ($all | map(select(.client != "wrk")) | group_by([.client, .rate_factor])
                   | map({client: .[0].client, rate_factor: .[0].rate_factor,
                          us_per_request: (map(.us_per_request) | median),
                          ratio_to_wrk: (map(.ratio_to_wrk) | median),
                          rps: (map(.rps) | median), p99_ms: (map(.p99_ms) | median)}))},
       rounds: .}' >"$OUT"
jq -r '"medians of \(.rounds | length) rounds: wrk \(.medians.wrk.us_per_request) us/request at \(.medians.wrk.rps) req/s",
       (.medians.generators[] | "  \(.client) at \(.rate_factor) x wrk rate: \(.us_per_request) us/request (median ratio to wrk \(.ratio_to_wrk)) at \(.rps) req/s, p99 \(.p99_ms) ms")' "$OUT"
echo "client-cost: written to $OUT" >&2
