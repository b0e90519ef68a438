"""The Lua scripts of the Redis stores: every write that touches more than one key is one script,
so Redis runs it as one step (nothing half-written, no lost update between replicas) timed by
the server's clock (replica clocks may disagree).

A bounded store under prefix ``P`` (responses, conversations, the reasoning echo) keeps:

- ``P:d:<id>`` the entry (a conversation also has ``P:d:<id>:items``, a list), with the TTL as
  Redis expiry;
- ``P:lru`` a sorted set of ids by last use (milliseconds, server time);
- ``P:exp`` a sorted set of ids by expiry, so that the bookkeeping of entries Redis expired is
  dropped on the next write;
- ``P:size`` a hash of id -> bytes and ``P:bytes`` their sum.

and, for entries that have an owner (an organization; a conversation key ``owner:id`` names its
own, a response's is passed with it):

- ``P:own`` a hash of id -> owner, ``P:o:<owner>`` a sorted set of the owner's ids by last use,
  and ``P:heavy`` a sorted set of owners by the bytes they hold.

A write adds the entry, then evicts its owner's least recently used entries while the owner holds
more than ``OWNER_SHARE`` of the entry limit or byte budget, then the least recently used entries
of the owner holding the most bytes (of the store, when no entry has an owner) while the store
holds more than its entry limit or byte budget: one organization filling the store evicts its own
entries, never another's. That is LRU by bytes; it is approximate in that sizes are JSON lengths
and that entries expired by Redis count until the next write notices them (at most 128 per
write).

Scripts compute the keys they touch from their arguments, so they need one Redis primary
(standalone, Sentinel or a managed primary), not Redis Cluster.
"""

from __future__ import annotations

from ..lru import OWNER_SHARE

LIB = f"local SHARE = {OWNER_SHARE!r}\n" + r"""
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function forget(p, id)
  local d = p .. ':d:' .. id
  local existed = redis.call('DEL', d, d .. ':items')
  redis.call('ZREM', p .. ':lru', id)
  redis.call('ZREM', p .. ':exp', id)
  local size = tonumber(redis.call('HGET', p .. ':size', id) or '0')
  if redis.call('HDEL', p .. ':size', id) == 1 then
    redis.call('DECRBY', p .. ':bytes', size)
  end
  local owner = redis.call('HGET', p .. ':own', id)
  if owner then
    redis.call('HDEL', p .. ':own', id)
    local mine = p .. ':o:' .. owner
    redis.call('ZREM', mine, id)
    if redis.call('ZCARD', mine) == 0 then
      redis.call('ZREM', p .. ':heavy', owner)
    else
      redis.call('ZINCRBY', p .. ':heavy', -size, owner)
    end
  end
  return existed
end

local function touch(p, id, now)
  redis.call('ZADD', p .. ':lru', 'XX', now, id)
  local owner = redis.call('HGET', p .. ':own', id)
  if owner then redis.call('ZADD', p .. ':o:' .. owner, 'XX', now, id) end
end

local function key_owner(key)
  return string.match(key, '^(.-):') or ''
end

local function expire_due(p, now)
  local due = redis.call('ZRANGEBYSCORE', p .. ':exp', '-inf', now, 'LIMIT', 0, 128)
  for _, id in ipairs(due) do forget(p, id) end
end

local function account(p, id, size, now, owner)
  local old = tonumber(redis.call('HGET', p .. ':size', id) or '0')
  redis.call('HSET', p .. ':size', id, size)
  redis.call('INCRBY', p .. ':bytes', size - old)
  redis.call('ZADD', p .. ':lru', now, id)
  if owner ~= '' then
    redis.call('HSET', p .. ':own', id, owner)
    redis.call('ZADD', p .. ':o:' .. owner, now, id)
    redis.call('ZINCRBY', p .. ':heavy', size - old, owner)
  end
end

-- The owner's oldest entries past its share, then the heaviest owner's oldest past the store's limits.
local function evict(p, max_entries, max_bytes, owner)
  if owner ~= '' then
    local mine = p .. ':o:' .. owner
    while true do
      local n = redis.call('ZCARD', mine)
      if n == 0 then break end
      local b = tonumber(redis.call('ZSCORE', p .. ':heavy', owner) or '0')
      if n <= SHARE * max_entries and b <= SHARE * max_bytes then break end
      forget(p, redis.call('ZRANGE', mine, 0, 0)[1])
    end
  end
  while true do
    local n = redis.call('ZCARD', p .. ':lru')
    local b = tonumber(redis.call('GET', p .. ':bytes') or '0')
    if n <= max_entries and b <= max_bytes then return end
    if n == 0 then
      redis.call('SET', p .. ':bytes', 0)
      return
    end
    local victim = nil
    local heaviest = redis.call('ZREVRANGE', p .. ':heavy', 0, 0)[1]
    if heaviest then victim = redis.call('ZRANGE', p .. ':o:' .. heaviest, 0, 0)[1] end
    if not victim then victim = redis.call('ZRANGE', p .. ':lru', 0, 0)[1] end
    forget(p, victim)
  end
end

local function put_value(p, id, value, size, ttl, max_entries, max_bytes, now, owner)
  owner = owner or ''
  expire_due(p, now)
  forget(p, id)
  if max_entries <= 0 or size > max_bytes then return 0 end
  local d = p .. ':d:' .. id
  if ttl > 0 then
    redis.call('SET', d, value, 'PX', ttl)
    redis.call('ZADD', p .. ':exp', now + ttl, id)
  else
    redis.call('SET', d, value)
  end
  account(p, id, size, now, owner)
  evict(p, max_entries, max_bytes, owner)
  return redis.call('EXISTS', d)
end

local function push_all(key, first)
  local added = 0
  local i = first
  while i <= #ARGV do
    local last = math.min(i + 999, #ARGV)
    redis.call('RPUSH', key, unpack(ARGV, i, last))
    for j = i, last do added = added + string.len(ARGV[j]) + 1 end
    i = last + 1
  end
  return added
end

local function end_job(ns, id)
  local job = ns .. ':job:' .. id
  local reserved = tonumber(redis.call('HGET', job, 'reserved') or '0')
  redis.call('DEL', job)
  if redis.call('ZREM', ns .. ':jobs:lease', id) == 1 then
    redis.call('DECRBY', ns .. ':jobs:bytes', reserved)
  end
end
"""

