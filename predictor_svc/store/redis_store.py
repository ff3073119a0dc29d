"""The Redis EAMC store: per-model collections shared by every predictor replica.

Keys (``{m}`` = model id):

    expertcache:eamc:{m}:entries   hash   entry_id -> blob (predictor_svc.eam format)
    expertcache:eamc:{m}:log       stream change log, id "<seq>-0", fields op/id/blob, MAXLEN
    expertcache:eamc:{m}:seq       string seq of the last change-log record
    expertcache:eamc:{m}:epoch     string random id of this collection's incarnation
    expertcache:models             hash   model id -> "LAYERSxEXPERTSxTOP_K" (the model catalog)

Every write is one Lua script, so it is atomic on the server: two replicas inserting at once
never exceed the capacity and never leave a torn entry, and the append-only file replays whole
scripts. A cursor is "<epoch>:<seq>"; ``changes`` returns None (reload) when the epoch changed
(collection wiped) or the records after the cursor were trimmed from the stream (detected by
the seq numbers, which are consecutive by construction).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from expertcache.security import redact_url
from predictor_svc.errors import Conflict, StoreUnavailable
from predictor_svc.store.base import Change, EamcStore

logger = logging.getLogger(__name__)

DEFAULT_LOG_LEN = 4096

# KEYS: entries, log, seq, epoch. ARGV: blob, capacity, victim ("" = none), maxlen, new epoch.
# Returns {"ok", entry_id} or {"conflict", reason}.
_INSERT = """
redis.call('SETNX', KEYS[4], ARGV[5])
local n = redis.call('HLEN', KEYS[1])
local capacity = tonumber(ARGV[2])
local maxlen = ARGV[4]
if n >= capacity then
  if ARGV[3] == '' then
    return {'conflict', 'at capacity ' .. capacity .. ' (' .. n .. ' entries) and no victim named'}
  end
  if redis.call('HEXISTS', KEYS[1], ARGV[3]) == 0 then
    return {'conflict', 'victim ' .. ARGV[3] .. ' is gone'}
  end
  redis.call('HDEL', KEYS[1], ARGV[3])
  local s = redis.call('INCR', KEYS[3])
  redis.call('XADD', KEYS[2], 'MAXLEN', maxlen, s .. '-0', 'op', 'del', 'id', ARGV[3])
end
local s = redis.call('INCR', KEYS[3])
local id = tostring(s)
redis.call('HSET', KEYS[1], id, ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', maxlen, s .. '-0', 'op', 'put', 'id', id, 'blob', ARGV[1])
return {'ok', id}
"""


def _listing(command: str) -> str:
    """A script reading a collection whole with its cursor. KEYS: entries, seq, epoch. ARGV: new
    epoch. Returns {epoch, seq, ...what ``command`` (HGETALL, HKEYS) gives of the entries}."""
    return f"""
redis.call('SETNX', KEYS[3], ARGV[1])
local out = {{redis.call('GET', KEYS[3]), redis.call('GET', KEYS[2]) or '0'}}
local got = redis.call('{command}', KEYS[1])
for i = 1, #got do out[#out + 1] = got[i] end
return out
"""


_LOAD = _listing("HGETALL")  # {epoch, seq, id1, blob1, id2, blob2, ...}
# {epoch, seq, id1, id2, ...}: the ids without their blobs, which the reader fetches in bounded
# batches (get_many).
_IDS = _listing("HKEYS")

# KEYS: entries, log, seq, epoch. ARGV: epoch, seq, capacity, maxlen, blob1, blob2, ...
# Appends the blobs (up to capacity) only while nothing else changed the collection since the
# cursor (epoch, seq), and, for the first batch (seq 0), only where the change log is gone too:
# the collection was lost whole (a Redis restarted empty), not wiped on purpose.
# Returns {"ok", new seq} or {"conflict", reason}.
_REFILL = """
if (redis.call('GET', KEYS[4]) or '') ~= ARGV[1] or (redis.call('GET', KEYS[3]) or '0') ~= ARGV[2] then
  return {'conflict', 'changed since the cursor'}
end
if ARGV[2] == '0' and redis.call('XLEN', KEYS[2]) > 0 then
  return {'conflict', 'the change log is still there: wiped on purpose, not lost'}
end
local capacity = tonumber(ARGV[3])
for i = 5, #ARGV do
  if redis.call('HLEN', KEYS[1]) >= capacity then break end
  local s = redis.call('INCR', KEYS[3])
  redis.call('HSET', KEYS[1], tostring(s), ARGV[i])
  redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[4], s .. '-0', 'op', 'put', 'id', tostring(s), 'blob', ARGV[i])
