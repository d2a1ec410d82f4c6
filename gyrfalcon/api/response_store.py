"""Stored responses (the Responses API's ``store``): an SQLite file in the cache folder.

Every API worker of a server opens the same file (WAL mode: readers never wait for the writer),
so a response stored by one worker is found by the others and survives a worker's restart. The
store is bounded: at most ``--responses-store-size`` responses, each kept ``--responses-ttl``
seconds; the oldest go first. An id that went is remembered (a bounded list of tombstones), so
asking for it says it was evicted rather than that it never existed. Under Ray, ingress replicas
on one machine share the file; replicas on other machines do not see it (see docs/api.md, "The Responses API").

Each response has an owner: a hash of the API key that created it ('' on a server without keys).
Every read, cancel and delete names its owner, and a response of another owner is "not stored" (a
404 that says nothing of its existence). Ids are the server's own (never a client's request id),
so no request can replace another's response. A deleted response stays deleted: a background
response's last write does not bring it back, and one whose worker went while it ran (killed,
crashed) is read as failed once its lease lapses (:meth:`ResponseStore.response`). The file is 0600 in a 0700 folder (SQLite gives its
WAL files the database's mode), and expired rows are dropped by every read that meets them, by
every write, and every few minutes by each API worker (:meth:`ResponseStore.purge`).
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from gyrfalcon.errors import Kind, RequestError

#: tombstones kept per stored response allowed (evicted ids remembered)
TOMBSTONES_PER_SLOT = 4
#: seconds between two purges of the expired responses by each API worker
PURGE_INTERVAL_S = 300.0
#: seconds between a running background response's renewals of its lease (its worker vouching for it)
RENEW_INTERVAL_S = 5.0
#: seconds without a renewal after which a queued or running response's worker is taken as gone
LEASE_S = 30.0
#: the error of a response whose worker went while it ran (killed, crashed: nothing stored its end)
ORPHANED = {"code": "server_error", "message": "The worker running this response stopped before it ended"}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    response BLOB NOT NULL,
    input_items BLOB NOT NULL,
    conversation BLOB NOT NULL,
    owner TEXT NOT NULL DEFAULT '',
    alive REAL NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
CREATE TABLE IF NOT EXISTS evicted (id TEXT PRIMARY KEY, at REAL NOT NULL, owner TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS evicted_at ON evicted (at);
"""


def _running(response: dict[str, Any]) -> bool:
    """Whether a stored response is still queued or running (its worker renews its lease)."""
    return response.get("status") in ("queued", "in_progress")


def owner_of(api_key: str | None) -> str:
    """The owner recorded for responses made with ``api_key`` (a SHA-256, never the key; '' without one)."""
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else ""


