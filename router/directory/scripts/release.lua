-- release: mark the caller's owner records ended; they stay for the tombstone TTL.
-- KEYS: the owner records. ARGV: prefix, router id, epoch, lease ms, quiet ms, tombstone ms.
-- The standing alone when not 'ok'. Per key: 'ok' (ended now, already ended, or never
-- recorded), 'not_holder' (another incarnation holds it).
local status, router, epoch = caller()
if status ~= 'ok' then return {status} end
local tombstone_ms = tonumber(ARGV[6])
local held = held_key(router, epoch)
local out = {'ok'}
for _, k in ipairs(KEYS) do
  local o = redis.call('HMGET', k, 'r', 'e', 's')
  if not o[1] or o[3] == 'e' then
    out[#out + 1] = 'ok'
  elseif o[1] == router and o[2] == epoch then
    redis.call('HSET', k, 's', 'e')
    redis.call('PEXPIRE', k, tombstone_ms)
    redis.call('SREM', held, k)
    out[#out + 1] = 'ok'
  else
    out[#out + 1] = 'not_holder'
  end
end
return out
