#!/bin/bash
HERE="$(cd "$(dirname "$0")" && pwd)"
W="${WORK:-/tmp/flashsale-tune}"; mkdir -p "$W"; cd "$W" || exit 1
# Run as root inside a private network namespace so nothing else sees the sysctls:
#   unshare -n tuning/measure/burst.sh 128 2000 200; unshare -n tuning/measure/burst.sh 4096 2000 200
# Loopback up, somaxconn=$1, 3 bursts of $2 connections, stall $3 ms.
ip link set lo up
sysctl -qw net.core.somaxconn=$1
sysctl -qw net.ipv4.tcp_max_syn_backlog=4096
for i in 1 2 3; do
  nstat -n >/dev/null
  r=$(python3 "$HERE/burst.py" $2 $3)
  o=$(nstat -z TcpExtListenOverflows TcpExtListenDrops TcpExtTCPReqQFullDrop 2>/dev/null | awk 'NR>1{printf "%s=%s ",$1,$2}')
  echo "somaxconn=$1 n=$2 stall=$3ms run$i: $r $o"
done