# -- bounded stores ----------------------------------------------------------------------------

# ARGV: prefix, id, value, size, ttl ms (0: none), max entries, max bytes, owner ('': none). 1 if kept.
PUT = LIB + r"""
return put_value(ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), now_ms(), ARGV[8])
"""

# ARGV: prefix, id. The value (nil when unknown); a hit counts as a use.
GET = LIB + r"""
local v = redis.call('GET', ARGV[1] .. ':d:' .. ARGV[2])
if v then touch(ARGV[1], ARGV[2], now_ms()) end
return v
"""

# ARGV: prefix, id. 1 if it existed.
DELETE = LIB + r"""
return forget(ARGV[1], ARGV[2])
"""

# ARGV: prefix. {entries, bytes}.
STATS = LIB + r"""
expire_due(ARGV[1], now_ms())
return {redis.call('ZCARD', ARGV[1] .. ':lru'), tonumber(redis.call('GET', ARGV[1] .. ':bytes') or '0')}
"""

# -- conversations: P:d:<key> a hash (id, created_at, metadata, mb, ib), P:d:<key>:items a list ----

_CONV_SIZE = r"""
local function conv_size(d)
  return tonumber(redis.call('HGET', d, 'mb') or '0') + tonumber(redis.call('HGET', d, 'ib') or '0') + 64
end
local function conv_start(p, key, d, cid, created, meta, ttl, now)
  forget(p, key)
  redis.call('HSET', d, 'id', cid, 'created_at', created, 'metadata', meta, 'mb', string.len(meta), 'ib', 0)
  if ttl > 0 then
    redis.call('PEXPIRE', d, ttl)
    redis.call('ZADD', p .. ':exp', now + ttl, key)
  end
end
local function conv_keep(p, key, d, now, max_entries, max_bytes)
  local pttl = redis.call('PTTL', d)
  if pttl > 0 and redis.call('EXISTS', d .. ':items') == 1 then redis.call('PEXPIRE', d .. ':items', pttl) end
  account(p, key, conv_size(d), now, key_owner(key))
  evict(p, max_entries, max_bytes, key_owner(key))
  return redis.call('EXISTS', d)
end
"""

# ARGV: prefix, key, id, created_at, metadata json, ttl ms, max entries, max bytes, items... 1 if kept.
CONV_CREATE = LIB + _CONV_SIZE + r"""
local p, key = ARGV[1], ARGV[2]
local d = p .. ':d:' .. key
local now = now_ms()
expire_due(p, now)
if tonumber(ARGV[7]) <= 0 then
  forget(p, key)
  return 0
end
conv_start(p, key, d, ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6]), now)
redis.call('HSET', d, 'ib', push_all(d .. ':items', 9))
if conv_size(d) > tonumber(ARGV[8]) then
  forget(p, key)
  return 0
end
return conv_keep(p, key, d, now, tonumber(ARGV[7]), tonumber(ARGV[8]))
"""

