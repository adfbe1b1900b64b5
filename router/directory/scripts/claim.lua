-- claim: write owner records for a batch of keys.
-- KEYS: the owner records. ARGV: prefix, router id, epoch, lease ms, quiet ms.
-- Acknowledged only if the caller's epoch is current and its lease alive: else the
-- standing alone ('fenced' or 'lost') and nothing is written. Per key: 'ok' (written,
-- or already ours), 'conflict' with the holder (another live incarnation holds it),
-- 'ended' or 'worker_exited' (its record ended, or its holder is dead: an episode once
-- answered 410 never comes back while the record lives, its tombstone TTL). A key an
-- earlier incarnation of the caller held when this one replaced it is claimed back.
local router, epoch = ARGV[2], ARGV[3]
local lease_ms, quiet_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
local _, grace = fleet_grace(now, lease_ms, quiet_ms)
local status = standing(router, epoch, now, grace)
if status ~= 'ok' then return {status} end
local held = held_key(router, epoch)
local alive = {}
local out = {'ok'}
for _, k in ipairs(KEYS) do
  local o = redis.call('HMGET', k, 'r', 'e', 's')
  if not o[1] then
    redis.call('HSET', k, 'r', router, 'e', epoch, 's', 'h')
    redis.call('SADD', held, k)
    out[#out + 1] = 'ok'; out[#out + 1] = ''
  elseif o[3] == 'e' then
    out[#out + 1] = 'ended'; out[#out + 1] = ''
  elseif o[1] == router and o[2] == epoch then
    out[#out + 1] = 'ok'; out[#out + 1] = ''
  else
    local holder = o[1] .. ':' .. o[2]
    if alive[holder] == nil then alive[holder] = standing(o[1], o[2], now, grace) == 'ok' end
    if alive[holder] then
      out[#out + 1] = 'conflict'; out[#out + 1] = o[1]
    elseif o[1] == router and successor(o[1], o[2], now, grace) == tonumber(epoch) then
      -- This router's incarnation that restarted took it over: claimed back, and kept
      -- (the reaping of the replaced incarnation may have given it a TTL already).
      redis.call('HSET', k, 'e', epoch)
      redis.call('PERSIST', k)
      redis.call('SADD', held, k)
      out[#out + 1] = 'ok'; out[#out + 1] = ''
    else
      out[#out + 1] = 'worker_exited'; out[#out + 1] = ''
    end
  end
end
return out
