#!/usr/bin/env bash
# flashsale host tuning: apply (saving the previous values first) or revert.
#
#   sudo tuning/apply.sh [--housekeeping-cpus LIST] [--state DIR] [--dry-run]
#   sudo tuning/apply.sh --revert [--state DIR] [--dry-run]
#
# Applies tuning/sysctl.conf, transparent huge pages = madvise (defrag defer+madvise), and with
# --housekeeping-cpus (e.g. 0 or 0,8) steers every movable IRQ to those CPUs so the shards'
# cores only run shards. The first apply records the previous values under DIR (default
# /var/lib/flashsale-tuning); later applies keep that record, so --revert always returns to the
# state before flashsale's tuning. Kernel command-line isolation (isolcpus=, nohz_full=) and
# the service's limits (LimitMEMLOCK=, LimitNOFILE=, CPUAffinity=) are not set here: see
# tuning/README.md and tuning/flashsale.service. Check the result with tuning/verify.sh.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
state="/var/lib/flashsale-tuning"
housekeeping=""
mode="apply"
dry=0
while [ $# -gt 0 ]; do
    case "$1" in
        --revert) mode="revert" ;;
        --dry-run) dry=1 ;;
        --state) state="$2"; shift ;;
        --housekeeping-cpus) housekeeping="$2"; shift ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "apply.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

if [ "$dry" -eq 0 ] && [ "$(id -u)" -ne 0 ]; then
    echo "apply.sh: needs root (or --dry-run)" >&2
    exit 1
fi

thp_dir=/sys/kernel/mm/transparent_hugepage

# Writes VALUE to FILE (or prints it with --dry-run); a refused write is reported, not fatal.
put() {
    local file="$1" value="$2"
    if [ "$dry" -eq 1 ]; then
        echo "would write '$value' > $file"
    elif ! ( echo "$value" > "$file" ) 2>/dev/null; then
        echo "apply.sh: cannot write $file (read-only in a container? managed IRQ?)" >&2
        return 1
    fi
}

# The bracketed choice of a THP file ("always [madvise] never" -> madvise).
thp_current() { sed -E 's/.*\[([^]]*)\].*/\1/' "$1"; }

# sysctl keys of tuning/sysctl.conf, one per line.
sysctl_keys() { sed -nE 's/^[[:space:]]*([a-z0-9_.]+)[[:space:]]*=.*/\1/p' "$here/sysctl.conf"; }

# A CPU list ("0-2,8") as the hex mask /proc/irq/default_smp_affinity takes (up to 64 CPUs).
cpu_mask() {
    local mask=0 part a b cpu
    IFS=',' read -ra parts <<< "$1"
    for part in "${parts[@]}"; do
        a="${part%-*}"; b="${part#*-}"
        for ((cpu = a; cpu <= b; cpu++)); do mask=$((mask | (1 << cpu))); done
    done
    printf '%x\n' "$mask"
}

save_state() {
    if [ -e "$state/saved" ]; then
        echo "apply.sh: keeping the values saved at $(cat "$state/saved") in $state"
        return
    fi
    if [ "$dry" -eq 1 ]; then
        echo "would save current values under $state"
        return
    fi
    mkdir -p "$state/irq"
    local key
    for key in $(sysctl_keys); do
        printf '%s = %s\n' "$key" "$(sysctl -n "$key" | tr '\t' ' ')"
    done > "$state/sysctl.conf"
    thp_current "$thp_dir/enabled" > "$state/thp_enabled"
    thp_current "$thp_dir/defrag" > "$state/thp_defrag"
    cat /proc/irq/default_smp_affinity > "$state/irq/default_smp_affinity"
    local irq
    for irq in /proc/irq/[0-9]*; do
        cat "$irq/smp_affinity_list" > "$state/irq/$(basename "$irq")" 2>/dev/null || true
    done
    date -u +%Y-%m-%dT%H:%M:%SZ > "$state/saved"
    echo "apply.sh: saved the current values in $state"
}

apply() {
    save_state
    if [ "$dry" -eq 1 ]; then
        echo "would run: sysctl -p $here/sysctl.conf"
    else
        sysctl -p "$here/sysctl.conf"
    fi
    put "$thp_dir/enabled" madvise || true
    put "$thp_dir/defrag" defer+madvise || true
    if [ -n "$housekeeping" ]; then
        put /proc/irq/default_smp_affinity "$(cpu_mask "$housekeeping")" || true
        local irq moved=0 refused=0
        for irq in /proc/irq/[0-9]*; do
            [ -e "$irq/smp_affinity_list" ] || continue
            if put "$irq/smp_affinity_list" "$housekeeping" 2>/dev/null; then
                moved=$((moved + 1))
            else
                refused=$((refused + 1))
            fi
        done
        echo "apply.sh: IRQs steered to CPUs $housekeeping: $moved; refused (per-CPU or managed): $refused"
        if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet irqbalance 2>/dev/null; then
            echo "apply.sh: irqbalance is running and will move IRQs back: stop it, or set" \
                "IRQBALANCE_BANNED_CPULIST to the shard CPUs in /etc/default/irqbalance" >&2
        fi
    fi
    echo "apply.sh: done; check with $here/verify.sh"
}

revert() {
    if [ ! -e "$state/saved" ]; then
        echo "apply.sh: nothing saved in $state: nothing to revert" >&2
        exit 1
    fi
    if [ "$dry" -eq 1 ]; then
        echo "would run: sysctl -p $state/sysctl.conf"
    else
        sysctl -p "$state/sysctl.conf"
    fi
    put "$thp_dir/enabled" "$(cat "$state/thp_enabled")" || true
    put "$thp_dir/defrag" "$(cat "$state/thp_defrag")" || true
    put /proc/irq/default_smp_affinity "$(cat "$state/irq/default_smp_affinity")" || true
    local saved irq
    for saved in "$state"/irq/[0-9]*; do
        [ -e "$saved" ] || continue
        irq="/proc/irq/$(basename "$saved")/smp_affinity_list"
        [ -e "$irq" ] && { put "$irq" "$(cat "$saved")" 2>/dev/null || true; }
    done
    if [ "$dry" -eq 0 ]; then
        rm -rf "$state"
    fi
    echo "apply.sh: reverted to the values saved before flashsale's tuning"
}

"$mode"
