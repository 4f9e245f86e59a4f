#!/usr/bin/env bash
# benches/baseline.sh — issue 5's baseline, P99 and memory measurements in one command.
#
#   cargo build --release -p flashsale-engine -p flashsale-benches
#   benches/baseline.sh                       # writes benches/results/baseline-DATE.json
#
# What it does (every process on this machine; the stack is private, under $DIR):
#  1. `flashsale stack up` (from empty stores), then the bare server (`flashsale-bare`, the
#     engine's parser and response writer answering a fixed SOLD_OUT body) and `flashsale
#     serve` (release, --insecure-dev-auth), both with $SHARDS executors, floating with the
#     generator's $LOADGEN_THREADS threads over every core (PIN=unpinned, the default), or
#     pinned from core 0 with the generator held to $LOADGEN_CPUS by taskset (PIN=pinned).
#  2. Sells the engine's SKU out honestly: an activity with stock 1, bought by the first of
#     1,000 requests (the other 999 answer SOLD_OUT).
#  3. $ROUNDS rounds, alternating: `flashsale-loadgen --max-rate-search` against the bare
#     server, then against the engine, same settings; each engine search ends with one run
#     at half its maximum. Sustained = see benches/src/loadgen/search.rs (every request answered, no
#     errors, achieved >= 98% of offered, p99 <= 50 ms, every answer SOLD_OUT).
#  4. Memory (RSS=1): a fresh engine; VmHWM after 100,000 and after 1,000,000 sold-out
#     requests; then another fresh engine and a mixed run (a new activity with $MIXED_STOCK
#     units: reservations, duplicates, retries, then sold out), same two readings.
#  5. Prints the summary and writes everything to $OUT (the raw reports stay in $LOGS).
#
# Knobs (environment): ROUNDS SHARDS PIN LOADGEN_THREADS LOADGEN_CPUS CONNECTIONS PIPELINE
# USERS STEP_S START_RATE HALF_S RSS MEM_RATE MIXED_STOCK MIXED_RATE DIR LOGS OUT.
#
# On 2 shared cores the generator costs more CPU per request than either server (see each
# step's `generator_us_per_answer` beside `server_us_per_answer`), so the highest sustained
# rate is where generator + server fill the machine; the per-request server CPU cost is in
# the JSON too, for the comparison of the servers alone.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
SHARDS=${SHARDS:-2}
PIN=${PIN:-unpinned}
LOADGEN_THREADS=${LOADGEN_THREADS:-2}
LOADGEN_CPUS=${LOADGEN_CPUS:-1}
CONNECTIONS=${CONNECTIONS:-64}
PIPELINE=${PIPELINE:-8}
USERS=${USERS:-200000}
STEP_S=${STEP_S:-5}
START_RATE=${START_RATE:-40000}
HALF_S=${HALF_S:-10}
RSS=${RSS:-1}
MEM_RATE=${MEM_RATE:-50000}
MIXED_STOCK=${MIXED_STOCK:-10000}
MIXED_RATE=${MIXED_RATE:-10000}
DIR=${DIR:-/var/tmp/flashsale-baseline}
LOGS=${LOGS:-var/baseline}
OUT=${OUT:-benches/results/baseline-$(date -u +%F).json}
BIN=target/release

for b in flashsale flashsale-bare flashsale-loadgen; do
    [ -x "$BIN/$b" ] || { echo "baseline: $BIN/$b missing: cargo build --release -p flashsale-engine -p flashsale-benches" >&2; exit 1; }
done
mkdir -p "$LOGS" "$(dirname "$OUT")"

NO_PIN=()
TASKSET=()
if [ "$PIN" = unpinned ]; then
    NO_PIN=(--no-pin)
elif [ -n "$LOADGEN_CPUS" ]; then
    TASKSET=(taskset -c "$LOADGEN_CPUS")
fi

