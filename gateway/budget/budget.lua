-- Atomic budget reserve/settle over every scope x window of one request (one EVALSHA each).
-- Mirrors gateway/budget/model.py BudgetState exactly; see that module for the semantics.
-- KEYS: per scope: hold zset (rid by expiry), hold hash (rid -> "tokens:money" or "tokens:money:gpu",
--       _t/_m/_g totals),
--       then one counter key per window of that scope.
--       settle only: a last key, the request's idempotency marker (when ARGV has dx).
-- ARGV[1]: JSON plan (ReserveArgs.to_wire / SettleArgs.to_wire). Money is integer nano-units, GPU-seconds
--          integer micro-GPU-seconds. A hold without GPU-seconds keeps the two-part value older scripts read.
local p = cjson.decode(ARGV[1])
local now = p.now
local ki = 1

local function I(x) return string.format('%d', x) end

-- a hold's amounts: "t:m" or "t:m:g"
local function amounts(v)
  local a = {}
  for x in string.gmatch(v, '[^:]+') do a[#a + 1] = tonumber(x) end
  return a[1], a[2], a[3] or 0
end

-- take a hold's amounts off the hash totals and drop it
local function unhold(h, rid, v)
  local t, m, g = amounts(v)
  redis.call('HINCRBY', h, '_t', I(-t))
  redis.call('HINCRBY', h, '_m', I(-m))
  if g ~= 0 then redis.call('HINCRBY', h, '_g', I(-g)) end
  redis.call('HDEL', h, rid)
end

local function purge(z, h)
  local exp = redis.call('ZRANGEBYSCORE', z, '-inf', now)
  for _, rid in ipairs(exp) do
    local v = redis.call('HGET', h, rid)
    if v then unhold(h, rid, v) end
  end
  if #exp > 0 then redis.call('ZREMRANGEBYSCORE', z, '-inf', now) end
end

-- evict buckets that left the window; return lo (oldest bucket that may hold data)
local function advance(k, now_b, n)
  local lo = tonumber(redis.call('HGET', k, 'lo'))
  if not lo then
    redis.call('HSET', k, 'lo', I(now_b))
    return now_b
  end
  local floor_b = now_b - n
  if floor_b - lo >= n then
    redis.call('DEL', k)
    redis.call('HSET', k, 'lo', I(now_b))
    return now_b
  end
  local b = lo
  while b <= floor_b do
    local v = redis.call('HMGET', k, 'r' .. b, 't' .. b, 'm' .. b, 'g' .. b)
    if v[1] then
      if v[1] ~= '0' then redis.call('HINCRBY', k, 'R', '-' .. v[1]) end
      if v[2] and v[2] ~= '0' then redis.call('HINCRBY', k, 'T', I(-tonumber(v[2]))) end
      if v[3] and v[3] ~= '0' then redis.call('HINCRBY', k, 'M', I(-tonumber(v[3]))) end
      if v[4] and v[4] ~= '0' then redis.call('HINCRBY', k, 'G', I(-tonumber(v[4]))) end
      redis.call('HDEL', k, 'r' .. b, 't' .. b, 'm' .. b, 'g' .. b)
    end
    b = b + 1
  end
  while b < now_b and redis.call('HEXISTS', k, 'r' .. b) == 0 do b = b + 1 end
  if b ~= lo then redis.call('HSET', k, 'lo', I(b)) end
  return b
end

-- add to a counter; `lo` (optional) is the window's oldest bucket from an advance earlier in this call
local function add(k, w, r, t, m, g, lo)
  if w.n then
    if not lo then lo = advance(k, w.b, w.n) end
    local b = w.b
    if lo > b then b = lo end
    if r ~= 0 then redis.call('HINCRBY', k, 'r' .. b, I(r)) else redis.call('HSETNX', k, 'r' .. b, '0') end
    if t ~= 0 then redis.call('HINCRBY', k, 't' .. b, I(t)) end
    if m ~= 0 then redis.call('HINCRBY', k, 'm' .. b, I(m)) end
    if g ~= 0 then redis.call('HINCRBY', k, 'g' .. b, I(g)) end
  end
  if r ~= 0 then redis.call('HINCRBY', k, 'R', I(r)) end
  if t ~= 0 then redis.call('HINCRBY', k, 'T', I(t)) end
  if m ~= 0 then redis.call('HINCRBY', k, 'M', I(m)) end
  if g ~= 0 then redis.call('HINCRBY', k, 'G', I(g)) end
  if w.x then redis.call('EXPIRE', k, I(w.x)) end
end

if p.op == 'r' then
  local out = {}
  local ok, c, fs, fw, fk = 1, p.maxc, 0, 0, ''
  local cs, cw, ck = 0, 0, ''
  local los = {}
  for si, s in ipairs(p.s) do
    local z, h = KEYS[ki], KEYS[ki + 1]
    ki = ki + 2
    purge(z, h)
    local hv = redis.call('HMGET', h, '_t', '_m', '_g')
    local ht, hm, hg = tonumber(hv[1]) or 0, tonumber(hv[2]) or 0, tonumber(hv[3]) or 0
    local nh = redis.call('ZCARD', z)
    out[#out + 1] = ht
    out[#out + 1] = hm
    out[#out + 1] = nh
    out[#out + 1] = hg
    if s.c and nh + 1 > s.c and ok == 1 then ok, fs, fw, fk = 0, si, 0, 'concurrency' end
    for wi, w in ipairs(s.w) do
      local k = KEYS[ki]
      ki = ki + 1
      local old = 0
      if w.n then
        local lo = advance(k, w.b, w.n)
        los[k] = lo
        if redis.call('HEXISTS', k, 'r' .. lo) == 1 then old = lo else old = w.b end
      end
      local v = redis.call('HMGET', k, 'R', 'T', 'M', 'G')
      local R, T, M, G = tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0, tonumber(v[4]) or 0
      out[#out + 1] = R
      out[#out + 1] = T
      out[#out + 1] = M
      out[#out + 1] = old
      out[#out + 1] = G
      if ok == 1 then
        if w.r and R + 1 > w.r then
          ok, fs, fw, fk = 0, si, wi, 'requests'
        else
          if w.t then
            local cap = w.t - T - ht - p.ft
            if cap < c then c, cs, cw, ck = cap, si, wi, 'tokens' end
          end
          if w.m then
            local room = w.m - M - hm - p.fm
            local cap
            if p.pm > 0 then cap = math.floor(room / p.pm) elseif room >= 0 then cap = c else cap = -1 end
            if cap < c then c, cs, cw, ck = cap, si, wi, 'money' end
          end
          if w.g then
            local room = w.g - G - hg - p.fg
            local cap
            if p.pg > 0 then cap = math.floor(room / p.pg) elseif room >= 0 then cap = c else cap = -1 end
            if cap < c then c, cs, cw, ck = cap, si, wi, 'gpu_seconds' end
          end
        end
      end
    end
  end
  if ok == 1 and c < p.minc then ok, fs, fw, fk = 0, cs, cw, ck end
  if ok == 1 then
    local tok = p.ft + c
    local mon = p.fm + c * p.pm
    local gpu = p.fg + c * p.pg
    local hold = I(tok) .. ':' .. I(mon)
    if gpu ~= 0 then hold = hold .. ':' .. I(gpu) end
    ki = 1
    for _, s in ipairs(p.s) do
      local z, h = KEYS[ki], KEYS[ki + 1]
      ki = ki + 2
      redis.call('ZADD', z, p.exp, p.rid)
      redis.call('HSET', h, p.rid, hold)
      redis.call('HINCRBY', h, '_t', I(tok))
      redis.call('HINCRBY', h, '_m', I(mon))
      if gpu ~= 0 then redis.call('HINCRBY', h, '_g', I(gpu)) end
      redis.call('EXPIRE', z, I(p.hx))
      redis.call('EXPIRE', h, I(p.hx))
      for _, w in ipairs(s.w) do
        add(KEYS[ki], w, 1, 0, 0, 0, los[KEYS[ki]])
        ki = ki + 1
      end
    end
  else
    c = 0
  end
  local res = {ok, c, fs, fw, fk}
  for i = 1, #out do res[#res + 1] = out[i] end
  return res
else
  -- idempotent settle: the last key is a per-request marker; a replayed settle (its first reply was lost
  -- when the server went away after executing it) finds the marker and changes nothing
  if p.dx then
    if not redis.call('SET', KEYS[#KEYS], '1', 'NX', 'EX', I(p.dx)) then return 0 end
  end
  for _, s in ipairs(p.s) do
    local z, h = KEYS[ki], KEYS[ki + 1]
    ki = ki + 2
    purge(z, h)
    local v = redis.call('HGET', h, p.rid)
    if v then
      unhold(h, p.rid, v)
      redis.call('ZREM', z, p.rid)
    end
    for _, w in ipairs(s.w) do
      add(KEYS[ki], w, 0, p.t, p.m, p.g)
      ki = ki + 1
    end
  end
  return 1
end