end
return {'ok', redis.call('GET', KEYS[3]) or '0'}
"""

# KEYS: log, seq, epoch. ARGV: start id (exclusive, "(<seq>-0"), most records (0 = all).
# Returns {epoch, seq, records}.
_CHANGES = """
local records
if tonumber(ARGV[2]) > 0 then
  records = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
else
  records = redis.call('XRANGE', KEYS[1], ARGV[1], '+')
end
return {redis.call('GET', KEYS[3]) or '', redis.call('GET', KEYS[2]) or '0', records}
"""

# KEYS: the model catalog. ARGV: model id, shape, max models. Returns {status, value} (base.register_model).
_REGISTER = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then return {'exists', cur} end
local n = redis.call('HLEN', KEYS[1])
if n >= tonumber(ARGV[3]) then return {'full', tostring(n)} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return {'created', ARGV[2]}
"""

MODELS_KEY = "expertcache:models"


class RedisStore(EamcStore):
    """``EamcStore`` on one Redis server. Errors talking to it raise StoreUnavailable."""

    def __init__(
        self,
        url: str,
        log_len: int = DEFAULT_LOG_LEN,
        socket_timeout_s: float = 2.0,
        *,
        username: str | None = None,
        password: str | None = None,
        tls_ca_file: str | None = None,
    ) -> None:
        """``username`` / ``password`` (from a Secret) override those in ``url``; ``tls_ca_file``
        verifies the server of a ``rediss://`` URL."""
        if log_len < 1:
            raise ValueError(f"log_len must be >= 1, got {log_len}")
        self.url = redact_url(url)  # what errors and logs show: never the password
        self._log_len = log_len
        secrets: dict = {}
        if username:
            secrets["username"] = username
        if password is not None:
            secrets["password"] = password
        if tls_ca_file:
            if not url.startswith("rediss://"):
                raise ValueError(f"a Redis CA file needs a rediss:// URL, got {self.url!r}")
            secrets["ssl_ca_certs"] = tls_ca_file
        # Short timeouts: an outage must surface as StoreUnavailable quickly, not hang a caller.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry_on_timeout=False,
            **secrets,
        )
        # Called with (operation, seconds) after every round trip (``time_round_trips``).
        self._round_trip: Callable[[str, float], None] | None = None
        self._insert = self._client.register_script(_INSERT)
        self._load = self._client.register_script(_LOAD)
        self._changes = self._client.register_script(_CHANGES)
        self._ids = self._client.register_script(_IDS)
        self._refill = self._client.register_script(_REFILL)
        self._register = self._client.register_script(_REGISTER)

    @staticmethod
    def _keys(model_id: str) -> dict[str, str]:
        base = f"expertcache:eamc:{model_id}"
        return {k: f"{base}:{k}" for k in ("entries", "log", "seq", "epoch")}

    def _call(self, what: str, script, keys: list[str], args: list) -> list:
        return self._timed(what, lambda: script(keys=keys, args=args))

    def _timed(self, what: str, call: Callable[[], Any]) -> Any:
        """One round trip to Redis, timed for ``time_round_trips`` (failed ones too)."""
        started = time.perf_counter()
        try:
            return call()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailable(f"EAMC store redis at {self.url} unavailable ({what}): {exc}") from exc
        except redis.RedisError as exc:
            raise StoreUnavailable(f"EAMC store redis at {self.url} failed ({what}): {exc}") from exc
        finally:
            if self._round_trip is not None:
                self._round_trip(what, time.perf_counter() - started)

    def time_round_trips(self, observe: Callable[[str, float], None]) -> None:
        self._round_trip = observe

    def load(self, model_id: str) -> tuple[dict[str, bytes], str]:
        k = self._keys(model_id)
        out = self._call("load", self._load, [k["entries"], k["seq"], k["epoch"]], [uuid.uuid4().hex])
        epoch, seq = out[0].decode(), int(out[1])
        entries = {out[i].decode(): bytes(out[i + 1]) for i in range(2, len(out), 2)}
        return entries, f"{epoch}:{seq}"

    def entry_ids(self, model_id: str) -> tuple[list[str], str]:
        k = self._keys(model_id)
        out = self._call("load", self._ids, [k["entries"], k["seq"], k["epoch"]], [uuid.uuid4().hex])
        return [raw.decode() for raw in out[2:]], f"{out[0].decode()}:{int(out[1])}"

    def get_many(self, model_id: str, entry_ids: list[str]) -> dict[str, bytes]:
        if not entry_ids:
            return {}
        key = self._keys(model_id)["entries"]
        blobs = self._timed("load", lambda: self._client.hmget(key, entry_ids))
        return {i: bytes(b) for i, b in zip(entry_ids, blobs, strict=True) if b is not None}

    def refill(self, model_id: str, cursor: str, blobs: list[bytes], capacity: int) -> str | None:
        epoch, _, seq = cursor.partition(":")
        k = self._keys(model_id)
        status, value = self._call(
            "refill",
            self._refill,
            [k["entries"], k["log"], k["seq"], k["epoch"]],
            [epoch, seq, capacity, self._log_len, *blobs],
        )
        return f"{epoch}:{int(value)}" if status == b"ok" else None

    def changes(self, model_id: str, cursor: str, limit: int = 0) -> tuple[list[Change], str] | None:
        epoch, _, seq_text = cursor.partition(":")
        try:
            seq = int(seq_text)
        except ValueError:
            return None
        k = self._keys(model_id)
        out = self._call("changes", self._changes, [k["log"], k["seq"], k["epoch"]], [f"({seq}-0", limit])
        cur_epoch, cur_seq, records = out[0].decode(), int(out[1]), out[2]
        if cur_epoch != epoch or cur_seq < seq:
            return None  # the collection was wiped or recreated
        if cur_seq == seq:
            return [], cursor
        if not records or int(records[0][0].split(b"-")[0]) != seq + 1:
            return None  # records after the cursor were trimmed from the stream
        changes = []
        for _record_id, fields in records:
            f = dict(zip(fields[::2], fields[1::2], strict=True))
            op = f[b"op"].decode()
            changes.append(Change(op, f[b"id"].decode(), bytes(f[b"blob"]) if op == "put" else None))
        last = int(records[-1][0].split(b"-")[0])
        return changes, f"{epoch}:{last}"

    def insert(self, model_id: str, blob: bytes, capacity: int, victim_id: str | None) -> str:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        k = self._keys(model_id)
        status, value = self._call(
            "insert",
            self._insert,
            [k["entries"], k["log"], k["seq"], k["epoch"]],
            [bytes(blob), capacity, victim_id or "", self._log_len, uuid.uuid4().hex],
        )
        if status == b"conflict":
            raise Conflict(f"EAMC {model_id!r} changed under an insert: {value.decode()}")
        return value.decode()

    def models(self) -> dict[str, str]:
        raw = self._timed("models", lambda: self._client.hgetall(MODELS_KEY))
        return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}

    def register_model(self, model_id: str, shape: str, max_models: int) -> tuple[str, str]:
        status, value = self._call("register", self._register, [MODELS_KEY], [model_id, shape, max_models])
        return status.decode(), value.decode()

    def count(self, model_id: str) -> int:
        return int(self._timed("count", lambda: self._client.hlen(self._keys(model_id)["entries"])))

    def close(self) -> None:
        self._client.close()