BARE_PID=""
ENGINE_PID=""
cleanup() {
    if [ -n "$BARE_PID" ]; then
        kill "$BARE_PID" 2>/dev/null || true
        wait "$BARE_PID" 2>/dev/null || true
    fi
    stop_engine
    "$BIN/flashsale" stack down --dir "$DIR" >/dev/null 2>&1 || true
}
stop_engine() {
    if [ -n "$ENGINE_PID" ]; then
        kill "$ENGINE_PID" 2>/dev/null || true
        wait "$ENGINE_PID" 2>/dev/null || true
        ENGINE_PID=""
    fi
}
trap cleanup EXIT

# Waits for a pattern in a log file (at most 60 s) and prints the first match.
wait_for() {
    local file=$1 pattern=$2
    for _ in $(seq 600); do
        if grep -qE "$pattern" "$file" 2>/dev/null; then
            grep -oE "$pattern" "$file" | head -1
            return 0
        fi
        sleep 0.1
    done
    echo "baseline: timed out waiting for /$pattern/ in $file" >&2
    cat "$file" >&2
    return 1
}

loadgen() {
    "${TASKSET[@]}" "$BIN/flashsale-loadgen" --threads "$LOADGEN_THREADS" "$@"
}

# Starts `flashsale serve` on free ports; sets ENGINE_PID, ENGINE_URL, ADMIN_URL.
start_engine() {
    local log=$1
    "$BIN/flashsale" serve --stack-dir "$DIR" --shards "$SHARDS" "${NO_PIN[@]}" \
        --http-addr 127.0.0.1:0 --admin-addr 127.0.0.1:0 --insecure-dev-auth --grace-s 0 \
        >"$log" 2>&1 &
    ENGINE_PID=$!
    local line
    line=$(wait_for "$log" 'public http://[0-9.:]+, admin http://[0-9.:]+')
    ENGINE_URL=$(echo "$line" | sed -E 's/.*public (http:[^,]+),.*/\1/')
    ADMIN_URL=$(echo "$line" | sed -E 's/.*admin (http:.*)/\1/')
}

fast_path_total() {
    curl -s "$ADMIN_URL/metrics" | awk '/^flashsale_sold_out_fast_path_total/ { s += $NF } END { print s + 0 }'
}

hwm_kb() { awk '/^VmHWM/ { print $2 }' "/proc/$1/status"; }
rss_kb() { awk '/^VmRSS/ { print $2 }' "/proc/$1/status"; }

# The common load settings of every search (the bare server and the engine alike).
SEARCH_ARGS=(--max-rate-search --rate "$START_RATE" --duration-s "$STEP_S"
    --connections "$CONNECTIONS" --pipeline "$PIPELINE" --users "$USERS"
    --duplicate-ratio 0 --retry off --expect-state SOLD_OUT)

echo "baseline: stack under $DIR (from empty stores)" >&2
"$BIN/flashsale" stack down --dir "$DIR" --purge >/dev/null 2>&1 || true
"$BIN/flashsale" stack up --dir "$DIR" >"$LOGS/stack.env"

"$BIN/flashsale-bare" --shards "$SHARDS" "${NO_PIN[@]}" --request-id-bytes 12 \
    >"$LOGS/bare.log" 2>&1 &
BARE_PID=$!
BARE_URL=$(wait_for "$LOGS/bare.log" 'http://[0-9.:]+')
start_engine "$LOGS/engine.log"
echo "baseline: bare server $BARE_URL (pid $BARE_PID), engine $ENGINE_URL (pid $ENGINE_PID)" >&2

# Sell the engine's SKU out: stock 1, bought by the first request.
loadgen --target "$ENGINE_URL" --admin "$ADMIN_URL" --create-activity --stock 1 \
    --activity-id 10001 --sku-id 20001 --rate 1000 --duration-s 1 --users 1000 \
    --connections 8 --duplicate-ratio 0 --retry off --quiet --run-id sellout \
    --json "$LOGS/sellout.json" >"$LOGS/sellout.txt"
