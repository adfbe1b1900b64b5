-- retire: a router's death certificate, written by itself (SIGTERM, or once fenced).
-- ARGV: prefix, router id, epoch, tombstone ms, chunk, reason.
-- Its held records answer 'dead' from now on, and get their tombstone TTL `chunk` at a
-- time: the answer is how many still wait (call again until 0).
local router, epoch = ARGV[2], ARGV[3]
local tombstone_ms, chunk, reason = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local now = now_ms()
certify(router, epoch, reason, now, tombstone_ms)
reap(chunk, tombstone_ms, router .. ':' .. epoch)
return redis.call('SCARD', held_key(router, epoch))
