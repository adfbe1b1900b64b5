-- sweep: any router, after its heartbeat, certifies the incarnations whose lease lapsed
-- (outside the fleet's grace) and gives up to `chunk` records of dead incarnations their
-- tombstone TTL, so a router that never comes back leaves nothing forever.
-- ARGV: prefix, lease ms, quiet ms, tombstone ms, chunk. Answers {certified, expired}.
local lease_ms, quiet_ms = tonumber(ARGV[2]), tonumber(ARGV[3])
local tombstone_ms, chunk = tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
local _, grace = fleet_grace(now, lease_ms, quiet_ms)
local certified = 0
if now >= grace then
  local all = redis.call('HGETALL', MEMBERS)
  for i = 1, #all, 2 do
    local epoch, deadline = string.match(all[i + 1], '^(%d+) (%d+) ')
    if tonumber(deadline) < now then
      certify(all[i], epoch, 'lapsed', now, tombstone_ms)
      certified = certified + 1
    end
  end
end
return {certified, reap(chunk, tombstone_ms, nil)}
