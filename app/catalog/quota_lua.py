"""Lua scripts behind the catalog's quotas (app/catalog/quotas.py): admission charges every bucket a request
touches in one step inside Redis, on the Redis clock, so any number of ingress replicas share one limit. The
registry, tenant and placement scripts are app/catalog/lua.py.
"""

# Quotas (app/catalog/quotas.py). NS:quotas is a hash scope id ('tenant:<name>' | 'adapter:<name>') -> JSON with
# any of concurrent, requests_per_minute, tokens_per_minute. Per scope: a requests and a tokens bucket (hashes
# {tokens, ts}: the level at server time ts ms; refill limit/60000 per ms up to limit, so a full minute's worth
# may burst; a missing key is a full bucket, hence the expiries) and a concurrency zset (lease id -> expiry ms).
# KEYS for scope i (1-based): KEYS[3i-1] requests bucket, KEYS[3i] tokens bucket, KEYS[3i+1] leases; KEYS[1]
# is NS:quotas.
_QUOTA_LIB = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function level(key, limit)
  local h = redis.call('HMGET', key, 'tokens', 'ts')
  if not h[1] then return limit end
  return math.min(limit, tonumber(h[1]) + math.max(0, now - tonumber(h[2])) * limit / 60000)
end
local function store(key, tokens, limit)
  redis.call('HSET', key, 'tokens', tokens, 'ts', now)
  -- expires once full again: a missing bucket reads as full
  redis.call('PEXPIRE', key, math.ceil((limit - tokens) * 60000 / limit) + 1000)
end
local function limit_of(q, name)
  local v = q[name]
  if type(v) == 'number' and v > 0 then return v end
  return nil
end
"""

QUOTA_ADMIT = (
    _QUOTA_LIB
    + """
-- ARGV: lease id, lease ttl ms, tokens to reserve, scope ids... All buckets pass and are charged, or none is.
-- Returns {status, wait ms, scope index, limit name, limit, quota JSON or '' per scope...}: status 1 admitted,
-- 0 refused (the limit with the longest wait is named), -1 the tokens exceed a whole minute's quota.
local lease, ttl, cost = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local raws, writes, leases = {}, {}, {}
local status, worst = 1, {0, 0, '', 0}
for i = 4, #ARGV do
  local s = i - 3
  local k = 3 * s - 1
  local raw = redis.call('HGET', KEYS[1], ARGV[i])
  raws[s] = raw or ''
  if raw then
    local q = cjson.decode(raw)
    for _, b in ipairs({{'requests_per_minute', KEYS[k], 1}, {'tokens_per_minute', KEYS[k + 1], cost}}) do
      local limit = limit_of(q, b[1])
      if limit and status ~= -1 then
        if b[3] > limit then
          status, worst = -1, {0, s, b[1], limit}
        else
          local have = level(b[2], limit)
          if have >= b[3] then
            table.insert(writes, {b[2], have - b[3], limit})
          else
            local wait = math.ceil((b[3] - have) * 60000 / limit)
            if status == 1 or wait > worst[1] then worst = {wait, s, b[1], limit} end
            status = 0
          end
        end
      end
    end
    local c = limit_of(q, 'concurrent')
    if c and status ~= -1 then
      redis.call('ZREMRANGEBYSCORE', KEYS[k + 2], '-inf', now)  -- leases of crashed ingresses run out
      if redis.call('ZCARD', KEYS[k + 2]) >= c then
        -- a slot frees when some request ends, which the bucket cannot foresee: suggest a second
        if status == 1 or 1000 > worst[1] then worst = {1000, s, 'concurrent', c} end
        status = 0
      else
        table.insert(leases, KEYS[k + 2])
      end
    end
  end
end
if status == 1 then
  for _, w in ipairs(writes) do store(w[1], w[2], w[3]) end
  for _, key in ipairs(leases) do
    redis.call('ZADD', key, now + ttl, lease)
    redis.call('PEXPIRE', key, ttl + 1000)
  end
end
local out = {status, worst[1], worst[2], worst[3], worst[4]}
for _, raw in ipairs(raws) do table.insert(out, raw) end
return out
"""
)

QUOTA_SETTLE = (
    _QUOTA_LIB
    + """
-- ARGV: lease id, tokens to give back (reserved - used; negative charges the excess), scope ids...
local lease, back = ARGV[1], tonumber(ARGV[2])
for i = 3, #ARGV do
  local s = i - 2
  local k = 3 * s - 1
  redis.call('ZREM', KEYS[k + 2], lease)
  local raw = redis.call('HGET', KEYS[1], ARGV[i])
  if raw and back ~= 0 then
    local limit = limit_of(cjson.decode(raw), 'tokens_per_minute')
    if limit then store(KEYS[k + 1], math.min(limit, level(KEYS[k + 1], limit) + back), limit) end
  end
end
return 1
"""
)

QUOTA_RENEW = """
-- KEYS: lease zsets; ARGV: ttl ms, then the lease id held in each key. Extends leases still held; returns how many.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl, n = tonumber(ARGV[1]), 0
for i, key in ipairs(KEYS) do
  n = n + redis.call('ZADD', key, 'XX', 'CH', now + ttl, ARGV[i + 1])
  redis.call('PEXPIRE', key, ttl + 1000)
end
return n
"""

QUOTA_SET = """
-- KEYS: quotas hash, the owner's container (tenants hash or adapter names set); ARGV: scope id, owner name,
-- 'hash'|'set', 'replace'|'merge', then limit name, value ('' removes it) pairs. Returns the JSON stored, ''
-- when no limit is left (the quota is removed), or an error when the owner does not exist.
local exists
if ARGV[3] == 'hash' then exists = redis.call('HEXISTS', KEYS[2], ARGV[2])
else exists = redis.call('SISMEMBER', KEYS[2], ARGV[2]) end
if exists == 0 then return redis.error_reply('LL_UNKNOWN_OWNER') end
local q = {}
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw and ARGV[4] == 'merge' then q = cjson.decode(raw) end
for i = 5, #ARGV, 2 do
  if ARGV[i + 1] == '' then q[ARGV[i]] = nil else q[ARGV[i]] = tonumber(ARGV[i + 1]) end
end
if next(q) == nil then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return ''
end
local body = cjson.encode(q)
redis.call('HSET', KEYS[1], ARGV[1], body)
return body
"""
