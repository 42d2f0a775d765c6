"""One registration manager for both domains a worker's memory must be registered in.

Store-client registrations make a buffer a ranged-read destination; Transfer Engine
registrations make it a remote-write destination. Registrations are keyed by
(epoch, instance, device, base, size), made *provisionally* during prepare, promoted once
every rank prepared, reused across generations while unchanged, dropped on reconnect (a new
epoch), and torn down by exact base. A region inside an existing registration reuses it;
a region that partially overlaps one is refused, so no byte is ever registered twice.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from mooncake_rl.errors import InvariantViolation


class Domain(Enum):
    STORE = "store"
    ENGINE = "engine"


class Registrar(Protocol):
    def register(self, ptr: int, size: int) -> None: ...
    def unregister(self, ptr: int) -> None: ...


@dataclass(frozen=True)
class RegistrationKey:
    epoch: int
    instance: str
    device: str
    base: int
    size: int

    def __post_init__(self) -> None:
        if self.base <= 0 or self.size <= 0:
            raise InvariantViolation(f"registration needs a positive base and size: {self}")

    @property
    def end(self) -> int:
        return self.base + self.size

    def contains(self, base: int, size: int) -> bool:
        return self.base <= base and base + size <= self.end

    def overlaps(self, base: int, size: int) -> bool:
        return self.base < base + size and base < self.end


@dataclass(frozen=True)
class Region:
    """A named span of a worker's memory (a parameter buffer, a staging buffer)."""

    name: str
    base: int
    size: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.name or self.base <= 0 or self.size <= 0:
            raise InvariantViolation(f"invalid region {self}")

    def address(self, offset: int, length: int) -> int:
        if offset < 0 or length <= 0 or offset + length > self.size:
            raise InvariantViolation(
                f"range [{offset}, {offset + length}) outside region {self.name} "
                f"of {self.size} bytes"
            )
        return self.base + offset


class RegistrationManager:
    """Tracks what is registered where; the only code that registers worker memory."""

    def __init__(self, instance: str, registrars: dict[Domain, Registrar], epoch: int = 0) -> None:
        self.instance = instance
        self.epoch = epoch
        self._registrars = registrars
        self._persistent: dict[Domain, dict[int, RegistrationKey]] = {d: {} for d in registrars}
        self._provisional: dict[Domain, dict[int, RegistrationKey]] = {d: {} for d in registrars}

    def _all(self, domain: Domain) -> Iterable[RegistrationKey]:
        yield from self._persistent[domain].values()
        yield from self._provisional[domain].values()

    def provision(self, regions: Iterable[Region]) -> int:
        """Register every region not yet covered, provisionally; returns new registrations.

        Registrations never overlap, so the one registration that could hold or clash with
        a region is the last starting at or before it, or the first starting inside it: two
        lookups in the sorted bases, not a scan (an in-place MoE worker registers tens of
        thousands of parameters).
        """
        made = 0
        ordered = {
            domain: sorted(self._all(domain), key=lambda k: k.base) for domain in self._registrars
        }
        starts = {domain: [key.base for key in keys] for domain, keys in ordered.items()}
        for region in regions:
            for domain, registrar in self._registrars.items():
                keys, bases = ordered[domain], starts[domain]
                at = bisect.bisect_right(bases, region.base)
                before = keys[at - 1] if at else None
                if before is not None and before.contains(region.base, region.size):
                    continue
                after = keys[at] if at < len(keys) else None
                clash = [k for k in (before, after) if k and k.overlaps(region.base, region.size)]
                if clash:
                    raise InvariantViolation(
                        f"region {region.name} [{region.base:#x}, +{region.size}) partially "
                        f"overlaps registration [{clash[0].base:#x}, +{clash[0].size}) "
                        f"in {domain.value}"
                    )
                key = RegistrationKey(
                    self.epoch, self.instance, region.device, region.base, region.size
                )
                registrar.register(region.base, region.size)
                self._provisional[domain][region.base] = key
                keys.insert(at, key)
                bases.insert(at, key.base)
                made += 1
        return made

    def promote(self) -> None:
        """Every rank prepared: provisional registrations become the persistent cache."""
        for domain in self._registrars:
            self._persistent[domain].update(self._provisional[domain])
            self._provisional[domain].clear()

    def rollback(self) -> None:
        """Prepare failed somewhere: undo exactly what this prepare registered."""
        for domain, registrar in self._registrars.items():
            for base in list(self._provisional[domain]):
                registrar.unregister(base)
            self._provisional[domain].clear()

    def release(self, bases: Iterable[int]) -> None:
        """Buffers about to be freed: unregister their exact bases everywhere.

        A freed buffer left registered would let a later allocation inside its span be
        mistaken for already-registered memory.
        """
        for base in bases:
            for domain, registrar in self._registrars.items():
                for table in (self._persistent[domain], self._provisional[domain]):
                    if table.pop(base, None) is not None:
                        registrar.unregister(base)

    def reconnect(self, registrars: dict[Domain, Registrar]) -> None:
        """New clients (new epoch): old registrations died with the old clients."""
        self.epoch += 1
        self._registrars = registrars
        self._persistent = {d: {} for d in registrars}
        self._provisional = {d: {} for d in registrars}

    def teardown(self) -> None:
        self.rollback()
        for domain, registrar in self._registrars.items():
            for base in list(self._persistent[domain]):
                registrar.unregister(base)
            self._persistent[domain].clear()

    def keys(self, domain: Domain, *, provisional: bool = False) -> list[RegistrationKey]:
        table = self._provisional if provisional else self._persistent
        return sorted(table[domain].values(), key=lambda key: key.base)
