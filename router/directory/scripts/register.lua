-- register: a router starts a new incarnation.
-- ARGV: prefix, router id, peer address, lease ms, quiet ms, tombstone ms.
-- The epoch counter only grows; a missing one (a directory that lost its data) starts
-- from the directory's clock, so an epoch is never handed out twice. The incarnation
-- it replaces is certified dead: 'replaced' while its lease was alive (a restart: its
-- keys are the new incarnation's to claim back), 'lapsed' once it had lapsed (anyone may
-- have answered 410 for them already). Answers epoch, deadline, now, since, grace.
local router, peer = ARGV[2], ARGV[3]
local lease_ms, quiet_ms, tombstone_ms = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_ms()
local since, grace = fleet_grace(now, lease_ms, quiet_ms)
local counter = P .. ':epoch:' .. router
redis.call('SET', counter, now, 'NX')
local epoch = redis.call('INCR', counter)
local previous, deadline = member(router)
if previous then
  local alive = deadline >= now or now < grace
  certify(router, previous, alive and 'replaced' or 'lapsed', now, tombstone_ms)
end
write_member(router, epoch, now + lease_ms, peer)
beat(now)
return {epoch, now + lease_ms, now, since, grace}
