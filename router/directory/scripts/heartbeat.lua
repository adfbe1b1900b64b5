-- heartbeat: extend a router's lease, only for its current epoch.
-- ARGV: prefix, router id, epoch, lease ms, quiet ms.
-- Answers 'ok' with the new deadline; 'fenced' when the epoch is stale, certified dead or
-- its lease lapsed (outside the fleet's grace): the router must retire and register
-- again; 'lost' when the directory has no record of it at all.
local router, epoch = ARGV[2], ARGV[3]
local lease_ms, quiet_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
local _, grace = fleet_grace(now, lease_ms, quiet_ms)
local status, peer = standing(router, epoch, now, grace)
if status ~= 'ok' then return {status, 0, now} end
write_member(router, tonumber(epoch), now + lease_ms, peer)
beat(now)
return {'ok', now + lease_ms, now}