def _conv_write(size_after: str, write_items: str) -> str:
    """A script that starts the conversation when it does not exist, writes its items with
    ``write_items`` (Lua: items from ARGV[8] on), and applies the limits. 1 if still kept; minus
    the size it would have had (``size_after``, Lua, given ``added``: the items' bytes) when that
    is over what one conversation may hold (its owner's share, or the store's budget), and then
    nothing is written.

    ARGV: prefix, key, id if new, created_at if new, ttl ms, max entries, max bytes, items...
    """
    return LIB + _CONV_SIZE + r"""
local p, key = ARGV[1], ARGV[2]
local d = p .. ':d:' .. key
local now = now_ms()
expire_due(p, now)
if tonumber(ARGV[6]) <= 0 then return 0 end
local added = 0
for j = 8, #ARGV do added = added + string.len(ARGV[j]) + 1 end
local exists = redis.call('EXISTS', d) == 1
local limit = tonumber(ARGV[7])
if key_owner(key) ~= '' then limit = math.floor(SHARE * limit) end
local size = """ + size_after + r"""
if size > limit then return -size end
if not exists then conv_start(p, key, d, ARGV[3], ARGV[4], '{}', tonumber(ARGV[5]), now) end
""" + write_items + r"""
return conv_keep(p, key, d, now, tonumber(ARGV[6]), tonumber(ARGV[7]))
"""


# Adds the items after those already there.
CONV_APPEND = _conv_write("(exists and conv_size(d) or 66) + added", "redis.call('HINCRBY', d, 'ib', push_all(d .. ':items', 8))")

# The items become exactly these (a compacted history).
CONV_REPLACE = _conv_write(
    "(exists and tonumber(redis.call('HGET', d, 'mb') or '0') or 2) + 64 + added", "redis.call('DEL', d .. ':items')\nredis.call('HSET', d, 'ib', push_all(d .. ':items', 8))"
)

# ARGV: prefix, key, metadata json, max entries, max bytes. 1 if kept, 0 if unknown.
CONV_METADATA = LIB + _CONV_SIZE + r"""
local p, key = ARGV[1], ARGV[2]
local d = p .. ':d:' .. key
if redis.call('EXISTS', d) == 0 then return 0 end
redis.call('HSET', d, 'metadata', ARGV[3], 'mb', string.len(ARGV[3]))
return conv_keep(p, key, d, now_ms(), tonumber(ARGV[4]), tonumber(ARGV[5]))
"""

# ARGV: prefix, key, the item's stored json, max entries, max bytes. 1 if removed, 0 if not there.
CONV_DELETE_ITEM = LIB + _CONV_SIZE + r"""
local p, key = ARGV[1], ARGV[2]
local d = p .. ':d:' .. key
if redis.call('EXISTS', d) == 0 then return 0 end
if redis.call('LREM', d .. ':items', 1, ARGV[3]) == 0 then return 0 end
redis.call('HINCRBY', d, 'ib', -(string.len(ARGV[3]) + 1))
conv_keep(p, key, d, now_ms(), tonumber(ARGV[4]), tonumber(ARGV[5]))
return 1
"""

# ARGV: prefix, key. {hash fields..., items...} as {flat hash, list}, or nil; a hit is a use.
CONV_GET = LIB + r"""
local p, key = ARGV[1], ARGV[2]
local d = p .. ':d:' .. key
local fields = redis.call('HGETALL', d)
if #fields == 0 then return nil end
touch(p, key, now_ms())
return {fields, redis.call('LRANGE', d .. ':items', 0, -1)}
"""

# ARGV: prefix, key. The hash's fields (flat), or nil: CONV_GET without the items; a hit is a use.
CONV_HEAD = LIB + r"""
local p, key = ARGV[1], ARGV[2]
local d = p .. ':d:' .. key
local fields = redis.call('HGETALL', d)
if #fields == 0 then return nil end
touch(p, key, now_ms())
return fields
"""

# -- the item index: P:h field -> holder, P:z field -> when added; oldest forgotten first ------

