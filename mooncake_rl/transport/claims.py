"""Rendezvous port claims in the Store: one broadcast group per port, across processes.

A broadcast group's sender hosts the group's TCP store on a port every member dials; two
groups on one port cross-wire (members join the wrong group). So a sender first claims its
port: it creates ``mooncake-rl/ports/<host>/<port>`` exclusively, and a port already
claimed (or, on this host, already bound by anyone) is skipped for the next one.

A claim must outlive the TCP store, whose lifetime is the sender's, and must end once nobody
can use it:

- The holder renews the record's ``expires_at`` every ``lease_s / 3`` while its liveness
  predicate holds; an owner that died stops renewing and its claim expires.
- The holder deletes its claim only after the sender resolved (its teardown is done). A
  sender that never resolves (wedged) keeps its claim: it is logged, renewed while the
  sender may be live, and expires after that.
- An expired claim may be taken over by exactly one contender: the takeover marker
  ``<claim key>/takeover/<nonce>/<k>`` (``nonce`` names the expired record) is created
  exclusively, and only the marker's holder removes the record, after reading it again.
  A marker left by a taker that died mid-way expires like a claim; the next contender uses
  marker ``k + 1``. Markers are removed only once the record they name is gone for good.

Records are JSON with a checksum (a read racing a re-creation of the key can be torn).
Timing assumptions are those of serving leases: synchronized wall clocks, and nobody acts
on a lease with less than :data:`GUARD` of it left (a holder whose renewals fell that far
behind considers its claim lost; a slow taker aborts).
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import ipaddress
import json
import logging
import math
import re
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Literal, TypeVar

from mooncake_rl.errors import (
    ConfigurationError,
    InvariantViolation,
    MooncakeError,
    ObjectAlreadyExists,
    ObjectNotFound,
)
from mooncake_rl.generations.keys import NAMESPACE
from mooncake_rl.store import StoreClient

logger = logging.getLogger(__name__)

GUARD = 1 / 6
"""Fraction of a lease left below which nobody acts on it: a holder renews every third of a
lease, so one failed renewal is tolerated, and a takeover needs only a few RPCs."""
READ_ATTEMPTS = 4
"""Reads of a record that does not pass its checksum before it is judged foreign."""
TAKEOVER_MARKERS = 4
"""Takeover markers of one expired claim tried (each left by a taker that died mid-way)
before the port is skipped."""
_CLIENT_LOCKS: weakref.WeakKeyDictionary[StoreClient, threading.Lock] = weakref.WeakKeyDictionary()
_CLIENT_LOCKS_GUARD = threading.Lock()
_HOST = re.compile(r"^[A-Za-z0-9._:-]{1,253}$")


C = TypeVar("C", bound="Claim")


class NoFreePort(ConfigurationError):
    """Every port tried was claimed in the Store or bound on this host."""


def port_key(host: str, port: int) -> str:
    return f"{NAMESPACE}/ports/{host}/{port}"


def takeover_key(key: str, nonce: str, index: int) -> str:
    """Marker whose exclusive creation entitles one contender to replace record ``nonce``."""
    return f"{key}/takeover/{nonce}/{index}"


@dataclass(frozen=True)
class ClaimRecord:
    """What a claim (or a takeover marker) stores: who holds it, and until when."""

    owner: str
    nonce: str
    claimed_at: float
    expires_at: float
    lease_s: float

    def encode(self) -> bytes:
        """JSON with a checksum of its own content, so a torn read is told from a record."""
        body = asdict(self)
        return json.dumps({"record": body, "sha256": _digest(body)}).encode()

    @classmethod
    def decode(cls, data: bytes) -> ClaimRecord | None:
        """The record, or None for bytes that are not one (torn, or foreign)."""
        try:
            outer = json.loads(data)
            if _digest(outer["record"]) != outer["sha256"]:
                return None
            record = cls(**outer["record"])
        except (ValueError, KeyError, TypeError):
            return None
        numbers = (record.claimed_at, record.expires_at, record.lease_s)
        if not all(isinstance(n, int | float) for n in numbers):
            return None
        if not isinstance(record.owner, str) or not isinstance(record.nonce, str):
            return None
        return record

    def usable(self, now: float) -> bool:
        """Enough of the lease left to act on it (see :data:`GUARD`)."""
        return self.expires_at - now >= self.lease_s * GUARD


def _digest(body: object) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


FOREIGN = ClaimRecord("unknown", "", 0.0, math.inf, 0.0)
"""How bytes that stay unreadable as a claim record are judged: held by someone, forever."""


def _read(store: StoreClient, key: str) -> ClaimRecord | None:
    """The record at ``key``, or None when there is none.

    A read racing a removal and re-creation of the key can return a mix of both records
    (the checksum tells); it is read again. Bytes that stay unreadable count as held.
    """
    for attempt in range(READ_ATTEMPTS):
        try:
            record = ClaimRecord.decode(store.get_bytes(key))
        except ObjectNotFound:
            return None
        if record is not None:
            return record
        time.sleep(0.01 * (attempt + 1))
    logger.warning(
        "mooncake: %s is not a port claim record; the port is skipped (remove the key if "
        "nothing uses it)",
        key,
    )
    return FOREIGN


def _client_lock(store: StoreClient) -> threading.Lock:
    """Claims through one Store client go one at a time: two put sessions of one key started
    concurrently from one client fail with INVALID_PARAMS, not OBJECT_ALREADY_EXISTS.
    (Separate clients, like separate processes, race in the Store as they should.)"""
    with _CLIENT_LOCKS_GUARD:
        return _CLIENT_LOCKS.setdefault(store, threading.Lock())


def _local_family(host: str) -> socket.AddressFamily | None:
    """The address family of ``host`` when it is an address of this machine, else None.

    Only IP literals and this machine's own names are looked up: resolving a remote name can
    block, and a remote host's ports cannot be tested from here anyway.
    """
    if host not in {"localhost", socket.gethostname()}:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return None
    try:
        found = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(address)
            except OSError:
                continue
            return socket.AddressFamily(family)
    return None


def _bindable(family: socket.AddressFamily, port: int) -> bool:
    """Whether a TCP store could listen on ``port``: bound like one, on every interface and
    with ``SO_REUSEADDR``, so a port held only by closed connections counts as free."""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                logger.warning("mooncake: port %d cannot be bound here (%s): skipped", port, error)
            return False
    return True


class PortClaims:
    """Claims rendezvous ports on ``host`` in the Store, on behalf of ``owner``."""

    def __init__(self, store: StoreClient, host: str, *, owner: str, lease_s: float) -> None:
        if not _HOST.match(host):
            raise ConfigurationError(
                f"rendezvous host {host!r} must be a host name or IP address (letters, digits, "
                "'.', '_', ':', '-')"
            )
        self.store = store
        self.host = host
        self.owner = owner
        self.lease_s = float(lease_s)
        self._keys = KeyClaims(store, owner=owner, lease_s=lease_s)
        self._family = _local_family(host)

    def claim(
        self, start_port: int, *, attempts: int = 64, alive: Callable[[], bool] | None = None
    ) -> PortClaim:
        """The first port from ``start_port`` on that is neither claimed nor bound here.

        With ``alive``, the claim is renewed from the start (see :meth:`PortClaim.hold`).
        """
        if type(start_port) is not int or not 0 < start_port < 65536 or attempts < 1:
            raise ConfigurationError(
                f"start port {start_port!r} must be in 1..65535 and attempts {attempts} >= 1; "
                "set MOONCAKE_RL_RENDEZVOUS_PORT"
            )
        end = min(start_port + attempts, 65536)
        claimed = bound = 0
        for port in range(start_port, end):
            if self._family is not None and not _bindable(self._family, port):
                bound += 1
                continue
            claim = self._keys.claim(
                port_key(self.host, port), f"rendezvous port {port}", PortClaim
            )
            if claim is None:
                claimed += 1
                continue
            if alive is not None:
                claim.hold(alive)
            return claim
        raise NoFreePort(
            f"no rendezvous port free on {self.host} in {start_port}..{end - 1}: {claimed} "
            f"claimed by other owners, {bound} bound by other processes. Start past them "
            "(MOONCAKE_RL_RENDEZVOUS_PORT), or wait for stale claims to expire "
            f"(lease {self.lease_s:g}s)"
        )


class KeyClaims:
    """Exclusive, leased claims of Store keys on behalf of ``owner`` (see the module doc)."""

    def __init__(self, store: StoreClient, *, owner: str, lease_s: float) -> None:
        if not owner:
            raise ConfigurationError("a claim needs an owner (who holds it, for the logs)")
        if not lease_s > 0:
            raise ConfigurationError(
                f"claim lease must be positive, got {lease_s}; set MOONCAKE_RL_CLAIM_LEASE_S"
            )
        self.store = store
        self.owner = owner
        self.lease_s = float(lease_s)
        self._claiming = _client_lock(store)

    def claim(self, key: str, label: str, kind: type[C]) -> C | None:
        """A ``kind`` claim of ``key`` (``label`` names it in logs); None while another holds it."""
        with self._claiming:
            return self._try(key, label, kind)

    def _record(self) -> ClaimRecord:
        now = time.time()
        return ClaimRecord(self.owner, uuid.uuid4().hex, now, now + self.lease_s, self.lease_s)

    def _try(self, key: str, label: str, kind: type[C]) -> C | None:
        record = self._record()
        try:
            self.store.create_exclusive(key, record.encode())
        except ObjectAlreadyExists:
            current = _read(self.store, key)
            if current is None or current.expires_at > time.time():
                return None
            return self._take_over(key, label, current, kind)
        return kind(self.store, key, label, record)

    def _take_over(self, key: str, label: str, stale: ClaimRecord, kind: type[C]) -> C | None:
        """Replace the expired record ``stale``, if this contender wins its takeover marker."""
        for index in range(TAKEOVER_MARKERS):
            marker = self._record()
            try:
                self.store.create_exclusive(takeover_key(key, stale.nonce, index), marker.encode())
            except ObjectAlreadyExists:
                other = _read(self.store, takeover_key(key, stale.nonce, index))
                if other is None or other.expires_at > time.time():
                    return None  # taken over already, or being taken over now
                continue  # its taker died mid-way: try the next marker
            current = _read(self.store, key)
            if current is None or (current is not FOREIGN and current.nonce != stale.nonce):
                self._forget(key, stale.nonce)  # record gone for good: its markers are moot
                return None
            if current.expires_at > time.time() or not marker.usable(time.time()):
                return None  # renewed, unreadable, or this taker is too slow: marker expires
            if self.store.remove([key], force=True):
                return None
            self._forget(key, stale.nonce)
            logger.info("mooncake: took over the expired claim of %s from %s", label, stale.owner)
            return self._try(key, label, kind)
        return None

    def _forget(self, key: str, nonce: str) -> None:
        markers = [takeover_key(key, nonce, index) for index in range(TAKEOVER_MARKERS)]
        self.store.remove(markers, force=True)


class Claim:
    """One claimed key: renewed while its holder may be live, deleted once it is done."""

    def __init__(self, store: StoreClient, key: str, label: str, record: ClaimRecord) -> None:
        self.label = label
        self.key = key
        self.owner = record.owner
        self._store = store
        self._record = record
        self._state: Literal["held", "released", "lost"] = "held"
        self._alive: Callable[[], bool] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"Claim({self.label!r}, owner={self.owner!r}, state={self._state})"

    def hold(self, alive: Callable[[], bool]) -> None:
        """Renew every third of the lease while ``alive()`` holds (a later call replaces it).

        ``alive`` answers whether the sender, which hosts the group's TCP store, may still be
        live. Once it turns false (or raises) renewal stops and the claim expires by its lease.
        """
        with self._lock:
            if self._state != "held":
                raise InvariantViolation(
                    f"the claim of {self.label} is {self._state}: claim it again to hold it"
                )
            self._alive = alive
            if self._renewer is None or not self._renewer.is_alive():
                self._renewer = threading.Thread(
                    target=self._renew_while_alive, name=f"claim-{self.label}", daemon=True
                )
                self._renewer.start()

    def _renew_while_alive(self) -> None:
        while not self._stop.wait(self._record.lease_s / 3):
            alive = self._alive
            try:
                live = alive is not None and alive()
            except Exception:
                logger.exception("mooncake: liveness check of %s's claim failed", self.label)
                live = False
            if not live:
                logger.info(
                    "mooncake: claim of %s no longer renewed; it expires at %.0f",
                    self.label,
                    self._record.expires_at,
                )
                return
            if not self._renew():
                return

    def _renew(self) -> bool:
        """One renewal; False once the claim is no longer held."""
        with self._lock:
            if self._state != "held":
                return False
            now = time.time()
            if not self._record.usable(now):
                return self._lose("its renewals fell behind its lease")
            try:
                current = _read(self._store, self.key)
                if current is None:
                    return self._lose("its record is gone")
                if current.nonce != self._record.nonce:
                    return self._lose("another owner's record replaced it")
                renewed = replace(self._record, expires_at=now + self._record.lease_s)
                self._store.upsert_bytes(self.key, renewed.encode())
            except MooncakeError:  # the Store may be briefly unreachable: next tick retries
                logger.warning(
                    "mooncake: renewing the claim of %s failed", self.label, exc_info=True
                )
                return True
            self._record = renewed
            return True

    def _lose(self, why: str) -> bool:
        self._state = "lost"
        logger.error(
            "mooncake: lost the claim of %s (%s, owner %s): another contender may take it; "
            "renew more often than the lease (MOONCAKE_RL_CLAIM_LEASE_S)",
            self.label,
            why,
            self.owner,
        )
        return False

    def release(self) -> None:
        """Stop renewing and delete the claim if it is still this holder's; best effort
        (a claim that cannot be deleted expires by its lease)."""
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join()
        with self._lock:
            if self._state != "held":
                return
            self._state = "released"
            if not self._record.usable(time.time()):
                logger.warning(
                    "mooncake: claim of %s had lapsed; left to expire (another owner may "
                    "hold it now)",
                    self.label,
                )
                return
            try:
                current = _read(self._store, self.key)
                if current is None:
                    return
                if current.nonce != self._record.nonce:
                    logger.warning(
                        "mooncake: claim of %s was replaced by %s's while held (clock "
                        "skew between hosts?); left alone",
                        self.label,
                        current.owner,
                    )
                    return
                markers = [
                    takeover_key(self.key, current.nonce, index)
                    for index in range(TAKEOVER_MARKERS)
                ]
                failed = self._store.remove([self.key, *markers], force=True)
            except MooncakeError as error:
                failed = {self.key: error.code}
            if failed:
                logger.warning(
                    "mooncake: could not delete the claim of %s (%s); it expires by its lease",
                    self.label,
                    failed,
                )

    def release_after(
        self, sender: concurrent.futures.Future[object], *, teardown_timeout_s: float
    ) -> bool:
        """Release once ``sender`` resolved (result or exception); True when released.

        A sender still unresolved after ``teardown_timeout_s`` is wedged and may still host
        the group's TCP store: its claim is kept (renewed while ``alive()`` holds, then it
        expires) and False is returned. An interrupt that arrives while waiting still releases
        the claim if the sender had resolved by then.
        """
        try:
            concurrent.futures.wait((sender,), timeout=teardown_timeout_s)
        finally:
            resolved = sender.done()
            if resolved:
                self.release()
        if not resolved:
            renewing = self._alive is not None and not self._stop.is_set()
            logger.warning(
                "mooncake: %s stays claimed by %s: its sender did not finish "
                "within %.1fs and may still host the group's TCP store; the claim %s",
                self.label,
                self.owner,
                teardown_timeout_s,
                "is renewed while the sender may be live, then expires"
                if renewing
                else f"expires in {self._record.expires_at - time.time():.0f}s",
            )
        return resolved

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        """For a sender that runs and tears down inside the block."""
        self.release()


class PortClaim(Claim):
    """A rendezvous port's claim (its key is :func:`port_key`)."""

    @property
    def port(self) -> int:
        return int(self.key.rsplit("/", 1)[-1])
