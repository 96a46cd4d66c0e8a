"""Lua scripts behind the catalog's atomic writes: each runs as one step inside Redis, so a reader never sees
half a registration and two writers racing on one name get distinct versions.

Key layout under the namespace NS (CatalogConnection._k in conn.py): NS:adapters (set of names),
NS:adapter:<name> (hash: 'latest', 'pinned', 'v:<n>' -> record JSON), NS:versions (hash name -> last version
ever issued, kept after removal so a re-created name never reuses a version a replica may still cache),
NS:tenants (hash name -> JSON), NS:apikeys (hash sha256(key) -> tenant), NS:replicas (zset id -> expiry ms, server clock),
NS:replica:<id> (JSON, PX ttl), NS:resident:<id> (set), NS:placement:<adapter> (set of replica ids).
The placement scripts build key names inside Lua, which is fine on one Redis (not on Redis Cluster). The quota
scripts, registered on first use by app/catalog/quotas.py, are app/catalog/quota_lua.py.
"""

REGISTER = """
-- KEYS: adapter hash, names set, versions hash, tenants hash; ARGV: name, body JSON (no version), channel, tenant,
-- '1' to stage the version (stored but not yet the newest: PROMOTE makes it so), versions to keep (0: all).
if ARGV[4] ~= '' and redis.call('HEXISTS', KEYS[4], ARGV[4]) == 0 then
  return redis.error_reply('LL_UNKNOWN_TENANT')
end
local v = redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
local latest = tonumber(redis.call('HGET', KEYS[1], 'latest') or '0')
if v <= latest then  -- the counter was lost (e.g. a partial restore): never reuse a live version
  v = latest + 1
  redis.call('HSET', KEYS[3], ARGV[1], v)
end
local body = string.sub(ARGV[2], 1, -2) .. ',"version":' .. v .. '}'
redis.call('HSET', KEYS[1], 'v:' .. v, body)
local kind = 'staged'
if ARGV[5] ~= '1' then
  redis.call('HSET', KEYS[1], 'latest', v)
  latest, kind = v, 'registered'
end
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('PUBLISH', ARGV[3], cjson.encode({type = kind, name = ARGV[1], version = v}))
-- Bounded history: the newest ARGV[6] versions stay, and the newest promoted one whatever its age.
local keep = tonumber(ARGV[6])
if keep > 0 then
  local vs, dropped = {}, {}
  for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.sub(f, 1, 2) == 'v:' then table.insert(vs, tonumber(string.sub(f, 3))) end
  end
  table.sort(vs)
  for i = 1, #vs - keep do
    if vs[i] ~= latest then
      redis.call('HDEL', KEYS[1], 'v:' .. vs[i])
      table.insert(dropped, vs[i])
    end
  end
  if #dropped > 0 then
    redis.call('PUBLISH', ARGV[3], cjson.encode({type = 'removed', name = ARGV[1], versions = dropped}))
  end
end
return v
"""

PROMOTE = """
-- KEYS: adapter hash; ARGV: name, version, channel. Makes a staged version the newest unless a newer one is.
-- Returns 1 (it is the newest), 0 (a newer version is), -1 (the version is gone).
if redis.call('HEXISTS', KEYS[1], 'v:' .. ARGV[2]) == 0 then return -1 end
local v = tonumber(ARGV[2])
local latest = tonumber(redis.call('HGET', KEYS[1], 'latest') or '0')
if v < latest then return 0 end
if v > latest then
  redis.call('HSET', KEYS[1], 'latest', v)
  redis.call('PUBLISH', ARGV[3], cjson.encode({type = 'registered', name = ARGV[1], version = v}))
end
return 1
"""

GET = """
-- KEYS: adapter hash; ARGV: version or '' for the newest. Returns {body, pinned} or nil.
local v = ARGV[1]
if v == '' then
  v = redis.call('HGET', KEYS[1], 'latest')
  if not v then return nil end
end
local body = redis.call('HGET', KEYS[1], 'v:' .. v)
if not body then return nil end
return {body, redis.call('HGET', KEYS[1], 'pinned') or '0'}
"""

REMOVE = """
-- KEYS: adapter hash, names set; ARGV: name, version or '' for all, channel. Returns versions removed.
local function versions()
  local vs = {}
  for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.sub(f, 1, 2) == 'v:' then table.insert(vs, tonumber(string.sub(f, 3))) end
  end
  table.sort(vs)
  return vs
end
local removed
if ARGV[2] == '' then
  removed = versions()
  if #removed == 0 then return 0 end
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[1])
else
  if redis.call('HDEL', KEYS[1], 'v:' .. ARGV[2]) == 0 then return 0 end
  removed = {tonumber(ARGV[2])}
  if redis.call('HGET', KEYS[1], 'latest') == ARGV[2] then
    local left = versions()
    if #left == 0 then
      redis.call('DEL', KEYS[1])
      redis.call('SREM', KEYS[2], ARGV[1])
    else
      redis.call('HSET', KEYS[1], 'latest', left[#left])
    end
  end
end
local event = {type = 'removed', name = ARGV[1], versions = removed}
if ARGV[2] ~= '' then event.version = removed[1] end
redis.call('PUBLISH', ARGV[3], cjson.encode(event))
return #removed
"""

