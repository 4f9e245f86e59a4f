#!/bin/bash
W="${WORK:-/tmp/flashsale-tune}"; mkdir -p "$W"; cd "$W" || exit 1
# THP effect on a Redis BGSAVE under writes: fork time, copy-on-write bytes, write P99.
# Private Redis on 26402 with disable-thp no (Redis 7 otherwise opts itself out of THP).
P=26402
# $1: dense (200,000 pipelined overwrites during BGSAVE) or sparse (2,000 single overwrites).
case "${1:-dense}" in dense) LOAD="-t set -n 200000 -c 20 -P 16" ;; *) LOAD="-t set -n 2000 -c 1 -P 1" ;; esac
THP=/sys/kernel/mm/transparent_hugepage/enabled
orig=$(sed -E 's/.*\[(.*)\].*/\1/' $THP)
trap 'echo $orig > $THP' EXIT
for mode in madvise always madvise always madvise always; do
  echo $mode > $THP
  redis-server --port $P --bind 127.0.0.1 --save "" --appendonly no --disable-thp no --daemonize yes \
     --pidfile $W/t.pid --logfile $W/t.log --dir $W --dbfilename thp.rdb --rdb-key-save-delay 10
  sleep 0.5
  redis-benchmark -p $P -t set -n 1000000 -c 20 -P 64 -r 1000000 -d 200 -q >/dev/null; rss=$(redis-cli -p $P info memory | grep "^used_memory_rss:" | tr -d "\r")
  pid=$(cat $W/t.pid)
  huge=$(grep AnonHugePages /proc/$pid/smaps_rollup | awk '{print $2}')
  redis-cli -p $P bgsave >/dev/null
  sleep 0.2
  b=$(redis-benchmark -p $P $LOAD -r 1000000 -d 200 --csv | tail -1)
  while [ "$(redis-cli -p $P info persistence | grep rdb_bgsave_in_progress | tr -d '\r' | cut -d: -f2)" = 1 ]; do sleep 0.2; done
  fork=$(redis-cli -p $P info stats | grep latest_fork_usec | tr -d '\r')
  cow=$(redis-cli -p $P info persistence | grep rdb_last_cow_size | tr -d '\r')
  echo "$mode $rss anonhuge_kB=$huge $fork $cow bench=$b"
  redis-cli -p $P shutdown nosave >/dev/null 2>&1; sleep 0.5; rm -f $W/thp.rdb
done
