#!/bin/bash
W="${WORK:-/tmp/flashsale-tune}"; mkdir -p "$W"; cd "$W" || exit 1
# Pipelining and io-threads on a private Redis (port 26401), 3 runs each, SET rps.
P=26401
run() { # $1 = io-threads, rest = benchmark args
  local io=$1; shift
  redis-server --port $P --bind 127.0.0.1 --save "" --appendonly no --io-threads $io --io-threads-do-reads yes --daemonize yes --pidfile $W/r.pid --logfile $W/r.log --dir $W
  sleep 0.5
  for _ in 1 2 3; do
    redis-benchmark -p $P -t set -n 300000 -c 50 -r 100000 "$@" --csv | tail -1
  done
  redis-cli -p $P shutdown nosave >/dev/null 2>&1; sleep 0.5
}
echo "io1 P1"; run 1 -P 1
echo "io1 P16"; run 1 -P 16
echo "io2 P1"; run 2 -P 1 --threads 2
echo "io1 P1 t2"; run 1 -P 1 --threads 2