# ARGV: prefix, max entries, holder, fields...
ITEMS_ADD = LIB + r"""
local p, max, holder = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local now = now_ms()
for i = 4, #ARGV do
  redis.call('HSET', p .. ':h', ARGV[i], holder)
  redis.call('ZADD', p .. ':z', now, ARGV[i])
end
local over = redis.call('ZCARD', p .. ':z') - max
while over > 0 do
  local batch = redis.call('ZPOPMIN', p .. ':z', math.min(over, 1000))
  for j = 1, #batch, 2 do redis.call('HDEL', p .. ':h', batch[j]) end
  over = over - #batch / 2
end
return 1
"""

# -- background jobs: NS:job:<id> a hash (replica, owner, view, input, reserved),
#    NS:jobs:lease a sorted set of ids by lease end, NS:jobs:bytes the reserved bytes --------------

# ARGV: ns, id, replica, owner json, view json, input json, reserved, max jobs, max bytes, lease ms.
# 0 admitted, 1 too many jobs, 2 byte budget full.
JOB_ADMIT = LIB + r"""
local ns, id = ARGV[1], ARGV[2]
local leases, bytes = ns .. ':jobs:lease', ns .. ':jobs:bytes'
local reserved = tonumber(ARGV[7])
if redis.call('ZCARD', leases) >= tonumber(ARGV[8]) then return 1 end
if tonumber(redis.call('GET', bytes) or '0') + reserved > tonumber(ARGV[9]) then return 2 end
redis.call('HSET', ns .. ':job:' .. id, 'replica', ARGV[3], 'owner', ARGV[4], 'view', ARGV[5], 'input', ARGV[6], 'reserved', reserved)
redis.call('ZADD', leases, now_ms() + tonumber(ARGV[10]), id)
redis.call('INCRBY', bytes, reserved)
return 0
"""

# ARGV: ns, id, replica. Drops a job that never started (no worker could take it).
JOB_WITHDRAW = LIB + r"""
if redis.call('HGET', ARGV[1] .. ':job:' .. ARGV[2], 'replica') == ARGV[3] then end_job(ARGV[1], ARGV[2]) end
return 1
"""

# ARGV: ns, id, replica, view json. 1 if this replica still owns the job.
JOB_UPDATE = r"""
local job = ARGV[1] .. ':job:' .. ARGV[2]
if redis.call('HGET', job, 'replica') ~= ARGV[3] then return 0 end
redis.call('HSET', job, 'view', ARGV[4])
return 1
"""

# ARGV: ns, id, replica, response prefix, value, size, ttl ms, max entries, max bytes, owner.
# Stores the final object and ends the job in one step; 0 when this replica no longer owns it.
JOB_FINISH = LIB + r"""
local ns, id = ARGV[1], ARGV[2]
if redis.call('HGET', ns .. ':job:' .. id, 'replica') ~= ARGV[3] then return 0 end
end_job(ns, id)
put_value(ARGV[4], id, ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), now_ms(), ARGV[10])
return 1
"""

# ARGV: ns, replica, lease ms, ids... The ids whose lease this replica lost.
JOB_RENEW = LIB + r"""
local ns, replica = ARGV[1], ARGV[2]
local until_ms = now_ms() + tonumber(ARGV[3])
local lost = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  if redis.call('HGET', ns .. ':job:' .. id, 'replica') == replica and redis.call('ZSCORE', ns .. ':jobs:lease', id) then
    redis.call('ZADD', ns .. ':jobs:lease', until_ms, id)
  else
    table.insert(lost, id)
  end
end
return lost
"""

# ARGV: ns, replica, lease ms, limit. Takes over jobs whose lease ended (their replica stopped
# renewing): they are this replica's to end now. The ids taken.
JOB_CLAIM_EXPIRED = LIB + r"""
local ns, replica = ARGV[1], ARGV[2]
local now = now_ms()
local leases = ns .. ':jobs:lease'
local claimed = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, tonumber(ARGV[4]))) do
  if redis.call('EXISTS', ns .. ':job:' .. id) == 1 then
    redis.call('HSET', ns .. ':job:' .. id, 'replica', replica)
    redis.call('ZADD', leases, now + tonumber(ARGV[3]), id)
    table.insert(claimed, id)
  else
    redis.call('ZREM', leases, id)
  end
end
return claimed
"""

# ARGV: ns, id, replica, lease ms. Takes over one job whatever its lease (a cancel its replica
# did not answer). 1 if taken.
JOB_TAKE = LIB + r"""
local ns, id = ARGV[1], ARGV[2]
if redis.call('EXISTS', ns .. ':job:' .. id) == 0 then return 0 end
redis.call('HSET', ns .. ':job:' .. id, 'replica', ARGV[3])
redis.call('ZADD', ns .. ':jobs:lease', 'XX', now_ms() + tonumber(ARGV[4]), id)
return 1
"""

