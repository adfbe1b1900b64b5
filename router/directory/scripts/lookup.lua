-- lookup: owner records and their owners' liveness, for a batch of keys, in one call.
-- KEYS: the owner records. ARGV: prefix, lease ms, quiet ms, host ('' for none).
-- Answers now, since, grace, then per key: code, router, epoch, peer, lease left and
-- worker, with code 'a' (absent), 'h' (held by a live incarnation, or by the live one
-- that replaced a restarted holder: it names that one), 'e' (ended), 'x' (held by a dead
-- one). The lease left (ms, '' but for 'h') is how long the holder's lease runs from now: a router may
-- keep a held answer that long (0 within a grace that keeps a lapsed lease alive). The
-- worker ('<url> <boot>', else '') is given only for 'h' of the very incarnation the
-- record names (not a successor's: its workers are other processes), whose workers
-- script published that worker under the caller's `host`: the caller may then forward
-- to it straight (shape B).
local host = ARGV[4]
local lease_ms, quiet_ms = tonumber(ARGV[2]), tonumber(ARGV[3])
local direct = host ~= nil and host ~= ''
local now = now_ms()
local since, grace = fleet_grace(now, lease_ms, quiet_ms)
local seen = {}
local out = {now, since, grace}
for _, k in ipairs(KEYS) do
  local o = redis.call('HMGET', k, 'r', 'e', 's', 'w')
  if not o[1] then
    out[#out + 1] = 'a'; out[#out + 1] = ''; out[#out + 1] = ''; out[#out + 1] = ''
    out[#out + 1] = ''; out[#out + 1] = ''
  elseif o[3] == 'e' then
    out[#out + 1] = 'e'; out[#out + 1] = o[1]; out[#out + 1] = o[2]; out[#out + 1] = ''
    out[#out + 1] = ''; out[#out + 1] = ''
  else
    local holder = o[1] .. ':' .. o[2]
    local peer = seen[holder]
    if peer == nil then
      local status, address, deadline = standing(o[1], o[2], now, grace)
      if status == 'ok' then
        peer = {o[2], address, deadline}
      else
        local epoch, successor_peer, successor_deadline = successor(o[1], o[2], now, grace)
        peer = epoch and {tostring(epoch), successor_peer, successor_deadline} or false
      end
      seen[holder] = peer
    end
    out[#out + 1] = peer and 'h' or 'x'; out[#out + 1] = o[1]
    out[#out + 1] = peer and peer[1] or o[2]
    out[#out + 1] = peer and peer[2] or ''
    out[#out + 1] = peer and math.max(peer[3] - now, 0) or ''
    local worker = ''
    if direct and peer and o[4] and peer[1] == o[2] then
      local w = redis.call('HMGET', workers_key(o[1], o[2]), '~host', o[4])
      if w[1] == host and w[2] then worker = w[2] end
    end
    out[#out + 1] = worker
  end
end
return out