SOLD=$(jq -r '"\(.counts.QUEUED // 0) QUEUED, \(.counts.SOLD_OUT // 0) SOLD_OUT"' "$LOGS/sellout.json")
echo "baseline: sell-out run: $SOLD" >&2
FAST_BEFORE=$(fast_path_total)

for round in $(seq "$ROUNDS"); do
    echo "baseline: round $round/$ROUNDS: bare server" >&2
    loadgen --target "$BARE_URL" "${SEARCH_ARGS[@]}" --server-pid "$BARE_PID" \
        --run-id "b$round" --json "$LOGS/bare-$round.json" | tee "$LOGS/bare-$round.txt"
    echo "baseline: round $round/$ROUNDS: engine (sold-out path)" >&2
    loadgen --target "$ENGINE_URL" "${SEARCH_ARGS[@]}" --server-pid "$ENGINE_PID" \
        --half-rate-runs 1 --half-rate-duration-s "$HALF_S" \
        --run-id "e$round" --json "$LOGS/engine-$round.json" | tee "$LOGS/engine-$round.txt"
done
FAST_AFTER=$(fast_path_total)
ENGINE_ANSWERED=$(jq -s '[.[] | (.steps + (.half_rate.runs // []))[] | .answered] | add' \
    "$LOGS"/engine-[0-9]*.json)
SEARCH_HWM=$(hwm_kb "$ENGINE_PID")
BARE_HWM=$(hwm_kb "$BARE_PID")

mem_json='null'
if [ "$RSS" = 1 ]; then
    # Sold-out path on a fresh engine: readings after 100,000 and after 1,000,000 requests.
    stop_engine
    start_engine "$LOGS/engine-mem.log"
    sleep 1
    M0=$(hwm_kb "$ENGINE_PID")
    MEM_ARGS=(--target "$ENGINE_URL" --rate "$MEM_RATE" --connections "$CONNECTIONS"
        --pipeline "$PIPELINE" --users "$USERS" --duplicate-ratio 0 --retry off --quiet)
    loadgen "${MEM_ARGS[@]}" --duration-s "$(awk "BEGIN { print 100000 / $MEM_RATE }")" \
        --run-id m1 --json "$LOGS/mem-100k.json" >/dev/null
    M1=$(hwm_kb "$ENGINE_PID"); R1=$(rss_kb "$ENGINE_PID")
    loadgen "${MEM_ARGS[@]}" --duration-s "$(awk "BEGIN { print 900000 / $MEM_RATE }")" \
        --run-id m2 --json "$LOGS/mem-1m.json" >/dev/null
    M2=$(hwm_kb "$ENGINE_PID"); R2=$(rss_kb "$ENGINE_PID")
    echo "baseline: sold-out memory: start $M0 kB, VmHWM after 100k $M1 kB, after 1M $M2 kB" >&2

    # Mixed: a new activity with real stock (reservations, 10% duplicate clicks, same-id
    # retries) sold out within the first 100,000 requests, then 900,000 more with the same
    # run id and seed — the first 100,000 of them re-send the same request ids (replays of
    # the reservations) — on another fresh engine. The accepted map is bounded by the stock,
    # so after the first reading nothing should grow with the request count.
    stop_engine
    start_engine "$LOGS/engine-mixed.log"
    sleep 1
    X0=$(hwm_kb "$ENGINE_PID")
    MIXED_ARGS=(--target "$ENGINE_URL" --admin "$ADMIN_URL" --activity-id 10002 --sku-id 20002
        --connections "$CONNECTIONS" --users "$USERS" --run-id x --seed 7 --quiet)
    loadgen "${MIXED_ARGS[@]}" --create-activity --stock "$MIXED_STOCK" --rate "$MIXED_RATE" \
        --duration-s "$(awk "BEGIN { print 100000 / $MIXED_RATE }")" \
        --json "$LOGS/mixed-100k.json" >/dev/null
    X1=$(hwm_kb "$ENGINE_PID"); XR1=$(rss_kb "$ENGINE_PID")
    loadgen "${MIXED_ARGS[@]}" --rate "$MEM_RATE" --pipeline "$PIPELINE" \
        --duration-s "$(awk "BEGIN { print 900000 / $MEM_RATE }")" \
        --json "$LOGS/mixed-1m.json" >/dev/null
    X2=$(hwm_kb "$ENGINE_PID"); XR2=$(rss_kb "$ENGINE_PID")
    echo "baseline: mixed memory: start $X0 kB, VmHWM after 100k $X1 kB, after 1M $X2 kB" >&2
    mem_json=$(jq -n \
        --argjson m0 "$M0" --argjson m1 "$M1" --argjson m2 "$M2" --argjson r1 "$R1" --argjson r2 "$R2" \
        --argjson stock "$MIXED_STOCK" --argjson x0 "$X0" --argjson x1 "$X1" --argjson x2 "$X2" --argjson xr1 "$XR1" --argjson xr2 "$XR2" \
        --slurpfile a "$LOGS/mem-100k.json" --slurpfile b "$LOGS/mem-1m.json" \
        --slurpfile c "$LOGS/mixed-100k.json" --slurpfile d "$LOGS/mixed-1m.json" '{
          sold_out: {vm_hwm_kb_start: $m0, vm_hwm_kb_after_100k: $m1, vm_hwm_kb_after_1m: $m2,
                     vm_rss_kb_after_100k: $r1, vm_rss_kb_after_1m: $r2,
                     hwm_ratio_1m_over_100k: (($m2 / $m1) * 1000 | round / 1000),
                     answered: [$a[0].answered, $b[0].answered], counts: [$a[0].counts, $b[0].counts]},
          mixed: {vm_hwm_kb_start: $x0, vm_hwm_kb_after_100k: $x1, vm_hwm_kb_after_1m: $x2,
                  vm_rss_kb_after_100k: $xr1, vm_rss_kb_after_1m: $xr2,
                  hwm_ratio_1m_over_100k: (($x2 / $x1) * 1000 | round / 1000),
                  stock: $stock, reservations_new: [$c[0].reservations_new, $d[0].reservations_new],
                  answered: [$c[0].answered, $d[0].answered], counts: [$c[0].counts, $d[0].counts],
                  replayed: [$c[0].replayed, $d[0].replayed]}
        }')
