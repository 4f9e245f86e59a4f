#!lua name=seckill
--
-- The `seckill` Redis Functions library: fast pre-reservation, request idempotency, the
-- one-per-user pre-check and the reservation records of one SKU (CONTRACT.md section 5,
-- DESIGN.md sections 4 and 6).
--
-- What it is not: the truth. PostgreSQL decides whether an order exists; everything written
-- here may be lost on failover and is repaired from PostgreSQL's outbox events. Rust binding
-- and reply parsing: io/src/redis/script/ (one file per function). Branch-by-branch tests:
-- tests/tests/lua_functions.rs.
--
-- Conventions shared by every function:
-- * All keys of one SKU share the prefix `seckill:{A:S}:` (A = activity id, S = sku id; the
--   braces are a literal Redis Cluster hash tag, so every key of a SKU lives in one slot).
--   Every function checks that each KEY is exactly the key its contract names, built from that
--   prefix: a binding bug fails with an error instead of writing a stranger's key.
-- * Time is an argument (`now_ms`, integer milliseconds). No function reads the clock, so each
--   is deterministic and replays identically on replicas and in tests.
-- * Numbers in ARGV are non-negative decimal integers of at most 15 digits (a Lua number holds
--   them exactly, and sums of two stay below 2^53). Numbers are written back with '%d' because
--   Lua's tostring ('%.14g') would turn 15-digit values into exponent notation. Every time and
--   duration the engine sends is inside that (io/src/bounds.rs: times up to year 9999 are 15
--   digits). Business ids (user ids) are NOT numbers here: they are the canonical decimal text
--   of 1..=9223372036854775807 (PostgreSQL bigint, io/src/bounds.rs ID_VALUE_MAX), checked as
--   text and only ever used as text, so a 19-digit (snowflake) id is as good as a small one.
-- * Bad input is rejected with `-ERR seckill: bad <arg>` BEFORE any write: Redis does not roll
--   back a function that fails half way, so validation always comes first.
-- * Ids (request, reservation, message, order) are 1..128 bytes.
-- * Replies are arrays of fixed shape per function so the binding parses one shape each.

local ID_LEN_MAX = 128
local CLAIM_BATCH_MAX = 512
-- Most units one buyer may take in one order (io/src/bounds.rs QUANTITY_MAX).
local QUANTITY_MAX = 100
-- Reservations one mark_sent call marks (io/src/redis/script/mark_sent.rs MARK_SENT_MAX).
local MARK_SENT_MAX = 256
-- Outcomes one apply_results call applies (io/src/redis/script/apply_result.rs APPLY_RESULTS_MAX).
local APPLY_RESULTS_MAX = 256
-- 2^52 * any positive base exceeds every representable backoff_max_ms (< 10^15), so capping the
-- exponent here only avoids computing infinities, it never changes a result.
local BACKOFF_EXPONENT_MAX = 52

local FINAL = { ORDER_CREATED = true, FAILED = true, COMPENSATED = true }
local CLAIMABLE = { PENDING_MESSAGE = true, MESSAGE_SENT = true }
local ACTIVITY_STATUS = { PENDING = true, ACTIVE = true, ENDED = true, TERMINATED = true }

local function bad(what)
  return redis.error_reply('ERR seckill: bad ' .. what)
end

-- A non-negative integer of 1..15 decimal digits, or nil.
local function uint(s)
  if type(s) ~= 'string' or #s == 0 or #s > 15 or not string.find(s, '^%d+$') then
    return nil
  end
  return tonumber(s)
end

-- The largest business id, as text (io/src/bounds.rs ID_VALUE_MAX; a test there checks the two
-- agree).
local ID_VALUE_MAX_TEXT = '9223372036854775807'

-- A business id in its one canonical spelling: decimal digits, no leading zero, 1..=i64::MAX.
-- Compared as text (same-length digit strings order like their values), never converted.
local function id_num(s)
  if type(s) ~= 'string' or #s == 0 or #s > #ID_VALUE_MAX_TEXT
      or not string.find(s, '^[1-9]%d*$') then
    return false
  end
  return #s < #ID_VALUE_MAX_TEXT or s <= ID_VALUE_MAX_TEXT
end

local function flag(s)
  if s == '0' then return false end
  if s == '1' then return true end
  return nil
end

local function id_ok(s)
  return type(s) == 'string' and #s > 0 and #s <= ID_LEN_MAX
end

local function fmt(n)
  return string.format('%d', n)
end