PIN = """
-- KEYS: adapter hash; ARGV: name, '1'|'0', channel. Returns the newest version, or -1 if the name is unknown.
local latest = redis.call('HGET', KEYS[1], 'latest')
if not latest then return -1 end
redis.call('HSET', KEYS[1], 'pinned', ARGV[2])
redis.call('PUBLISH', ARGV[3],
  cjson.encode({type = 'pinned', name = ARGV[1], version = tonumber(latest), pinned = ARGV[2] == '1'}))
return tonumber(latest)
"""

CREATE_TENANT = """
-- KEYS: tenants hash, apikeys hash; ARGV: name, tenant JSON, key hash. Returns 0 if the tenant exists.
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[3], ARGV[1])
return 1
"""

ROTATE_KEY = """
-- KEYS: tenants hash, apikeys hash; ARGV: name, new key hash, new key hint, now, channel. 0 if unknown tenant.
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local t = cjson.decode(raw)
if t.key_hash then redis.call('HDEL', KEYS[2], t.key_hash) end
t.key_hash = ARGV[2]
t.key_hint = ARGV[3]
t.rotated = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(t))
redis.call('HSET', KEYS[2], ARGV[2], ARGV[1])
redis.call('PUBLISH', ARGV[5], cjson.encode({type = 'key_rotated', tenant = ARGV[1]}))
return 1
"""

SET_TENANT_WEIGHT = """
-- KEYS: tenants hash; ARGV: name, weight (a number; 'none' removes it). 0 if unknown tenant.
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local t = cjson.decode(raw)
if ARGV[2] == 'none' then t.weight = nil else t.weight = tonumber(ARGV[2]) end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(t))
return 1
"""

# Shared by the placement scripts: server-clock milliseconds, and forgetting a replica everywhere.
_PLACEMENT_LIB = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function forget(ns, id)
  local res = ns .. ':resident:' .. id
  for _, a in ipairs(redis.call('SMEMBERS', res)) do redis.call('SREM', ns .. ':placement:' .. a, id) end
  redis.call('DEL', res, ns .. ':replica:' .. id)
  redis.call('ZREM', ns .. ':replicas', id)
end
local function reap(ns, now)
  local dead = redis.call('ZRANGEBYSCORE', ns .. ':replicas', '-inf', now)
  for _, id in ipairs(dead) do forget(ns, id) end
end
"""

HEARTBEAT = (
    _PLACEMENT_LIB
    + """
-- ARGV: ns, replica id, info JSON (no heartbeat), ttl ms, resident adapters...
local ns, id, ttl = ARGV[1], ARGV[2], tonumber(ARGV[4])
local now = now_ms()
reap(ns, now)
local res = ns .. ':resident:' .. id
local new, old = {}, {}
for i = 5, #ARGV do new[ARGV[i]] = true end
for _, a in ipairs(redis.call('SMEMBERS', res)) do
  old[a] = true
  if not new[a] then
    redis.call('SREM', ns .. ':placement:' .. a, id)
    redis.call('SREM', res, a)
  end
end
for i = 5, #ARGV do
  if not old[ARGV[i]] then
    redis.call('SADD', ns .. ':placement:' .. ARGV[i], id)
    redis.call('SADD', res, ARGV[i])
  end
end
local body = string.sub(ARGV[3], 1, -2) .. ',"heartbeat":' .. string.format('%.3f', now / 1000) .. '}'
redis.call('SET', ns .. ':replica:' .. id, body, 'PX', ttl)
redis.call('ZADD', ns .. ':replicas', now + ttl, id)
return now
"""
)

REPLICAS = (
    _PLACEMENT_LIB
    + """
-- ARGV: ns. Reaps expired replicas, returns {id, info JSON, ...} for the live ones.
local ns = ARGV[1]
reap(ns, now_ms())
local out = {}
for _, id in ipairs(redis.call('ZRANGE', ns .. ':replicas', 0, -1)) do
  local body = redis.call('GET', ns .. ':replica:' .. id)
  if body then
    table.insert(out, id)
    table.insert(out, body)
  end
end
return out
"""
)

PLACEMENT = (
    _PLACEMENT_LIB
    + """
-- KEYS: placement set of one adapter, replicas zset. Returns the live replica ids holding it (read-only).
local now = now_ms()
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local exp = redis.call('ZSCORE', KEYS[2], id)
  if exp and tonumber(exp) > now then table.insert(out, id) end
end
return out
"""
)

DROP_REPLICA = (
    _PLACEMENT_LIB
    + """
-- ARGV: ns, replica id
forget(ARGV[1], ARGV[2])
return 1
"""
)