fi

CPU_MODEL=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p')
jq -n \
    --arg date "$(date -u +%FT%TZ)" --arg cpu "$CPU_MODEL" --arg cpus "$(nproc)" \
    --arg kernel "$(uname -r)" --arg pin "$PIN" --arg loadgen_cpus "$LOADGEN_CPUS" \
    --argjson loadgen_threads "$LOADGEN_THREADS" \
    --argjson shards "$SHARDS" --argjson memory "$mem_json" \
    --argjson fast_before "$FAST_BEFORE" --argjson fast_after "$FAST_AFTER" \
    --argjson engine_answered "$ENGINE_ANSWERED" \
    --argjson search_hwm "$SEARCH_HWM" --argjson bare_hwm "$BARE_HWM" \
    --slurpfile bare <(jq -s . "$LOGS"/bare-[0-9]*.json) \
    --slurpfile engine <(jq -s . "$LOGS"/engine-[0-9]*.json) \
    --slurpfile sellout "$LOGS/sellout.json" '
    def median: sort | if length == 0 then null elif length % 2 == 1 then .[length / 2 | floor]
        else (.[length / 2 - 1] + .[length / 2]) / 2 end;
    ($bare[0] | map(.max_sustained_rps)) as $b
    | ($engine[0] | map(.max_sustained_rps)) as $e
    | ([range(0; $b | length)] | map(if $b[.] and $e[.] then (($e[.] / $b[.]) * 1000 | round / 1000) else null end)) as $ratios
    | ($engine[0] | map(.half_rate | select(.) | .runs[0])) as $half
    | def costs: [.steps[] | select(.sustained and .server_us_per_answer != null)
                  | {rate, us: .server_us_per_answer}];
      [range(0; [($bare[0] | length), ($engine[0] | length)] | min) as $i
       | ($bare[0][$i] | costs)[] as $x | ($engine[0][$i] | costs)[] | select(.rate == $x.rate)
       | {round: ($i + 1), rate, bare_us: $x.us, engine_us: .us,
          engine_over_bare: ((.us / $x.us) * 1000 | round / 1000)}] as $pairs
    | {
        date: $date,
        machine: {cpu: $cpu, cpus: ($cpus | tonumber), kernel: $kernel},
        setup: {shards: $shards, pinning: $pin, loadgen_threads: $loadgen_threads,
                loadgen_cpus: (if $pin == "pinned" then $loadgen_cpus else "any" end),
                connections: $bare[0][0].connections, pipeline: $bare[0][0].pipeline,
                users: $bare[0][0].users, step_s: $bare[0][0].step_s,
                criterion: $bare[0][0].criterion},
        sold_out_setup: {activity_stock: 1, sellout_counts: $sellout[0].counts,
                         fast_path_answers: ($fast_after - $fast_before),
                         engine_answers_in_searches: $engine_answered},
        bare_max_rps: $b, engine_max_rps: $e, ratio_per_round: $ratios,
        bare_max_rps_median: ($b | median), engine_max_rps_median: ($e | median),
        ratio_of_medians: ((($e | median) / ($b | median)) * 1000 | round / 1000),
        ratio_median: ($ratios | map(select(.)) | median),
        server_cpu_per_request: {pairs_at_equal_offered_rate: $pairs,
            bare_us_median: ($pairs | map(.bare_us) | median | . * 100 | round / 100),
            engine_us_median: ($pairs | map(.engine_us) | median | . * 100 | round / 100),
            engine_over_bare_median: ($pairs | map(.engine_over_bare) | median)},
        half_rate: {rates: ($half | map(.rate)), p99_ms: ($half | map(.latency_ms.p99)),
                    p999_ms: ($half | map(.latency_ms.p999)),
                    p99_ms_median: ($half | map(.latency_ms.p99) | median),
                    achieved_rps: ($half | map(.achieved_rps))},
        vm_hwm_kb_after_searches: {engine: $search_hwm, bare: $bare_hwm},
        memory: $memory,
        searches: {bare: $bare[0], engine: $engine[0]}
      }' >"$OUT"

