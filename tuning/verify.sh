#!/usr/bin/env bash
# flashsale host tuning: print each knob's current value next to the recommended one.
# Runs unprivileged (reads /proc and /sys only). Exit 0 when every checked knob is as
# recommended, 1 when any is not ("WARN"); "info" lines are facts to read, not checks.
#
#   tuning/verify.sh [--pid PID] [--shards N]
#
# --pid: also check a running engine (default: the first process named `flashsale`): its
# limits and where its shard threads run. --shards: the shard count to size limits for
# (default: the engine's shard threads, else the CPUs this shell may use).
set -uo pipefail

pid=""
shards=""
while [ $# -gt 0 ]; do
    case "$1" in
        --pid) pid="$2"; shift ;;
        --shards) shards="$2"; shift ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) echo "verify.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

warns=0
row() { printf '%-5s %-40s %-28s %s\n' "$1" "$2" "$3" "$4"; }
# check NAME CURRENT RECOMMENDED-TEXT OK(0|1)
check() {
    if [ "$4" -eq 0 ]; then row ok "$1" "$2" "$3"; else row WARN "$1" "$2" "$3"; warns=$((warns + 1)); fi
}
info() { row info "$1" "$2" "$3"; }
read_or() { cat "$1" 2>/dev/null || echo "$2"; }
thp_mode() { sed -E 's/.*\[([^]]*)\].*/\1/' "$1" 2>/dev/null || echo unknown; }
# Number of CPUs in a kernel CPU list ("0-3,8" -> 5).
cpu_count() {
    local n=0 part a b
    IFS=',' read -ra parts <<< "$1"
    for part in "${parts[@]}"; do
        [ -n "$part" ] || continue
        a="${part%-*}"; b="${part#*-}"; n=$((n + b - a + 1))
    done
    echo "$n"
}
# A CPU list expanded to " 0 1 2 8 " (spaces around every member).
expand() {
    local out=" " part a b cpu
    IFS=',' read -ra parts <<< "$1"
    for part in "${parts[@]}"; do
        [ -n "$part" ] || continue
        a="${part%-*}"; b="${part#*-}"
        for ((cpu = a; cpu <= b; cpu++)); do out="$out$cpu "; done
    done
    echo "$out"
}
# Whether CPU lists $1 and $2 share a CPU.
overlaps() {
    local second cpu
    second="$(expand "$2")"
    for cpu in $(expand "$1"); do
        case "$second" in *" $cpu "*) return 0 ;; esac
    done
    return 1
}

if [ -z "$pid" ]; then pid="$(pgrep -x flashsale | head -1 || true)"; fi
if [ -z "$shards" ] && [ -n "$pid" ] && [ -d "/proc/$pid/task" ]; then
    # glommio names an executor's threads after it (`shard-0-1` and its helper): count names.
    shards="$(cat /proc/"$pid"/task/*/comm 2>/dev/null | grep '^shard-' | sort -u | wc -l)"
    [ "$shards" -gt 0 ] || shards=""
fi
allowed="$(awk '/^Cpus_allowed_list/ {print $2}' /proc/self/status)"
[ -n "$shards" ] || shards="$(cpu_count "$allowed")"

row "" "knob" "current" "recommended"

# ---- network ----
somaxconn="$(read_or /proc/sys/net/core/somaxconn 0)"
check net.core.somaxconn "$somaxconn" ">= 4096 (glommio backlog 1024)" $(( somaxconn >= 4096 ? 0 : 1 ))
syn="$(read_or /proc/sys/net/ipv4/tcp_max_syn_backlog 0)"
check net.ipv4.tcp_max_syn_backlog "$syn" ">= 8192" $(( syn >= 8192 ? 0 : 1 ))
read -r lo hi < /proc/sys/net/ipv4/ip_local_port_range
ports=$((hi - lo + 1))
check net.ipv4.ip_local_port_range "$lo-$hi ($ports ports)" "1024-65535 (~$((64512 / 60))/s per dest)" $(( ports >= 64000 ? 0 : 1 ))
reserved="$(read_or /proc/sys/net/ipv4/ip_local_reserved_ports '')"
check net.ipv4.ip_local_reserved_ports "${reserved:-none}" "the servers' ports" "$([ -n "$reserved" ] && echo 0 || echo 1)"
info net.ipv4.tcp_tw_reuse "$(read_or /proc/sys/net/ipv4/tcp_tw_reuse '?')" "2 (default; loopback only)"

