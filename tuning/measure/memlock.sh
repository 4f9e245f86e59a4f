#!/bin/bash
W="${WORK:-/tmp/flashsale-tune}"; mkdir -p "$W"; cd "$W" || exit 1
# As root: uid $1 (any unused uid), memlock $2 bytes, shards $3, tag $4: start serve (no CAP_IPC_LOCK), report VmPin and glommio warnings, stop it.
uid=$1 lim=$2 shards=$3 tag=$4
source "${STACK_DIR:?set STACK_DIR to a `flashsale stack up --dir` directory}/env"
bin="${FLASHSALE_BIN:?set FLASHSALE_BIN to a flashsale binary readable by uid $1}"
prlimit --memlock=$lim:$lim setpriv --reuid $uid --regid $uid --clear-groups --inh-caps=-all \
  "$bin" serve --insecure-dev-auth --no-pin --shards $shards --http-addr 127.0.0.1:0 --admin-addr 127.0.0.1:0 --stack-dir /nonexistent --grace-s 0 > ml_$tag.log 2>&1 &
p=$!
sleep 5
echo "uid=$uid memlock=$lim shards=$shards $(grep -E 'VmPin' /proc/$p/status | tr -s '\t ' ' ') CapEff=$(grep CapEff /proc/$p/status | cut -f2) warnings=$(grep -c registering ml_$tag.log) $(grep -o 'registering buffers in the [a-z]* ring' ml_$tag.log | tr '\n' ';') $(grep -c 'flashsale serve:' ml_$tag.log)started"
kill $p; wait $p