-- The `seckill:{A:S}:` prefix of `key` when `key` is that prefix followed by `suffix`, else nil.
local function prefix_of(key, suffix)
  if #key <= #suffix or string.sub(key, -#suffix) ~= suffix then return nil end
  local prefix = string.sub(key, 1, #key - #suffix)
  if not string.find(prefix, '^seckill:{[^{}]+}:$') then return nil end
  return prefix
end

local function starts_with(s, head)
  return string.sub(s, 1, #head) == head
end

-- ---------------------------------------------------------------------------------------------
-- reserve: one atomic pre-reservation attempt (DESIGN.md section 4).
--
-- KEYS: 1 meta, 2 stock, 3 user:<user_id>, 4 req:<user_id>:<request_id>,
--       5 resv:<reservation_id>,
--       6 resv:pending, 7 soldout                      (all `seckill:{A:S}:`-prefixed)
-- ARGV: 1 request_id, 2 user_id, 3 payload_hash, 4 reservation_id, 5 message_id, 6 now_ms,
--       7 pending_grace_ms, 8 quantity (1..QUANTITY_MAX: the units asked, all or none)
-- Reply: always the flat array
--   [code, reservation_id, message_id, state, order_id, reason_code, stock_after, expires_at]
--   with "" for absent strings; stock_after is an integer: stock left after this call for
--   CREATED, 0 for SOLD_OUT, -1 when stock was not read; expires_at is the integer
--   resv.expires_at (now_ms + meta.reservation_ttl_ms) for CREATED, -1 otherwise (so the
--   caller never reads the TTL itself). code is one of
--     CREATED              ids of the new reservation, state QUEUED_PENDING
--     IDEMPOTENT           same request_id and payload_hash seen before: its stored ids, state,
--                          order_id and reason_code (nothing written)
--     IDEMPOTENCY_CONFLICT same request_id, different payload_hash (nothing written)
--     ACTIVITY_INVALID     reason_code = UNKNOWN (no meta) | NOT_STARTED | ENDED | <meta.status>
--     OVER_LIMIT           quantity > meta.max_per_buyer (1 when absent); reason_code = the
--                          limit (nothing written)
--     DUPLICATE_USER       reservation_id = the reservation this user already holds
--     SOLD_OUT             stock missing or <= 0 (sets soldout)
--     FEWER_LEFT           0 < stock < quantity: stock_after = the units left; nothing written
--                          (soldout not set: a smaller quantity can still be reserved)
-- Order of checks is the contract: idempotency first (a replay is answered even after the
-- activity ended or sold out), then activity, limit, user, stock.
-- Invariants: stock never goes below 0 (DECRBY quantity only after reading stock >= quantity,
-- atomically); a reservation takes all its units or none; one user key per user per SKU; only
-- creating requests are recorded, so the number of req/resv records is bounded by the initial
-- stock; every CREATED reservation is in resv:pending, its `quantity` in its resv hash.
-- Complexity: O(1).
-- ---------------------------------------------------------------------------------------------
local function reserve(keys, args)
  if #keys ~= 7 or #args ~= 8 then return bad('arity') end
  local request_id, user_id, payload_hash = args[1], args[2], args[3]
  local reservation_id, message_id = args[4], args[5]
  local now_ms, grace_ms, quantity = uint(args[6]), uint(args[7]), uint(args[8])
  if not id_ok(request_id) then return bad('request_id') end
  if not id_num(user_id) then return bad('user_id') end
  if not id_ok(payload_hash) then return bad('payload_hash') end
  if not id_ok(reservation_id) then return bad('reservation_id') end
  if not id_ok(message_id) then return bad('message_id') end
  if not now_ms then return bad('now_ms') end
  if not grace_ms then return bad('pending_grace_ms') end
  if not quantity or quantity < 1 or quantity > QUANTITY_MAX then return bad('quantity') end
  local p = prefix_of(keys[1], 'meta')
  if not p or keys[2] ~= p .. 'stock' or keys[3] ~= p .. 'user:' .. user_id
      or keys[4] ~= p .. 'req:' .. user_id .. ':' .. request_id
      or keys[5] ~= p .. 'resv:' .. reservation_id
      or keys[6] ~= p .. 'resv:pending' or keys[7] ~= p .. 'soldout' then
    return bad('keys')
  end

  -- 1. Idempotency.
  local req = redis.call('HMGET', keys[4], 'payload_hash', 'reservation_id', 'message_id',
    'state', 'order_id', 'reason_code')
  if req[1] then
    if req[1] == payload_hash then
      return { 'IDEMPOTENT', req[2] or '', req[3] or '', req[4] or '', req[5] or '',
        req[6] or '', -1, -1 }
    end
    return { 'IDEMPOTENCY_CONFLICT', '', '', '', '', '', -1, -1 }
  end

  -- 2. Activity status and window. Read on every call, never from a copy the caller holds:
  -- an operator's end or terminate stops new reservations at once, on every instance.
  local meta = redis.call('HMGET', keys[1], 'status', 'start_ms', 'end_ms', 'reservation_ttl_ms',
    'max_per_buyer')
  if not meta[1] then return { 'ACTIVITY_INVALID', '', '', '', '', 'UNKNOWN', -1, -1 } end
  if meta[1] ~= 'ACTIVE' then return { 'ACTIVITY_INVALID', '', '', '', '', meta[1], -1, -1 } end
  local start_ms, end_ms, ttl_ms = uint(meta[2]), uint(meta[3]), uint(meta[4])
  -- Corrupt meta is a preheat bug, not a buyer's problem: refuse loudly, write nothing.
  if not (start_ms and end_ms and ttl_ms) then return bad('meta') end
  if now_ms < start_ms then
    return { 'ACTIVITY_INVALID', '', '', '', '', 'NOT_STARTED', -1, -1 }
  end
  if now_ms >= end_ms then return { 'ACTIVITY_INVALID', '', '', '', '', 'ENDED', -1, -1 } end
  local limit = uint(meta[5]) or 1
  if quantity > limit then return { 'OVER_LIMIT', '', '', '', '', fmt(limit), -1, -1 } end

  -- 3. One reservation per user, and 4. stock. Stock is read first so that a unit left costs
  -- one command for both checks: the user marker is claimed with `SET NX GET`, which answers
  -- the marker held (and writes nothing) or claims it. Sold out, the marker is only read, so
  -- the sold-out path (the common one once sold out) writes nothing to replicate or append.
  -- Either way a buyer who holds a reservation is told DUPLICATE_USER before SOLD_OUT.
  local stock = tonumber(redis.call('GET', keys[2]))
  if not stock or stock < quantity then
    local held = redis.call('GET', keys[3])
    if held then return { 'DUPLICATE_USER', held, '', '', '', '', -1, -1 } end
    if stock and stock > 0 then return { 'FEWER_LEFT', '', '', '', '', '', stock, -1 } end
    if redis.call('EXISTS', keys[7]) == 0 then redis.call('SET', keys[7], '1') end
    return { 'SOLD_OUT', '', '', '', '', '', 0, -1 }
  end
  local held = redis.call('SET', keys[3], reservation_id, 'NX', 'GET')
  if held then return { 'DUPLICATE_USER', held, '', '', '', '', -1, -1 } end

  -- 5. Create (the user marker is written above).
  local stock_after = redis.call('DECRBY', keys[2], quantity)
  local next_retry_at = fmt(now_ms + grace_ms)
  local expires_at = now_ms + ttl_ms
  redis.call('HSET', keys[4], 'payload_hash', payload_hash, 'reservation_id', reservation_id,
    'message_id', message_id, 'state', 'QUEUED_PENDING', 'order_id', '', 'reason_code', '',
    'user_id', user_id)
  redis.call('HSET', keys[5], 'reservation_id', reservation_id, 'message_id', message_id,
    'request_id', request_id, 'user_id', user_id, 'status', 'PENDING_MESSAGE',
    'payload_hash', payload_hash, 'reserved_at', args[6], 'expires_at', fmt(expires_at),
    'send_attempts', '0', 'next_retry_at', next_retry_at, 'last_error_code', '',
    'quantity', args[8])
  redis.call('ZADD', keys[6], next_retry_at, reservation_id)
  if stock_after <= 0 then redis.call('SET', keys[7], '1') end
  return { 'CREATED', reservation_id, message_id, 'QUEUED_PENDING', '', '', stock_after,
    expires_at }
end

-- ---------------------------------------------------------------------------------------------
-- mark_sent: the order-create messages of reservations of one SKU were acknowledged by the
-- log (a batch: the shard collects the acks that arrive together and marks them in one call).
--
-- KEYS: 1 resv:pending, then per reservation i (1..n): resv:<reservation_id_i>,
--       req:<user_id_i>:<request_id_i>
-- ARGV: 1 now_ms, 2 order_deadline_ms, then per reservation i: reservation_id_i
-- n is 1..MARK_SENT_MAX; every key of the SKU of KEYS[1].
-- Reply: array of n bulk strings, one per reservation in order:
--   OK           status PENDING_MESSAGE -> MESSAGE_SENT; req.state QUEUED_PENDING -> QUEUED
--                (only if req belongs to this reservation);
--                the pending entry (if still a member) re-scored to now + order_deadline_ms,
--                and resv.next_retry_at set to the same value
--   NOT_FOUND    no such reservation (nothing changed)
--   NOT_PENDING  already MESSAGE_SENT or final (nothing changed)
-- Every argument is checked before anything is written: a bad batch changes nothing.
-- Invariants: the reservation stays in resv:pending (it leaves only when its final outcome
-- arrives, apply_result / compensate), so a message lost after the ack is still republished;
-- a final state is never overwritten; a pending entry removed meanwhile is not re-added.
-- Complexity: O(n) (O(n log m) in the ZSET).
-- ---------------------------------------------------------------------------------------------
local function mark_one(pending, resv, req, reservation_id, next_retry_at)
  local status = redis.call('HGET', resv, 'status')
  if not status then return 'NOT_FOUND' end
  if status ~= 'PENDING_MESSAGE' then return 'NOT_PENDING' end
  -- XX: a member removed meanwhile is not re-added; CH: 1 when it was re-scored. Its score and
  -- resv.next_retry_at are always written together, so 0 for a member means its record
  -- already holds next_retry_at.
  if redis.call('ZADD', pending, 'XX', 'CH', next_retry_at, reservation_id) == 1 then
    redis.call('HSET', resv, 'status', 'MESSAGE_SENT', 'next_retry_at', next_retry_at)
  else
    redis.call('HSET', resv, 'status', 'MESSAGE_SENT')
  end
  local state = redis.call('HMGET', req, 'reservation_id', 'state')
  if state[1] == reservation_id and state[2] == 'QUEUED_PENDING' then
    redis.call('HSET', req, 'state', 'QUEUED')
  end
  return 'OK'
end

local function mark_sent(keys, args)
  local n = #args - 2
  if n < 1 or n > MARK_SENT_MAX or #keys ~= 1 + 2 * n then return bad('arity') end
  local now_ms, deadline_ms = uint(args[1]), uint(args[2])
  if not now_ms then return bad('now_ms') end
  if not deadline_ms then return bad('order_deadline_ms') end
  local p = prefix_of(keys[1], 'resv:pending')
  if not p then return bad('keys') end
  for i = 1, n do
    local reservation_id = args[2 + i]
    if not id_ok(reservation_id) then return bad('reservation_id') end
    if keys[2 * i] ~= p .. 'resv:' .. reservation_id
        or not starts_with(keys[2 * i + 1], p .. 'req:') then
      return bad('keys')
    end
  end

  local next_retry_at = fmt(now_ms + deadline_ms)
  local replies = {}
  for i = 1, n do
    replies[i] = mark_one(keys[1], keys[2 * i], keys[2 * i + 1], args[2 + i], next_retry_at)
  end
  return replies
end

-- ---------------------------------------------------------------------------------------------
-- claim_due: the republish scanner's atomic claim of due reservations (DESIGN.md section 6).
--
-- KEYS: 1 resv:pending, 2 resv:stuck (ZSET: reservation_id scored by the ms it got stuck)
-- ARGV: 1 key_prefix (`seckill:{A:S}:`, must be the prefix of both KEYS), 2 now_ms,
--       3 batch_max (1..512), 4 backoff_base_ms, 5 backoff_max_ms, 6 recovery_deadline_ms
-- Undeclared keys: the `resv:<id>` hashes of the claimed members are only known after reading
-- the ZSET, so they cannot be declared up front. They are built from key_prefix, which is
-- checked to be the prefix of the declared keys: same hash tag, same slot, so this is safe in
-- Redis Cluster and touches only this SKU's keys.
-- For each of the first batch_max members of resv:pending with score <= now_ms (oldest first):
--   resv hash missing or final (ORDER_CREATED / FAILED / COMPENSATED)
--       -> ZREM from pending; not reported (cleanup of an outcome that already arrived)
--   a record that cannot be republished (status not PENDING_MESSAGE / MESSAGE_SENT, or
--   message_id, request_id, user_id, payload_hash, reserved_at or expires_at missing or
--   malformed)
--       -> moved to stuck as below with last_error_code = INVALID_RECORD (so one corrupt
--          record cannot poison every later claim)
--   now_ms - reserved_at > recovery_deadline_ms
--       -> ZADD stuck now_ms id, ZREM pending, resv.last_error_code = RECOVERY_DEADLINE;
--          reported in the stuck list (never silently dropped)
--   else send_attempts += 1,
--        next_retry_at = now_ms + min(backoff_max_ms, backoff_base_ms * 2^(send_attempts - 1)),
--        written to resv and as the pending score; reported as claimed.
-- Reply: [claimed_count, stuck_count,
--         then per claimed entry 10 bulk strings: reservation_id, message_id, request_id,
--           user_id, payload_hash, reserved_at, expires_at, send_attempts (after the bump),
--           status (PENDING_MESSAGE | MESSAGE_SENT), quantity (1 for a record written
--           before quantities),
--         then stuck_count reservation ids]
--   i.e. length 2 + 10 * claimed_count + stuck_count; counts are integers.
-- Invariants: a claimed entry stays in pending with a later score, so a scanner that dies
-- after claiming loses nothing; nothing leaves pending without either a final status or a
-- stuck record; stock, users and requests are never touched.
-- Complexity: O(batch_max * log n).
-- ---------------------------------------------------------------------------------------------
local function claim_due(keys, args)
  if #keys ~= 2 or #args ~= 6 then return bad('arity') end
  local prefix, now_ms, batch_max = args[1], uint(args[2]), uint(args[3])
  local base_ms, max_ms, recovery_ms = uint(args[4]), uint(args[5]), uint(args[6])
  if type(prefix) ~= 'string' or not string.find(prefix, '^seckill:{[^{}]+}:$')
      or keys[1] ~= prefix .. 'resv:pending' or keys[2] ~= prefix .. 'resv:stuck' then
    return bad('key_prefix')
  end
  if not now_ms then return bad('now_ms') end
  if not batch_max or batch_max < 1 or batch_max > CLAIM_BATCH_MAX then return bad('batch_max') end
  if not base_ms or base_ms < 1 then return bad('backoff_base_ms') end
  if not max_ms or max_ms < base_ms then return bad('backoff_max_ms') end
  if not recovery_ms then return bad('recovery_deadline_ms') end

  local due = redis.call('ZRANGEBYSCORE', keys[1], '-inf', args[2], 'LIMIT', 0, batch_max)
  local claimed, stuck = {}, {}
  for i = 1, #due do
    local id = due[i]
    local rkey = prefix .. 'resv:' .. id
    local r = redis.call('HMGET', rkey, 'status', 'reserved_at', 'message_id', 'request_id',
      'user_id', 'payload_hash', 'expires_at', 'send_attempts', 'quantity')
    local status = r[1]
    if not status or FINAL[status] then
      redis.call('ZREM', keys[1], id)
    else
      local reserved_at = uint(r[2])
      local quantity = r[9] or '1'
      local valid = CLAIMABLE[status] and reserved_at and id_ok(r[3]) and id_ok(r[4])
        and id_num(r[5]) and id_ok(r[6]) and uint(r[7]) and uint(quantity)
      local stuck_code = nil
      if not valid then
        stuck_code = 'INVALID_RECORD'
      elseif now_ms - reserved_at > recovery_ms then
        stuck_code = 'RECOVERY_DEADLINE'
      end
      if stuck_code then
        redis.call('ZADD', keys[2], args[2], id)
        redis.call('ZREM', keys[1], id)
        redis.call('HSET', rkey, 'last_error_code', stuck_code)
        stuck[#stuck + 1] = id
      else
        local attempts = (uint(r[8]) or 0) + 1
        local exponent = math.min(attempts - 1, BACKOFF_EXPONENT_MAX)
        local delay_ms = math.min(max_ms, base_ms * 2 ^ exponent)
        local next_retry_at = fmt(now_ms + delay_ms)
        redis.call('HSET', rkey, 'send_attempts', fmt(attempts), 'next_retry_at', next_retry_at)
        redis.call('ZADD', keys[1], next_retry_at, id)
        local n = #claimed
        claimed[n + 1] = id
        claimed[n + 2] = r[3]
        claimed[n + 3] = r[4]
        claimed[n + 4] = r[5]
        claimed[n + 5] = r[6]
        claimed[n + 6] = r[2]
        claimed[n + 7] = r[7]
        claimed[n + 8] = fmt(attempts)
        claimed[n + 9] = status
        claimed[n + 10] = quantity
      end
    end
  end

  local reply = { #claimed / 10, #stuck }
  for i = 1, #claimed do reply[#reply + 1] = claimed[i] end
  for i = 1, #stuck do reply[#reply + 1] = stuck[i] end
  return reply
end

-- ---------------------------------------------------------------------------------------------
-- apply_result: write a reservation's final outcome (from PostgreSQL, via redis-sync) back.
--
-- KEYS: 1 req:<user_id>:<request_id>, 2 resv:<reservation_id>, 3 resv:pending, 4 resv:stuck
-- ARGV: 1 reservation_id, 2 outcome (ORDER_CREATED | FAILED), 3 order_id (required for
--       ORDER_CREATED, "" for FAILED), 4 reason_code (required for FAILED, "" for
--       ORDER_CREATED), 5 now_ms, 6 request_id, 7 payload_hash, 8 message_id, 9 user_id
--       (6..9 are used only to recreate a req hash Redis lost, so idempotent replays of the
--       request keep working)
-- The current final outcome is resv.status when final, else (resv lost) the one req.state
-- records (SUCCEEDED -> ORDER_CREATED, FAILED -> FAILED), else none.
-- Reply: bulk string
--   APPLIED   no final outcome yet: req.state = SUCCEEDED + order_id (or FAILED + reason_code),
--             req recreated from ARGV if missing; resv (if present) status = outcome, order_id,
--             last_error_code = reason_code, finished_at = now_ms; ZREM pending and stuck
--   ALREADY   the same outcome is already recorded (ORDER_CREATED with the same order_id;
--             FAILED over FAILED or COMPENSATED; ORDER_CREATED with the same order_id over
--             COMPENSATED, i.e. an order later cancelled). Nothing changed.
--   CONFLICT  a different final outcome is recorded (e.g. FAILED over ORDER_CREATED, another
--             order_id), or req belongs to another reservation. Nothing changed.
-- Invariants: a final outcome is never overwritten by a different one; the reservation
-- leaves resv:pending (and resv:stuck: an outcome that arrives late resolves it) exactly when
-- its final outcome is recorded; stock and user keys are
-- not touched (compensate does that, once).
-- Complexity: O(1).
-- ---------------------------------------------------------------------------------------------
-- The arguments of one outcome (ARGV order of `apply_result` 1..9 above; `a` is ARGV, `o` the
-- offset of its reservation_id, so the batch form reuses it) checked against its keys: nil
-- when good, else the name of the first bad argument.
local function apply_bad(req_key, resv_key, p, a, o)
  local reservation_id, outcome, order_id, reason_code = a[o], a[o + 1], a[o + 2], a[o + 3]
  local request_id, payload_hash, message_id, user_id = a[o + 5], a[o + 6], a[o + 7], a[o + 8]
  if not id_ok(reservation_id) then return 'reservation_id' end
  if outcome == 'ORDER_CREATED' then
    if not id_ok(order_id) or reason_code ~= '' then return 'order_id' end
  elseif outcome == 'FAILED' then
    if not id_ok(reason_code) or order_id ~= '' then return 'reason_code' end
  else
    return 'outcome'
  end
  if not uint(a[o + 4]) then return 'now_ms' end
  if not id_ok(request_id) then return 'request_id' end
  if not id_ok(payload_hash) then return 'payload_hash' end
  if not id_ok(message_id) then return 'message_id' end
  if not id_num(user_id) then return 'user_id' end
  if req_key ~= p .. 'req:' .. user_id .. ':' .. request_id
      or resv_key ~= p .. 'resv:' .. reservation_id then
    return 'keys'
  end
  return nil
end

-- One checked outcome (see apply_result's contract). Five commands for a first outcome: the
-- stuck entry is removed only when the record says the scanner put it there
-- (last_error_code, written by claim_due) or the record is gone.
local function apply_one(req_key, resv_key, pending, stuck, a, o)
  local reservation_id, outcome, order_id, reason_code = a[o], a[o + 1], a[o + 2], a[o + 3]
  local now_ms = a[o + 4]
  local req = redis.call('HMGET', req_key, 'reservation_id', 'state', 'order_id')
  if req[1] and req[1] ~= reservation_id then return 'CONFLICT' end
  local resv = redis.call('HMGET', resv_key, 'status', 'order_id', 'last_error_code')
  local current, current_order = nil, nil
  if resv[1] and FINAL[resv[1]] then
    current, current_order = resv[1], resv[2] or ''
  elseif req[2] == 'SUCCEEDED' then
    current, current_order = 'ORDER_CREATED', req[3] or ''
  elseif req[2] == 'FAILED' then
    current = 'FAILED'
  end
  if current == 'ORDER_CREATED' then
    if outcome == 'ORDER_CREATED' and order_id == current_order then return 'ALREADY' end
    return 'CONFLICT'
  elseif current == 'FAILED' then
    if outcome == 'FAILED' then return 'ALREADY' end
    return 'CONFLICT'
  elseif current == 'COMPENSATED' then
    if outcome == 'FAILED' or order_id == current_order then return 'ALREADY' end
    return 'CONFLICT'
  end

  local state = 'SUCCEEDED'
  if outcome == 'FAILED' then state = 'FAILED' end
  if req[1] then
    redis.call('HSET', req_key, 'state', state, 'order_id', order_id, 'reason_code', reason_code)
  else
    redis.call('HSET', req_key, 'payload_hash', a[o + 6], 'reservation_id', reservation_id,
      'message_id', a[o + 7], 'state', state, 'order_id', order_id,
      'reason_code', reason_code, 'user_id', a[o + 8])
  end
  if resv[1] then
    redis.call('HSET', resv_key, 'status', outcome, 'order_id', order_id,
      'last_error_code', reason_code, 'finished_at', now_ms)
  end
  redis.call('ZREM', pending, reservation_id)
  if not resv[1] or (resv[3] or '') ~= '' then redis.call('ZREM', stuck, reservation_id) end
  return 'APPLIED'
end

local function apply_result(keys, args)
  if #keys ~= 4 or #args ~= 9 then return bad('arity') end
  local p = prefix_of(keys[3], 'resv:pending')
  local wrong = apply_bad(keys[1], keys[2], p or '', args, 1)
  if wrong and wrong ~= 'keys' then return bad(wrong) end
  if not p or wrong or keys[4] ~= p .. 'resv:stuck' then return bad('keys') end
  return apply_one(keys[1], keys[2], keys[3], keys[4], args, 1)
end

-- ---------------------------------------------------------------------------------------------
-- apply_results: the outcomes of several reservations of one SKU in one call (redis-sync's
-- batch: the events of one fetch for one SKU), each applied exactly as `apply_result` would,
-- in order (the same reservation twice: APPLIED, then ALREADY).
--
-- KEYS: 1 resv:pending, 2 resv:stuck, then per outcome i (1..n): req_i, resv_i
-- ARGV: per outcome i, the 9 arguments of `apply_result` (ARGV 9(i-1)+1 .. 9i)
-- n is 1..APPLY_RESULTS_MAX; every key of the SKU of KEYS[1].
-- Reply: array of n bulk strings, APPLIED | ALREADY | CONFLICT per outcome, in order.
-- Every argument of every outcome is checked before anything is written: a batch with one bad
-- outcome changes nothing (the caller then applies its outcomes one by one, so the bad one
-- fails alone).
-- Complexity: O(n).
-- ---------------------------------------------------------------------------------------------
local function apply_results(keys, args)
  local n = #args / 9
  if n < 1 or n > APPLY_RESULTS_MAX or n ~= math.floor(n) or #keys ~= 2 + 2 * n then
    return bad('arity')
  end
  local p = prefix_of(keys[1], 'resv:pending')
  if not p or keys[2] ~= p .. 'resv:stuck' then return bad('keys') end
  for i = 1, n do
    local wrong = apply_bad(keys[1 + 2 * i], keys[2 + 2 * i], p, args, 9 * (i - 1) + 1)
    if wrong then return bad(wrong) end
  end
  local replies = {}
  for i = 1, n do
    replies[i] = apply_one(keys[1 + 2 * i], keys[2 + 2 * i], keys[1], keys[2], args,
      9 * (i - 1) + 1)
  end
  return replies
end

-- ---------------------------------------------------------------------------------------------
-- compensate: undo a reservation's Redis effects, once (DESIGN.md section 6, redis-sync).
--
-- KEYS: 1 comp:<reservation_id>, 2 stock, 3 user:<user_id>, 4 resv:<reservation_id>,
--       5 req:<user_id>:<request_id>, 6 resv:pending, 7 soldout, 8 resv:stuck
-- ARGV: 1 reservation_id, 2 return_stock (0|1), 3 release_user (0|1), 4 reason_code, 5 now_ms,
--       6 units (1..QUANTITY_MAX: the reservation's quantity, what return_stock gives back)
-- Reply: [code, stock] where stock is the integer stock after the call (0 if the key is missing)
--   ALREADY_APPLIED  comp marker exists: this reservation was compensated before; no effect
--   APPLIED          SET comp (value = `<reason_code>|<1 if stock was returned, else 0>`, so
--                    reconcile can count units from the marker alone; no expiry: an expiring
--                    marker would allow a second return); return_stock=1 -> INCRBY stock
--                    units, DEL soldout;
--                    release_user=1 -> DEL user key only if it still holds THIS reservation_id
--                    (the user may hold a newer reservation); resv (if present) status =
--                    COMPENSATED, last_error_code = reason_code, finished_at = now_ms;
--                    req (if present and it belongs to this reservation) state = FAILED,
--                    reason_code; ZREM pending and stuck
-- Invariants: stock is returned at most once per reservation (the comp marker is written in
-- the same atomic step); stock only grows here; a user key of another reservation is never
-- deleted; req/resv hashes are never fabricated (a half hash would break replays).
-- Complexity: O(1).
-- ---------------------------------------------------------------------------------------------
local function compensate(keys, args)
  if #keys ~= 8 or #args ~= 6 then return bad('arity') end
  local reservation_id, reason_code = args[1], args[4]
  local return_stock, release_user, now_ms = flag(args[2]), flag(args[3]), uint(args[5])
  local units = uint(args[6])
  if not id_ok(reservation_id) then return bad('reservation_id') end
  if return_stock == nil then return bad('return_stock') end
  if release_user == nil then return bad('release_user') end
  if not id_ok(reason_code) then return bad('reason_code') end
  if not now_ms then return bad('now_ms') end
  if not units or units < 1 or units > QUANTITY_MAX then return bad('units') end
  local p = prefix_of(keys[2], 'stock')
  if not p or keys[1] ~= p .. 'comp:' .. reservation_id or not starts_with(keys[3], p .. 'user:')
      or keys[4] ~= p .. 'resv:' .. reservation_id or not starts_with(keys[5], p .. 'req:')
      or keys[6] ~= p .. 'resv:pending' or keys[7] ~= p .. 'soldout'
      or keys[8] ~= p .. 'resv:stuck' then
    return bad('keys')
  end

  if redis.call('EXISTS', keys[1]) == 1 then
    return { 'ALREADY_APPLIED', tonumber(redis.call('GET', keys[2])) or 0 }
  end
  local returned = '0'
  if return_stock then returned = '1' end
  redis.call('SET', keys[1], reason_code .. '|' .. returned)
  local stock
  if return_stock then
    stock = redis.call('INCRBY', keys[2], units)
    redis.call('DEL', keys[7])
  else
    stock = tonumber(redis.call('GET', keys[2])) or 0
  end
  if release_user and redis.call('GET', keys[3]) == reservation_id then
    redis.call('DEL', keys[3])
  end
  if redis.call('EXISTS', keys[4]) == 1 then
    redis.call('HSET', keys[4], 'status', 'COMPENSATED', 'last_error_code', reason_code,
      'finished_at', args[5])
  end
  if redis.call('HGET', keys[5], 'reservation_id') == reservation_id then
    redis.call('HSET', keys[5], 'state', 'FAILED', 'reason_code', reason_code)
  end
  redis.call('ZREM', keys[6], reservation_id)
  redis.call('ZREM', keys[8], reservation_id)
  return { 'APPLIED', stock }
end

-- ---------------------------------------------------------------------------------------------
-- preheat: install or update a SKU's activity snapshot and its initial stock.
--
-- KEYS: 1 meta, 2 stock, 3 soldout
-- ARGV: 1 status (PENDING | ACTIVE | ENDED | TERMINATED), 2 start_ms, 3 end_ms (> start_ms),
--       4 version, 5 reservation_ttl_ms (>= 1), 6 stock, 7 max_per_buyer (1..QUANTITY_MAX)
-- Reply: [code, version] (integer)
--   APPLIED  meta was missing or ARGV version > meta.version: meta = {status, start_ms, end_ms,
--            version, reservation_ttl_ms, max_per_buyer}; stock SET only if absent (NX), and on
--            that first set
--            soldout is set iff stock <= 0 (and deleted otherwise); version = ARGV version
--   STALE    meta.version >= ARGV version (an equal version is STALE too: callers compare
--            current_version with their own to tell "already installed" from "newer exists");
--            version = the current one; nothing changed
-- Invariants: a newer snapshot never resets live stock (the stock key is written once, after
-- that only reserve/compensate move it); versions only grow.
-- Complexity: O(1).
-- ---------------------------------------------------------------------------------------------
local function preheat(keys, args)
  if #keys ~= 3 or #args ~= 7 then return bad('arity') end
  local status = args[1]
  local start_ms, end_ms, version = uint(args[2]), uint(args[3]), uint(args[4])
  local ttl_ms, stock, limit = uint(args[5]), uint(args[6]), uint(args[7])
  if not ACTIVITY_STATUS[status] then return bad('status') end
  if not start_ms then return bad('start_ms') end
  if not end_ms or end_ms <= start_ms then return bad('end_ms') end
  if not version then return bad('version') end
  if not ttl_ms or ttl_ms < 1 then return bad('reservation_ttl_ms') end
  if not stock then return bad('stock') end
  if not limit or limit < 1 or limit > QUANTITY_MAX then return bad('max_per_buyer') end
  local p = prefix_of(keys[1], 'meta')
  if not p or keys[2] ~= p .. 'stock' or keys[3] ~= p .. 'soldout' then return bad('keys') end

  local current = uint(redis.call('HGET', keys[1], 'version'))
  if current and version <= current then return { 'STALE', current } end
  redis.call('HSET', keys[1], 'status', status, 'start_ms', args[2], 'end_ms', args[3],
    'version', args[4], 'reservation_ttl_ms', args[5], 'max_per_buyer', args[7])
  if redis.call('SET', keys[2], args[6], 'NX') then
    if stock <= 0 then
      redis.call('SET', keys[3], '1')
    else
      redis.call('DEL', keys[3])
    end
  end
  return { 'APPLIED', version }
end

-- ---------------------------------------------------------------------------------------------
-- top_up: raise a SKU's stock by the units PostgreSQL just created for it (an operator's
-- top-up, `pg-worker/src/lifecycle.rs`).
--
-- KEYS: 1 meta, 2 stock, 3 soldout
-- ARGV: 1 add (>= 1), 2 version (the SKU's PostgreSQL version after this top-up, >= 1)
-- Reply: [code, stock] where stock is the integer stock after the call
--   APPLIED  meta field `topup:<version>` was absent: HSET it to add, INCRBY stock add,
--            DEL soldout when stock > 0
--   ALREADY  `topup:<version>` exists: this top-up was applied before; nothing changed
--   NO_META  the SKU was never preheated: nothing changed (a top-up needs a live SKU)
-- Invariants: each top-up (one PostgreSQL version) raises stock exactly once, whatever the
-- order in which concurrent top-ups arrive (one field per version, not a high-water mark);
-- stock only grows here.
-- Complexity: O(1).
-- ---------------------------------------------------------------------------------------------
local function top_up(keys, args)
  if #keys ~= 3 or #args ~= 2 then return bad('arity') end
  local add, version = uint(args[1]), uint(args[2])
  if not add or add < 1 then return bad('add') end
  if not version or version < 1 then return bad('version') end
  local p = prefix_of(keys[1], 'meta')
  if not p or keys[2] ~= p .. 'stock' or keys[3] ~= p .. 'soldout' then return bad('keys') end

  if redis.call('EXISTS', keys[1]) == 0 then
    return { 'NO_META', tonumber(redis.call('GET', keys[2])) or 0 }
  end
  if redis.call('HSETNX', keys[1], 'topup:' .. args[2], args[1]) == 0 then
    return { 'ALREADY', tonumber(redis.call('GET', keys[2])) or 0 }
  end
  local stock = redis.call('INCRBY', keys[2], add)
  if stock > 0 then redis.call('DEL', keys[3]) end
  return { 'APPLIED', stock }
end

-- ---------------------------------------------------------------------------------------------
-- restore: a SKU whose keys Redis lost (FLUSHALL, a node back empty, a master lost with its
-- replica) rebuilt from PostgreSQL by one engine shard (engine/src/shard/rebuild.rs), in steps
-- under one lock so that two instances never rebuild one SKU at once. Every step refuses (LIVE)
-- once meta exists: a rebuild only ever writes into a SKU nobody can sell from, and meta is
-- written last (FINISH), so reserve answers "no meta" until the rebuild is whole.
--
-- KEYS: 1 meta, 2 stock, 3 soldout, 4 rebuild (the lock), 5 resv:pending, 6 resv:stuck, then
--       per mode:
--   BEGIN        none
--   WIPE         the SKU's other keys to delete (resv:, req:, user:, comp:)
--   RESERVATION  7 user:<user_id>, 8 req:<user_id>:<request_id>, 9 resv:<reservation_id>
--   FINISH       none
-- ARGV: 1 mode, 2 token (the rebuilder's own), 3 lock_ttl_ms (every step that passes renews
--       the lock for this long, so a long rebuild keeps it and a dead rebuilder's lapses
--       soon), then per mode:
--   BEGIN        4 stock (PostgreSQL's total stock: the replay of history takes the units back
--                out)
--   WIPE         none
--   RESERVATION  4 request_id, 5 user_id, 6 payload_hash, 7 reservation_id, 8 message_id,
--                9 reserved_at, 10 expires_at, 11 next_retry_at, 12 quantity
--   FINISH       4 status, 5 start_ms, 6 end_ms, 7 version, 8 reservation_ttl_ms,
--                9 max_per_buyer
-- Reply: [code, stock] (stock: the integer stock after the call, 0 when missing); code:
--   LIVE     meta exists: the SKU is whole (nothing changed)
--   BUSY     another token holds the lock (BEGIN), or this token lost it (others): nothing
--            changed
--   OK       BEGIN: lock taken, pending, stuck and soldout deleted, stock set;
--            WIPE: the keys deleted; RESERVATION: the reservation written as `reserve` writes
--            a CREATED one whose message the log acknowledged (req QUEUED, resv MESSAGE_SENT,
--            in resv:pending at next_retry_at, its units taken, the user marker claimed if
--            free), so the outcomes PostgreSQL announced replay onto it through apply_results
--            and compensate exactly as they did the first time; FINISH: a stock the replay
--            left below zero set to 0 (a history in which Redis once sold units PostgreSQL
--            did not have: those reservations were rejected without returning stock), soldout
--            set when stock is 0, meta written, lock deleted.
-- Invariants: nothing is written while meta exists; a write needs the lock; the stock after a
-- whole rebuild is total - units still held, as reconcile counts it, and never negative.
-- Complexity: O(1), WIPE O(keys).
-- ---------------------------------------------------------------------------------------------
local function restore_stock(keys)
  return tonumber(redis.call('GET', keys[2])) or 0
end

local function restore_begin(keys, args)
  if #args ~= 4 then return bad('arity') end
  local stock = uint(args[4])
  if not stock then return bad('stock') end
  local held = redis.call('GET', keys[4])
  if held and held ~= args[2] then return { 'BUSY', restore_stock(keys) } end
  redis.call('SET', keys[4], args[2], 'PX', args[3])
  redis.call('DEL', keys[3], keys[5], keys[6])
  redis.call('SET', keys[2], args[4])
  if stock <= 0 then redis.call('SET', keys[3], '1') end
  return { 'OK', stock }
end

local function restore_reservation(keys, args)
  if #keys ~= 9 or #args ~= 12 then return bad('arity') end
  local request_id, user_id, payload_hash = args[4], args[5], args[6]
  local reservation_id, message_id = args[7], args[8]
  if not id_ok(request_id) then return bad('request_id') end
  if not id_num(user_id) then return bad('user_id') end
  if not id_ok(payload_hash) then return bad('payload_hash') end
  if not id_ok(reservation_id) then return bad('reservation_id') end
  if not id_ok(message_id) then return bad('message_id') end
  for i = 9, 11 do
    if not uint(args[i]) then return bad('time') end
  end
  local quantity = uint(args[12])
  if not quantity or quantity < 1 or quantity > QUANTITY_MAX then return bad('quantity') end
  local p = prefix_of(keys[1], 'meta')
  if keys[7] ~= p .. 'user:' .. user_id or keys[8] ~= p .. 'req:' .. user_id .. ':' .. request_id
      or keys[9] ~= p .. 'resv:' .. reservation_id then
    return bad('keys')
  end
  redis.call('SET', keys[7], reservation_id, 'NX')
  local stock_after = redis.call('DECRBY', keys[2], quantity)
  if stock_after <= 0 then redis.call('SET', keys[3], '1') end
  redis.call('HSET', keys[8], 'payload_hash', payload_hash, 'reservation_id', reservation_id,
    'message_id', message_id, 'state', 'QUEUED', 'order_id', '', 'reason_code', '',
    'user_id', user_id)
  redis.call('HSET', keys[9], 'reservation_id', reservation_id, 'message_id', message_id,
    'request_id', request_id, 'user_id', user_id, 'status', 'MESSAGE_SENT',
    'payload_hash', payload_hash, 'reserved_at', args[9], 'expires_at', args[10],
    'send_attempts', '0', 'next_retry_at', args[11], 'last_error_code', '', 'quantity', args[12])
  redis.call('ZADD', keys[5], args[11], reservation_id)
  return { 'OK', stock_after }
end

local function restore_finish(keys, args)
  if #keys ~= 6 or #args ~= 9 then return bad('arity') end
  if not ACTIVITY_STATUS[args[4]] then return bad('status') end
  for i = 5, 9 do
    if not uint(args[i]) then return bad('meta') end
  end
  local stock = restore_stock(keys)
  if stock < 0 then
    stock = 0
    redis.call('SET', keys[2], '0')
  end
  if stock == 0 then redis.call('SET', keys[3], '1') else redis.call('DEL', keys[3]) end
  redis.call('HSET', keys[1], 'status', args[4], 'start_ms', args[5], 'end_ms', args[6],
    'version', args[7], 'reservation_ttl_ms', args[8], 'max_per_buyer', args[9])
  redis.call('DEL', keys[4])
  return { 'OK', stock }
end

-- The keys WIPE deletes: every one a record key of this SKU (resv:, req:, user:, comp:), or
-- nil when one is not.
local function restore_wiped(keys, p)
  local wipe = {}
  for i = 7, #keys do
    local k = keys[i]
    if not (starts_with(k, p .. 'resv:') or starts_with(k, p .. 'req:')
        or starts_with(k, p .. 'user:') or starts_with(k, p .. 'comp:')) then
      return nil
    end
    wipe[#wipe + 1] = k
  end
  return wipe
end

local function restore(keys, args)
  if #keys < 6 or #args < 3 then return bad('arity') end
  local mode, token, ttl_ms = args[1], args[2], uint(args[3])
  if not id_ok(token) then return bad('token') end
  if not ttl_ms or ttl_ms < 1 then return bad('lock_ttl_ms') end
  local p = prefix_of(keys[1], 'meta')
  if not p or keys[2] ~= p .. 'stock' or keys[3] ~= p .. 'soldout' or keys[4] ~= p .. 'rebuild'
      or keys[5] ~= p .. 'resv:pending' or keys[6] ~= p .. 'resv:stuck' then
    return bad('keys')
  end
  local wipe
  if mode == 'WIPE' then
    if #args ~= 3 then return bad('arity') end
    wipe = restore_wiped(keys, p)
    if not wipe then return bad('keys') end
  elseif mode == 'BEGIN' then
    if #keys ~= 6 then return bad('arity') end
  elseif mode ~= 'RESERVATION' and mode ~= 'FINISH' then
    return bad('mode')
  end
  if redis.call('EXISTS', keys[1]) == 1 then return { 'LIVE', restore_stock(keys) } end
  if mode == 'BEGIN' then return restore_begin(keys, args) end
  if redis.call('GET', keys[4]) ~= token then return { 'BUSY', restore_stock(keys) } end
  if mode == 'FINISH' then return restore_finish(keys, args) end
  redis.call('PEXPIRE', keys[4], args[3])
  if mode == 'WIPE' then
    if #wipe > 0 then redis.call('DEL', unpack(wipe)) end
    return { 'OK', restore_stock(keys) }
  end
  return restore_reservation(keys, args)
end

redis.register_function('reserve', reserve)
redis.register_function('mark_sent', mark_sent)
redis.register_function('claim_due', claim_due)
redis.register_function('apply_result', apply_result)
redis.register_function('apply_results', apply_results)
redis.register_function('compensate', compensate)
redis.register_function('preheat', preheat)
redis.register_function('top_up', top_up)
redis.register_function('restore', restore)
