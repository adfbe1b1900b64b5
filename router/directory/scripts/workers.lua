-- workers: an incarnation publishes where its workers listen, for routers on its host.
-- ARGV: prefix, router id, epoch, lease ms, quiet ms, host, then pairs of a worker
-- reference and '<url> <boot>' ('' withdraws it). Written only while the caller is
-- alive: else the standing alone and nothing is written. `host` names the host (and
-- network) the router runs on: a lookup hands a worker only to a caller with the same
-- (`~host`, a field no reference takes: references never start with '~'). A death
-- certificate deletes the whole hash (common.lua's certify).
local status, router, epoch = caller()
if status ~= 'ok' then return {status} end
local key = workers_key(router, epoch)
redis.call('HSETNX', key, '~host', ARGV[6])  -- unchanged: no invalidation sent
for i = 7, #ARGV - 1, 2 do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', key, ARGV[i])
  else
    redis.call('HSET', key, ARGV[i], ARGV[i + 1])
  end
end
return {'ok'}