# -- streamed retrieval: NS:ev:<id> a stream whose entry ids are <sequence_number>-1 ------------

# ARGV: stream key, event json without its sequence_number, event type, max events. Appends a
# terminal event after the last one kept (unless one is there already); its sequence number, or -1.
EVENTS_APPEND_TERMINAL = r"""
local key = ARGV[1]
local seq = 0
local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
if #last > 0 then
  local fields = last[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 't' and (fields[i + 1] == 'response.completed' or fields[i + 1] == 'response.incomplete' or fields[i + 1] == 'response.failed') then return -1 end
  end
  seq = tonumber(string.match(last[1][1], '^(%d+)')) + 1
end
local event = string.sub(ARGV[2], 1, -2) .. ',"sequence_number":' .. seq .. '}'
redis.call('XADD', key, 'MAXLEN', tonumber(ARGV[4]), seq .. '-1', 'e', event, 't', ARGV[3])
return seq
"""

# ARGV: stream key prefix (NS:ev:), id, finished set, ttl ms (0: none), max finished, the stream's
# bytes (-1: weigh it here), max bytes of all finished streams, owner ('': none). Keeps the finished
# stream readable a while; the owner's oldest finished streams past its share of either cap are
# dropped, then the heaviest owner's (or, without owners, the oldest) past either cap. Each one's
# weight is in the hash ``<finished>:bytes``, their sum under its field ``#total``; an owner's ids
# are in the sorted set ``<finished>:o:<owner>``, its bytes in ``<finished>:heavy``, each id's owner
# in the hash ``<finished>:own``.
EVENTS_FINISH = LIB + r"""
local prefix, id, finished = ARGV[1], ARGV[2], ARGV[3]
local ttl, max = tonumber(ARGV[4]), tonumber(ARGV[5])
local size, max_bytes = tonumber(ARGV[6]), tonumber(ARGV[7])
local owner = ARGV[8] or ''
local sizes, owners, heavy = finished .. ':bytes', finished .. ':own', finished .. ':heavy'
if size < 0 then
  size = 0
  for _, entry in ipairs(redis.call('XRANGE', prefix .. id, '-', '+')) do size = size + #entry[2][2] end
end
if ttl > 0 then redis.call('PEXPIRE', prefix .. id, ttl) else redis.call('PERSIST', prefix .. id) end
local now = now_ms()
redis.call('ZADD', finished, now, id)
local was = tonumber(redis.call('HGET', sizes, id) or '0')
redis.call('HSET', sizes, id, size)
redis.call('HINCRBY', sizes, '#total', size - was)
if owner ~= '' and not redis.call('HGET', owners, id) then
  redis.call('HSET', owners, id, owner)
  redis.call('ZADD', finished .. ':o:' .. owner, now, id)
  redis.call('ZINCRBY', heavy, size, owner)
end
local function drop(old)
  redis.call('DEL', prefix .. old)
  redis.call('ZREM', finished, old)
  local weight = tonumber(redis.call('HGET', sizes, old) or '0')
  redis.call('HINCRBY', sizes, '#total', -weight)
  redis.call('HDEL', sizes, old)
  local who = redis.call('HGET', owners, old)
  if who then
    redis.call('HDEL', owners, old)
    redis.call('ZREM', finished .. ':o:' .. who, old)
    if redis.call('ZCARD', finished .. ':o:' .. who) == 0 then redis.call('ZREM', heavy, who) else redis.call('ZINCRBY', heavy, -weight, who) end
  end
end
if owner ~= '' then
  local mine = finished .. ':o:' .. owner
  while true do
    local n = redis.call('ZCARD', mine)
    if n <= 1 then break end
    if n <= SHARE * max and tonumber(redis.call('ZSCORE', heavy, owner) or '0') <= SHARE * max_bytes then break end
    drop(redis.call('ZRANGE', mine, 0, 0)[1])
  end
end
local count = redis.call('ZCARD', finished)
while count > 1 and (count > max or tonumber(redis.call('HGET', sizes, '#total') or '0') > max_bytes) do
  local victim = nil
  local heaviest = redis.call('ZREVRANGE', heavy, 0, 0)[1]
  if heaviest then victim = redis.call('ZRANGE', finished .. ':o:' .. heaviest, 0, 0)[1] end
  if not victim then victim = redis.call('ZRANGE', finished, 0, 0)[1] end
  drop(victim)
  count = count - 1
end
return 1
"""
