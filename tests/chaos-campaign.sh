#!/usr/bin/env bash
# The chaos campaign (issue 27 item 5, README "Several faults at once"): `flashsale chaos` for
# every seed of FIRST..LAST, one after another (each starts its own `ha` stack from empty: two
# at once would not fit the 2-core box), then one summary over every verdict — breaches, the
# faults injected per kind, rounds with two faults, rounds skipped, nemesis actions that
# failed, and per fault kind the longest stretch without a QUEUED answer that overlaps a round
# (max and median; a round's two faults share it). Exit 1 if any seed breached or gave no
# verdict. Each seed's output, verdict and record of answers stay in OUT, and the stack of a
# seed that failed (engine and server logs, data) as OUT/stack-N; a seed is replayed alone
# with `flashsale chaos --seed N --duration-s DURATION_S`.
#
#   tests/chaos-campaign.sh [FIRST] [LAST]     # defaults 1 and 20; needs jq
#   DURATION_S (180)  OUT (var/chaos-campaign)
#   RESUME=1   seeds with a verdict in OUT already are not run again (an interrupted campaign)
set -uo pipefail
cd "$(dirname "$0")/.."
command -v jq >/dev/null || { echo "chaos-campaign.sh: needs jq (apt-get install -y jq)" >&2; exit 1; }
FIRST=${1:-1}
LAST=${2:-20}
DURATION_S=${DURATION_S:-180}
OUT=${OUT:-var/chaos-campaign}
mkdir -p "$OUT"
cargo build --release --locked -p flashsale-engine --bin flashsale || exit 1
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

status=0
for seed in $(seq "$FIRST" "$LAST"); do
    if [ "${RESUME:-0}" = 1 ] && [ -s "$OUT/verdict-$seed.json" ]; then
        echo "seed $seed: verdict kept from an earlier run"
        [ "$(jq '.breaches | length' "$OUT/verdict-$seed.json")" = 0 ] || status=1
        continue
    fi
    started=$(date +%s)
    target/release/flashsale chaos --seed "$seed" --duration-s "$DURATION_S" \
        --dir "$OUT/stack" --json "$OUT/verdict-$seed.json" >"$OUT/seed-$seed.out" 2>&1
    code=$?
    line=$(grep -E "^chaos seed $seed: " "$OUT/seed-$seed.out" || echo "chaos seed $seed: no verdict (exit $code)")
    echo "$line in $(( $(date +%s) - started )) s"
    if [ "$code" != 0 ]; then
        status=1
        rm -rf "$OUT/stack-$seed"
        mv "$OUT/stack" "$OUT/stack-$seed"
    fi
done

# Every verdict of this campaign, one summary.
verdicts=()
for seed in $(seq "$FIRST" "$LAST"); do
    [ -s "$OUT/verdict-$seed.json" ] && verdicts+=("$OUT/verdict-$seed.json")
done
[ "${#verdicts[@]}" -gt 0 ] || { echo "no verdict at all" >&2; exit 1; }
jq -rs --arg commit "$commit" --argjson seeds "$(( LAST - FIRST + 1 ))" '
  def median: sort | if length == 0 then 0 else .[(length - 1) / 2 | floor] end;
  def kind: sub(" \\(took.*$"; "") | sub("-[0-9]+$"; "");
  [.[].rounds[]] as $rounds
  | [$rounds[] | . as $r | ($r.faults | split(" + ")[] | select(. != "") | kind)
      as $k | {kind: $k, ms: $r.longest_without_queued_ms}] as $faults
  | [.[].events[] | select(.what | startswith("round skipped"))] as $skipped
  | [.[].events[] | select(.error != null)] as $failed
  | "campaign on \($commit): \(length) verdicts of \($seeds) seeds × \(.[0].duration_s) s",
    "breaches: \([.[].breaches | length] | add)\([.[] | select(.breaches | length > 0) | " (seed \(.seed))"] | join(""))",
    "rounds: \($rounds | length), \([$rounds[] | select(.faults | contains(" + "))] | length) with two faults at once, \($skipped | length) skipped (late after a slow heal)",
    "nemesis actions that failed: \($failed | length)\([$failed[] | "\n  \(.what): \(.error)"] | join(""))",
    "nats-server stream-state resets: \([.[].log_repairs.stream_resets // 0] | add), order-writer recreations by the strand watch: \([.[].log_repairs.consumer_recreations // 0] | add)",
    "answers: \([.[].answers | to_entries[]] | group_by(.key) | map({(.[0].key): (map(.value) | add)}) | add)",
    "longest stretch without QUEUED per fault kind (max / median, rounds):",
    ($faults | group_by(.kind) | sort_by(-(map(.ms) | max))[]
      | "  \(.[0].kind): \((map(.ms) | max) / 1000) / \((map(.ms) | median) / 1000) s (\(length))")
' "${verdicts[@]}" | tee "$OUT/summary.txt"
[ "${#verdicts[@]}" -eq "$(( LAST - FIRST + 1 ))" ] || status=1
exit $status
