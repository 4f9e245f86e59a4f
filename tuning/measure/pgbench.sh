#!/bin/bash
W="${WORK:-/tmp/flashsale-tune}"; mkdir -p "$W"; cd "$W" || exit 1
# Needs a private PostgreSQL on 127.0.0.1:55432 initialised with `pgbench -i -s 20`, e.g.:
#   su postgres -c "initdb -D $W/pg -A trust -U postgres"
#   su postgres -c "pg_ctl -D $W/pg -o '-p 55432 -c listen_addresses=127.0.0.1 -k $W' start"
# pgbench simple-update (-N: no hot branch/teller rows), 8 clients, 10 s, 3 runs per setting.
run() { local label=$1 opts=$2 c=$3
  for i in 1 2 3; do
    t=$(PGOPTIONS="$opts" pgbench -h 127.0.0.1 -p 55432 -U postgres -N -M prepared -c $c -j 2 -T 10 postgres 2>/dev/null | grep -E "^tps|latency average" | tr '\n' ' ')
    echo "$label c=$c run$i: $t"
  done
}
run sync_on       "-c synchronous_commit=on"  8
run sync_off      "-c synchronous_commit=off" 8
run delay100      "-c synchronous_commit=on -c commit_delay=100 -c commit_siblings=5" 8
run sync_on       "-c synchronous_commit=on"  32
run delay100      "-c synchronous_commit=on -c commit_delay=100 -c commit_siblings=5" 32
