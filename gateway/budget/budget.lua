-- Atomic budget reserve/settle over every scope x window of one request (one EVALSHA each).
-- Mirrors gateway/budget/model.py BudgetState exactly; see that module for the semantics.
-- The budget dimensions (gateway/budget/dimensions.py) come from a prelude gateway/budget/store.py generates from
-- the table and puts before this text (so the script's SHA changes with the table), as constants:
--   W    the codes of the window counters in table order (the first, requests, is counted by every reserve and
--        marks a rolling bucket as present), TOT the fields of their totals (the codes upper-cased),
--   AT   per counter, its position among the held amounts (0: a count, never held),
--   HT   per held amount, the hold hash's field of its total ("_<code>"),
--   HM   how many amounts a hold string keeps even when 0.
-- (Constants, not arguments: decoding them from every call's JSON cost ~5 us of script time, bench/budget.py.)
-- KEYS: per scope: hold zset (rid by expiry), hold hash (rid -> amounts "a1:a2[:a3...]", trailing zeros
--       past HM dropped; HT totals), then one counter key per window of that scope (hash: TOT totals,
--       "<code><bucket>" per rolling bucket, "lo" the oldest bucket).
--       settle only: a last key, the request's idempotency marker (when ARGV has dx).
-- ARGV[1]: JSON plan (ReserveArgs.to_wire / SettleArgs.to_wire); amounts are integer store units (money
--          nano-units, GPU-seconds micro-GPU-seconds), arrays in the order of HT, window limits keyed by code.
local p = cjson.decode(ARGV[1])
local now = p.now
local ki = 1
local NW, NA = #W, #HT
local MARK = W[1]

local function I(x) return string.format('%d', x) end

-- a hold's amounts (missing ones are 0)
local function amounts(v)
  local a, j = {}, 0
  for x in string.gmatch(v, '[^:]+') do
    j = j + 1
    a[j] = tonumber(x)
  end
  for k = j + 1, NA do a[k] = 0 end
  return a
end

-- take a hold's amounts off the hash totals and drop it
local function unhold(h, rid, v)
  local a = amounts(v)
  for j = 1, NA do
    if a[j] ~= 0 then redis.call('HINCRBY', h, HT[j], I(-a[j])) end
  end
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
  local f = {}
  while b <= floor_b do
    for i = 1, NW do f[i] = W[i] .. b end
    local v = redis.call('HMGET', k, unpack(f))
    if v[1] then
      for i = 1, NW do
        if v[i] and v[i] ~= '0' then redis.call('HINCRBY', k, TOT[i], I(-tonumber(v[i]))) end
      end
      redis.call('HDEL', k, unpack(f))
    end
    b = b + 1
  end
  while b < now_b and redis.call('HEXISTS', k, MARK .. b) == 0 do b = b + 1 end
  if b ~= lo then redis.call('HSET', k, 'lo', I(b)) end
  return b
end

-- add one value per counter; `lo` (optional) is the window's oldest bucket from an advance earlier in this call
local function add(k, w, vals, lo)
  if w.n then
    if not lo then lo = advance(k, w.b, w.n) end
    local b = w.b
    if lo > b then b = lo end
    if vals[1] ~= 0 then redis.call('HINCRBY', k, MARK .. b, I(vals[1])) else redis.call('HSETNX', k, MARK .. b, '0') end
    for i = 2, NW do
      if vals[i] ~= 0 then redis.call('HINCRBY', k, W[i] .. b, I(vals[i])) end
    end
  end
  for i = 1, NW do
    if vals[i] ~= 0 then redis.call('HINCRBY', k, TOT[i], I(vals[i])) end
  end
  if w.x then redis.call('EXPIRE', k, I(w.x)) end
end

if p.op == 'r' then
  local F, P = p.f, p.p  -- per amount: held whatever the completion, and per completion token granted
  local out, no = {0, 0, 0, 0, 0}, 5  -- the reply: (ok, c, scope, window, kind) set at the end, then the stats
  local ok, c, fs, fw, fk = 1, p.maxc, 0, 0, ''
  local cs, cw, ck = 0, 0, ''
  local los = {}
  for si, s in ipairs(p.s) do
    local z, h = KEYS[ki], KEYS[ki + 1]
    ki = ki + 2
    purge(z, h)
    local held = redis.call('HMGET', h, unpack(HT))
    for j = 1, NA do held[j] = tonumber(held[j]) or 0 end
    local nh = redis.call('ZCARD', z)
    no = no + 1
    out[no] = nh
    for j = 1, NA do out[no + j] = held[j] end
    no = no + NA
    if s.c and nh + 1 > s.c and ok == 1 then ok, fs, fw, fk = 0, si, 0, 'concurrency' end
    for wi, w in ipairs(s.w) do
      local k = KEYS[ki]
      ki = ki + 1
      local old = 0
      if w.n then
        local lo = advance(k, w.b, w.n)
        los[k] = lo
        if redis.call('HEXISTS', k, MARK .. lo) == 1 then old = lo else old = w.b end
      end
      local sums = redis.call('HMGET', k, unpack(TOT))
      for i = 1, NW do
        local x = tonumber(sums[i]) or 0
        sums[i] = x
        out[no + i] = x
      end
      no = no + NW + 1
      out[no] = old
      local l = w.l
      if ok == 1 and l then
        for i = 1, NW do
          local lim = l[W[i]]
          if lim then
            local j = AT[i]
            if j == 0 then  -- a count: this request is one more
              if sums[i] + 1 > lim then
                ok, fs, fw, fk = 0, si, wi, W[i]
                break
              end
            else
              local room = lim - sums[i] - held[j] - F[j]
              local cap
              if P[j] > 0 then cap = math.floor(room / P[j]) elseif room >= 0 then cap = c else cap = -1 end
              if cap < c then c, cs, cw, ck = cap, si, wi, W[i] end
            end
          end
        end
      end
    end
  end
  if ok == 1 and c < p.minc then ok, fs, fw, fk = 0, cs, cw, ck end
  if ok == 1 then
    local amt, parts, last = {}, {}, HM
    for j = 1, NA do
      amt[j] = F[j] + c * P[j]
      if amt[j] ~= 0 and j > last then last = j end
    end
    for j = 1, last do parts[j] = I(amt[j]) end
    local hold = table.concat(parts, ':')
    local vals = {1}
    for i = 2, NW do if AT[i] == 0 then vals[i] = 1 else vals[i] = 0 end end
    ki = 1
    for _, s in ipairs(p.s) do
      local z, h = KEYS[ki], KEYS[ki + 1]
      ki = ki + 2
      redis.call('ZADD', z, p.exp, p.rid)
      redis.call('HSET', h, p.rid, hold)
      for j = 1, NA do
        if amt[j] ~= 0 then redis.call('HINCRBY', h, HT[j], I(amt[j])) end
      end
      redis.call('EXPIRE', z, I(p.hx))
      redis.call('EXPIRE', h, I(p.hx))
      for _, w in ipairs(s.w) do
        add(KEYS[ki], w, vals, los[KEYS[ki]])
        ki = ki + 1
      end
    end
  else
    c = 0
  end
  -- the refusing limit's kind: its dimension's code (ReserveResult.from_flat names it), 'concurrency', or ''
  out[1], out[2], out[3], out[4], out[5] = ok, c, fs, fw, fk
  return out
else
  -- idempotent settle: the last key is a per-request marker; a replayed settle (its first reply was lost
  -- when the server went away after executing it) finds the marker and changes nothing
  if p.dx then
    if not redis.call('SET', KEYS[#KEYS], '1', 'NX', 'EX', I(p.dx)) then return 0 end
  end
  local vals = {}
  for i = 1, NW do
    if AT[i] == 0 then vals[i] = 0 else vals[i] = p.a[AT[i]] end
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
      add(KEYS[ki], w, vals, nil)
      ki = ki + 1
    end
  end
  return 1
end
