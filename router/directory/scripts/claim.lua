-- claim: write owner records for a batch of keys.
-- KEYS: the owner records. ARGV: prefix, router id, epoch, lease ms, quiet ms, then a
-- worker reference per key ('' for none): the record names the worker process that holds
-- the key (`w`), which a router on the same host may forward to straight (the workers
-- script publishes where it listens).
-- Acknowledged only if the caller's epoch is current and its lease alive: else the
-- standing alone ('fenced' or 'lost') and nothing is written. Per key: 'ok' (written,
-- or already ours), 'conflict' with the holder (another live incarnation holds it),
-- 'ended' or 'worker_exited' (its record ended, or its holder is dead: an episode once
-- answered 410 never comes back while the record lives, its tombstone TTL). A key an
-- earlier incarnation of the caller held when this one replaced it is claimed back.
local status, router, epoch, now, grace = caller()
if status ~= 'ok' then return {status} end
local held = held_key(router, epoch)
local alive = {}
local out = {'ok'}
for i, k in ipairs(KEYS) do
  local w = ARGV[5 + i]
  local o = redis.call('HMGET', k, 'r', 'e', 's')
  if not o[1] then
    if w ~= '' then
      redis.call('HSET', k, 'r', router, 'e', epoch, 's', 'h', 'w', w)
    else
      redis.call('HSET', k, 'r', router, 'e', epoch, 's', 'h')
    end
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
      if w ~= '' then redis.call('HSET', k, 'w', w) else redis.call('HDEL', k, 'w') end
      redis.call('PERSIST', k)
      redis.call('SADD', held, k)
      out[#out + 1] = 'ok'; out[#out + 1] = ''
    else
      out[#out + 1] = 'worker_exited'; out[#out + 1] = ''
    end
  end
end
return out