jq -r '
  "bare server max sustained (req/s): \(.bare_max_rps | map(tostring) | join(" / "))  median \(.bare_max_rps_median)",
  "engine sold-out max (req/s):       \(.engine_max_rps | map(tostring) | join(" / "))  median \(.engine_max_rps_median)",
  "ratio per round: \(.ratio_per_round | map(tostring) | join(" / "))  median \(.ratio_median); ratio of medians \(.ratio_of_medians)",
  "engine at half its max (\(.half_rate.rates | map(tostring) | join(" / ")) req/s): p99 \(.half_rate.p99_ms | map(tostring) | join(" / ")) ms, median \(.half_rate.p99_ms_median) ms",
  "server CPU per request at equal offered rates: bare \(.server_cpu_per_request.bare_us_median) us, engine \(.server_cpu_per_request.engine_us_median) us (engine/bare median x\(.server_cpu_per_request.engine_over_bare_median))",
  "fast-path answers \(.sold_out_setup.fast_path_answers) of \(.sold_out_setup.engine_answers_in_searches) engine answers",
  (if .memory then
    "memory, sold-out: VmHWM \(.memory.sold_out.vm_hwm_kb_after_100k) kB after 100k, \(.memory.sold_out.vm_hwm_kb_after_1m) kB after 1M (x\(.memory.sold_out.hwm_ratio_1m_over_100k))",
    "memory, mixed:    VmHWM \(.memory.mixed.vm_hwm_kb_after_100k) kB after 100k, \(.memory.mixed.vm_hwm_kb_after_1m) kB after 1M (x\(.memory.mixed.hwm_ratio_1m_over_100k))"
   else empty end)' "$OUT"
echo "baseline: written to $OUT (raw reports in $LOGS)" >&2
