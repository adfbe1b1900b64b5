-- Shared by every directory script: the loader puts this text in front of each one.
-- ARGV[1] is always the fleet's prefix with its hash tag ('{episode-router}'); the
-- scripts name the fleet's own keys from it (one hash slot: see keys.py). Every time is
-- the directory's own, in milliseconds, from TIME: never a router's clock.

local P = ARGV[1]
local FLEET = P .. ':fleet'
local MEMBERS = P .. ':members'
local REAP = P .. ':reap'

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function death_key(router, epoch) return P .. ':dead:' .. router .. ':' .. epoch end
local function held_key(router, epoch) return P .. ':held:' .. router .. ':' .. epoch end
local function workers_key(router, epoch) return P .. ':workers:' .. router .. ':' .. epoch end

-- The fleet record, created when missing (first start, or a directory that lost its
-- data), and the end of its grace. No lapsed lease counts as dead before the grace ends:
-- after a spell in which no router's heartbeat arrived (an outage, a paused Redis), or a
-- loss of data, every router gets one whole lease to check in. Returns since, grace.
local function fleet_grace(now, lease_ms, quiet_ms)
  local f = redis.call('HMGET', FLEET, 'since', 'beat', 'grace')
  if not f[1] then
    redis.call('HSET', FLEET, 'since', now, 'beat', now, 'grace', now + lease_ms)
    return now, now + lease_ms
  end
  local since, beat, grace = tonumber(f[1]), tonumber(f[2]), tonumber(f[3])
  if now - beat > quiet_ms and grace < now + lease_ms then
    grace = now + lease_ms
    redis.call('HSET', FLEET, 'grace', grace)
  end
  return since, grace
end

local function beat(now) redis.call('HSET', FLEET, 'beat', now) end

-- A membership record: '<epoch> <lease deadline> <peer address>'.
local function member(router)
  local m = redis.call('HGET', MEMBERS, router)
  if not m then return nil end
  local epoch, deadline, peer = string.match(m, '^(%d+) (%d+) (.*)$')
  return tonumber(epoch), tonumber(deadline), peer
end

local function write_member(router, epoch, deadline, peer)
  redis.call('HSET', MEMBERS, router, string.format('%d %d %s', epoch, deadline, peer))
end

-- An incarnation's standing: 'ok' (current epoch, lease alive or lapsed within the
-- grace), 'fenced' (a certificate, a newer epoch, a lapsed lease), or 'lost' (neither a
-- membership nor a certificate: the directory forgot it). Also its peer address and
-- lease deadline when 'ok'.
local function standing(router, epoch, now, grace)
  if redis.call('EXISTS', death_key(router, epoch)) == 1 then return 'fenced' end
  local current, deadline, peer = member(router)
  if not current then return 'lost' end
  if current ~= tonumber(epoch) then return 'fenced' end
  if deadline < now and now >= grace then return 'fenced' end
  return 'ok', peer, deadline
end

-- The caller of a write script, whose ARGV[2..5] are its router id, epoch, lease ms and
-- quiet ms: its standing (below), its id and epoch, the directory's now, and the end of
-- the fleet's grace. A write script writes nothing unless the standing is 'ok'.
local function caller()
  local router, epoch = ARGV[2], ARGV[3]
  local now = now_ms()
  local _, grace = fleet_grace(now, tonumber(ARGV[4]), tonumber(ARGV[5]))
  return standing(router, epoch, now, grace), router, epoch, now, grace
end

-- Certify an incarnation dead (the first reason stays), drop its membership if it is
-- still the current one, and queue its held records for their tombstone TTL.
local function certify(router, epoch, reason, now, tombstone_ms)
  redis.call('SET', death_key(router, epoch), reason .. ' ' .. now, 'NX', 'PX', tombstone_ms)
  local current = member(router)
  if current == tonumber(epoch) then redis.call('HDEL', MEMBERS, router) end
  redis.call('DEL', workers_key(router, epoch))  -- no direct hop to a dead one's workers
  redis.call('SADD', REAP, router .. ':' .. epoch)
end

-- Give up to `budget` held records of queued dead incarnations their tombstone TTL (they
-- stay, answering 'dead', until it runs out). Returns how many it did.
local function reap(budget, tombstone_ms, only)
  local done = 0
  local queued = only and {only} or redis.call('SMEMBERS', REAP)
  for _, incarnation in ipairs(queued) do
    if done >= budget then break end
    local router, epoch = string.match(incarnation, '^(.*):(%d+)$')
    local held = held_key(router, epoch)
    local keys = redis.call('SPOP', held, budget - done)
    for _, k in ipairs(keys) do
      local o = redis.call('HMGET', k, 'r', 'e', 's')
      if o[1] == router and o[2] == epoch and o[3] == 'h' then
        redis.call('PEXPIRE', k, tombstone_ms)
      end
    end
    done = done + #keys
    if redis.call('SCARD', held) == 0 then redis.call('SREM', REAP, incarnation) end
  end
  return done
end

-- The incarnation that took over from (router, epoch): one that replaced it while its
-- lease was alive (a restart, not a death anyone was told of) and is alive itself.
-- Its keys are that successor's to claim back (section 3's restart rules hold for each
-- router), so a lookup names the successor, never a 410. Returns its epoch, peer and lease
-- deadline, or nil.
local function successor(router, epoch, now, grace)
  local certificate = redis.call('GET', death_key(router, epoch))
  if not certificate or string.sub(certificate, 1, 9) ~= 'replaced ' then return nil end
  local current = member(router)
  if not current or current == tonumber(epoch) then return nil end
  local status, peer, deadline = standing(router, current, now, grace)
  if status ~= 'ok' then return nil end
  return current, peer, deadline
end
