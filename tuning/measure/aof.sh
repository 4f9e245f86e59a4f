#!/bin/bash
W="${WORK:-/tmp/flashsale-tune}"; mkdir -p "$W"; cd "$W" || exit 1
# appendfsync policies on a private Redis (26403, AOF under $W/aof), SET rps, 3 runs each.
P=26403
for pol in everysec always; do for pipe in 1 16; do
  rm -rf $W/aof; mkdir -p $W/aof
  redis-server --port $P --bind 127.0.0.1 --save "" --appendonly yes --appendfsync $pol --dir $W/aof --daemonize yes --pidfile $W/a.pid --logfile $W/a.log
  sleep 0.5
  for _ in 1 2 3; do echo "$pol P$pipe $(redis-benchmark -p $P -t set -n 200000 -c 50 -P $pipe -r 100000 --csv | tail -1)"; done
  redis-cli -p $P shutdown nosave >/dev/null 2>&1; sleep 0.5
done; done