def _private_file(path: Path) -> None:
    """``path``'s folder made 0700 and the file itself (created empty if missing) 0600."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    os.chmod(path, 0o600)


class ResponseStore:
    """The stored responses of ``path`` (created if missing), at most ``size``, for ``ttl`` seconds."""

    def __init__(self, path: str | Path, size: int, ttl: float) -> None:
        self.path, self.size, self.ttl = str(path), size, ttl
        _private_file(Path(self.path))
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=30.0, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        for table, column, kind in (("responses", "owner", "TEXT NOT NULL DEFAULT ''"), ("evicted", "owner", "TEXT NOT NULL DEFAULT ''"),
                                    ("responses", "alive", "REAL NOT NULL DEFAULT 0")):  # fmt: skip
            # a file from before owners (its rows are nobody's) or leases (its running ones are orphans)
            if column not in [row[1] for row in self._db.execute(f"PRAGMA table_info({table})")]:
                try:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                except sqlite3.OperationalError:  # another worker, starting beside this one, added it
                    if column not in [row[1] for row in self._db.execute(f"PRAGMA table_info({table})")]:
                        raise

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]], conversation: list[dict[str, Any]],
            owner: str = "", update: bool = False) -> bool:  # fmt: skip
        """Keep ``response`` (by its id) for ``owner`` with its input items and the turns a
        continuation starts from. ``update``: a later state of a response stored before (a
        background one's end), written only over that response as it is, never over one cancelled,
        deleted or evicted meanwhile (False then); a new response never replaces another's."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT response, owner FROM responses WHERE id = ?", (response["id"],)).fetchone()
                if (row is not None and row[1] != owner) or (update and (row is None or orjson.loads(row[0]).get("status")
                                                                         == "cancelled")):  # fmt: skip
                    self._db.execute("COMMIT")
                    return False
                self._db.execute("INSERT OR REPLACE INTO responses (id, created, response, input_items, conversation, owner, "
                                 "alive) VALUES (?, ?, ?, ?, ?, ?, ?)",
                                 (response["id"], now, orjson.dumps(response), orjson.dumps(input_items),
                                  orjson.dumps(conversation), owner, now if _running(response) else 0))  # fmt: skip
                self._evict(now)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return True

    def purge(self) -> None:
        """Drop the expired responses (and those over the size) now: a store nobody writes to would
        keep them otherwise; and mark failed the running ones whose lease lapsed, as a read would
        (``ServerContext`` calls this every :data:`PURGE_INTERVAL_S`)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                now = time.time()
                lapsed = self._db.execute("SELECT id, response FROM responses WHERE alive > 0 AND alive < ?",
                                          (now - LEASE_S,)).fetchall()  # fmt: skip
                for response_id, stored in lapsed:
                    response = orjson.loads(stored)
                    if _running(response):
                        response = {**response, "status": "failed", "error": dict(ORPHANED)}
                    self._db.execute("UPDATE responses SET response = ?, alive = 0 WHERE id = ?",
                                     (orjson.dumps(response), response_id))  # fmt: skip
                self._evict(now)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _evict(self, now: float) -> None:
        gone = list(self._db.execute("SELECT id, owner FROM responses WHERE created < ?", (now - self.ttl,)))
        over = int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]) - len(gone) - self.size
        if over > 0:  # the oldest first (the index on created: no scan of the whole table)
            gone += list(self._db.execute(
                "SELECT id, owner FROM responses WHERE created >= ? ORDER BY created LIMIT ?", (now - self.ttl, over)))  # fmt: skip
        if not gone:
            return
        self._db.executemany("DELETE FROM responses WHERE id = ?", [(i,) for i, _ in gone])
        self._db.executemany("INSERT OR REPLACE INTO evicted VALUES (?, ?, ?)", [(i, now, o) for i, o in gone])
        self._db.execute("DELETE FROM evicted WHERE id NOT IN (SELECT id FROM evicted ORDER BY at DESC LIMIT ?)",
                         (self.size * TOMBSTONES_PER_SLOT,))  # fmt: skip

    def _row(self, response_id: str, column: str, param: str | None, owner: str) -> Any:
        now = time.time()
        with self._lock:
            row = self._db.execute(f"SELECT {column}, created FROM responses WHERE id = ? AND owner = ?",  # noqa: S608 - a fixed column name
                                   (response_id, owner)).fetchone()  # fmt: skip
            if row is not None and row[1] >= now - self.ttl:
                return orjson.loads(row[0])
            if row is not None:  # expired: dropped now, not at the next write
                self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                self._db.execute("INSERT OR REPLACE INTO evicted VALUES (?, ?, ?)", (response_id, now, owner))
            evicted = row is not None or self._db.execute("SELECT 1 FROM evicted WHERE id = ? AND owner = ?",
                                                          (response_id, owner)).fetchone()  # fmt: skip
        if evicted:
            raise RequestError(f"The response '{response_id}' is no longer stored: it was evicted (the store keeps "
                               f"{self.size} responses for {self.ttl:g} s)", param, type=Kind.NOT_FOUND)  # fmt: skip
        raise RequestError(f"No stored response has the id '{response_id}'", param, type=Kind.NOT_FOUND)

    def response(self, response_id: str, param: str | None = None, owner: str = "") -> dict[str, Any]:
        """The stored response of ``owner`` (a 404 naming ``param`` when it is not stored). One still
        queued or running whose worker has not renewed its lease for :data:`LEASE_S` seconds is
        marked failed (:data:`ORPHANED`) and returned so: its worker is gone and nothing else would end it."""
        response = self._row(response_id, "response", param, owner)
        if _running(response):
            with self._lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    row = self._db.execute("SELECT response FROM responses WHERE id = ? AND alive < ?",
                                           (response_id, time.time() - LEASE_S)).fetchone()  # fmt: skip
                    stale = None if row is None else orjson.loads(row[0])
                    if stale is not None and _running(stale):
                        response = {**stale, "status": "failed", "error": dict(ORPHANED)}
                        self._db.execute("UPDATE responses SET response = ? WHERE id = ?", (orjson.dumps(response), response_id))
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
        return response

    def renew(self, response_id: str) -> None:
        """Its worker vouches for a running response (every :data:`RENEW_INTERVAL_S`)."""
        with self._lock:
            self._db.execute("UPDATE responses SET alive = ? WHERE id = ?", (time.time(), response_id))

    def conversation(self, response_id: str, param: str | None = None, owner: str = "") -> list[dict[str, Any]]:
        """The chat turns up to and including the stored response's answer."""
        return self._row(response_id, "conversation", param, owner)

    def input_items(self, response_id: str, owner: str = "") -> list[dict[str, Any]]:
        return self._row(response_id, "input_items", None, owner)

    def status(self, response_id: str) -> str | None:
        """The stored response's status, None when it is not stored (a cheap poll by its own worker)."""
        with self._lock:
            row = self._db.execute("SELECT response FROM responses WHERE id = ?", (response_id,)).fetchone()
        return None if row is None else orjson.loads(row[0]).get("status")

    def cancel(self, response_id: str, owner: str = "") -> dict[str, Any]:
        """Mark a queued or running response of ``owner`` cancelled (its worker stops it at its next
        poll); the response as it now is. One that has ended is left as it is."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT response FROM responses WHERE id = ? AND owner = ?",
                                       (response_id, owner)).fetchone()  # fmt: skip
                response = None if row is None else orjson.loads(row[0])
                if response is not None and _running(response):
                    response["status"] = "cancelled"
                    self._db.execute("UPDATE responses SET response = ?, alive = 0 WHERE id = ?",
                                     (orjson.dumps(response), response_id))  # fmt: skip
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return response if response is not None else self.response(response_id, owner=owner)

    def delete(self, response_id: str, owner: str = "") -> None:
        """Forget a stored response of ``owner`` (a 404 when it is not stored)."""
        self.response(response_id, owner=owner)
        with self._lock:
            self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
