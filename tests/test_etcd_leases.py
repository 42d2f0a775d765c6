"""A durable Store's serving leases live in its etcd, on etcd leases (issue 50: cut the
renewal churn). Real etcd (Debian's ``etcd-server``) on loopback; the book speaks only to
etcd, so no master is needed here. GC and the engines take this book through
:func:`lease_book` on a durable Store: tests/test_durable_store.py and the quick start."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from mooncake_rl import etcd
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.keys import etcd_leases_prefix
from mooncake_rl.generations.leases import EtcdLeaseBook
from mooncake_rl.services.etcd_cluster import EmbeddedEtcd, etcd_members


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    member = etcd_members(1)[0]
    with EmbeddedEtcd(member, (member,)) as running:
        yield running.endpoint


def revision(endpoint: str) -> int:
    """etcd's store revision: every write to its keys moves it."""
    reply = etcd._ask(endpoint, "/v3/kv/range", {"key": etcd._b64("-")}, 2.0)
    return int(reply["header"]["revision"])


def test_a_renewal_of_the_same_generation_writes_nothing(endpoint: str) -> None:
    """The first renewal writes the key; the next ones only keep its lease alive (etcd's
    revision does not move); a new generation writes it again, once."""
    book = EtcdLeaseBook(f"etcd://{endpoint}", "c1", "m")
    book.renew("engine-0", 3, ttl_s=30)
    written = revision(endpoint)
    for _ in range(5):
        book.renew("engine-0", 3, ttl_s=30)
    assert revision(endpoint) == written
    assert {k: (v.generation, v.live(time.time())) for k, v in book.leases().items()} == {
        "engine-0": (3, True)
    }
    book.renew("engine-0", 4, ttl_s=30)
    assert revision(endpoint) == written + 1
    assert book.live_generations() == {4}


def test_a_holder_that_stops_renewing_loses_its_lease_to_etcd(endpoint: str) -> None:
    """No clock compares expiries: etcd removes the key once its lease ran out, and a
    later renewal (its lease gone) writes it on a fresh one."""
    book = EtcdLeaseBook(f"etcd://{endpoint}", "c2", "m")
    book.renew("crashed", 7, ttl_s=2)
    book.renew("serving", 8, ttl_s=60)
    assert book.live_generations() == {7, 8}
    deadline = time.monotonic() + 10
    while "crashed" in book.leases() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(book.leases()) == {"serving"} and book.live_generations() == {8}
    book.renew("crashed", 7, ttl_s=2)  # its cached lease is gone: a fresh one
    assert book.live_generations() == {7, 8}


def test_release_removes_the_lease_and_books_stay_apart(endpoint: str) -> None:
    """Released leases are gone at once; another model or cluster id sees none of them;
    another book object of the same holder (a loader, then the serving task) continues it."""
    book = EtcdLeaseBook(f"etcd://{endpoint}", "c3", "m")
    book.renew("engine-1", 2, ttl_s=30)
    written = revision(endpoint)
    EtcdLeaseBook(f"etcd://{endpoint}", "c3", "m").renew("engine-1", 2, ttl_s=30)
    assert revision(endpoint) == written
    assert EtcdLeaseBook(f"etcd://{endpoint}", "c3", "other").leases() == {}
    assert EtcdLeaseBook(f"etcd://{endpoint}", "c4", "m").leases() == {}
    book.release("engine-1")
    assert book.leases() == {}
    assert etcd.prefixed(endpoint, etcd_leases_prefix("c3", "m")) == {}


def test_a_bad_holder_is_refused_before_anything_is_written(endpoint: str) -> None:
    book = EtcdLeaseBook(f"etcd://{endpoint}", "c5", "m")
    before = revision(endpoint)
    for bad in ("", "a/b"):
        with pytest.raises(InvariantViolation, match="must be non-empty without '/'"):
            book.renew(bad, 1, ttl_s=30)
    assert revision(endpoint) == before and book.leases() == {}