# ---- memory ----
over="$(read_or /proc/sys/vm/overcommit_memory '?')"
check vm.overcommit_memory "$over" "1 (Redis fork)" "$([ "$over" = 1 ] && echo 0 || echo 1)"
swp="$(read_or /proc/sys/vm/swappiness 60)"
check vm.swappiness "$swp" "<= 10" $(( swp <= 10 ? 0 : 1 ))
thp="$(thp_mode /sys/kernel/mm/transparent_hugepage/enabled)"
check "THP enabled" "$thp" "madvise" "$([ "$thp" = madvise ] && echo 0 || echo 1)"
defrag="$(thp_mode /sys/kernel/mm/transparent_hugepage/defrag)"
check "THP defrag" "$defrag" "defer+madvise" "$([ "$defrag" = "defer+madvise" ] && echo 0 || echo 1)"

# ---- CPUs ----
online="$(read_or /sys/devices/system/cpu/online '?')"
isolated="$(read_or /sys/devices/system/cpu/isolated '')"
info "CPUs online" "$online" ""
check "isolated CPUs (isolcpus=)" "${isolated:-none}" "the shard CPUs" "$([ -n "$isolated" ] && echo 0 || echo 1)"
nohz="$(read_or /sys/devices/system/cpu/nohz_full '')"
info "nohz_full CPUs" "${nohz:-none}" "the shard CPUs"
if [ -n "$isolated" ]; then
    # IRQs whose effective CPU is an isolated (shard) CPU.
    bad=0
    for irq in /proc/irq/[0-9]*; do
        eff="$(cat "$irq/effective_affinity_list" 2>/dev/null || true)"
        [ -n "$eff" ] && overlaps "$eff" "$isolated" && bad=$((bad + 1))
    done
    check "IRQs on isolated CPUs" "$bad" "0 (apply.sh --housekeeping-cpus)" $(( bad == 0 ? 0 : 1 ))
else
    info "IRQ affinity" "not checked" "needs isolated CPUs first"
fi
if pgrep -x irqbalance >/dev/null 2>&1; then
    info irqbalance "running" "ban the shard CPUs or stop it"
fi

# ---- limits (this shell, or the running engine) ----
if [ -n "$pid" ] && [ -r "/proc/$pid/limits" ]; then
    who="pid $pid"
    memlock="$(awk '/^Max locked memory/ {print $4}' /proc/"$pid"/limits)"
    nofile="$(awk '/^Max open files/ {print $4}' /proc/"$pid"/limits)"
else
    who="this shell"
    memlock="$(ulimit -l)"; [ "$memlock" = unlimited ] || memlock=$((memlock * 1024))
    nofile="$(ulimit -n)"
fi
# 3 io_uring registrations of 1 MiB per shard, each up to 4 MiB when huge pages back it.
need_memlock=$((shards * 12 * 1024 * 1024))
need_nofile=$((shards * 16384 + 256))
if [ "$memlock" = unlimited ]; then ok=0; else ok=$(( memlock >= need_memlock ? 0 : 1 )); fi
check "memlock ($who)" "$memlock B" ">= $need_memlock B ($shards shards)" "$ok"
if [ "$nofile" = unlimited ]; then ok=0; else ok=$(( nofile >= need_nofile ? 0 : 1 )); fi
check "nofile ($who)" "$nofile" ">= $need_nofile ($shards shards)" "$ok"

# ---- the running engine's shard threads ----
if [ -n "$pid" ] && [ -d "/proc/$pid/task" ]; then
    seen=" "
    for task in /proc/"$pid"/task/*; do
        name="$(cat "$task/comm" 2>/dev/null || true)"
        case "$name" in shard-*) ;; *) continue ;; esac
        case "$seen" in *" $name "*) continue ;; esac
        seen="$seen$name "
        cpus="$(awk '/^Cpus_allowed_list/ {print $2}' "$task/status")"
        if [ -n "$isolated" ]; then
            overlaps "$cpus" "$isolated"; ok=$?
            check "thread $name CPUs" "$cpus" "isolated ($isolated)" "$ok"
        else
            info "thread $name CPUs" "$cpus" "one CPU each when pinned"
        fi
    done
fi

echo
if [ "$warns" -eq 0 ]; then
    echo "verify.sh: every checked knob is as recommended"
    exit 0
fi
echo "verify.sh: $warns knob(s) differ from tuning/README.md's recommendation"
exit 1
