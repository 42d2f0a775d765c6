"""Drive engines from one generation to the next over their ``/mooncake/*`` routes.

1. collect placements; 2. check every object the plan reads, plan and encode each engine's
prepare slices, before any engine drains or leaves a router's rotation (engines serve while
a cold plan runs and its slices are encoded: seconds each for a 1T MoE); 3. open one
update session on every engine (drain), renewed in the background; 4. prepare (re-planned
around engines that did not drain); 5. apply stage by stage (each stage is a barrier:
consumers are passive, so a worker's bytes have arrived once every worker returned);
6. commit, only after every apply succeeded.

Engines serve through steps 3-5: they stage beside their live weights and pause (the drain
mode: abort, wait or keep) only to land at commit, and a router takes them out of rotation
for that landing alone. Direct mode receiving in place is the exception: those engines
pause at prepare, and leave the rotation before the drain.

With ``transport`` other than ``store`` (:mod:`mooncake_rl.transport`), engines are
classified by GPU topology before step 3, and steps 4-5 deliver full tensors by broadcast
or CPU buckets (:mod:`mooncake_rl.transport.legs`); sessions, drain and commit are the same.

Failures never leave an engine half-updated or paused:

- Engines that fail to drain or prepare are released and reported; the update goes on with
  the rest while at least ``min_engines`` can end on the new generation, re-planned around
  the missing ones (a reader that died takes its pushes with it). A prepared engine that
  stops answering before apply is re-planned around the same way.
- An apply failure aborts every engine: an engine that staged every byte serves its old
  generation again; one that received into live parameters (direct mode, in place)
  rebuilds itself from the Store's active generation and is reported in ``rebuild``.
- Commit and abort are idempotent per session and retried when a response is lost.
- If this process dies, each engine's session lease expires and the engine goes back to
  serving by itself; a rival coordinator's calls carry another session and are refused.
  Drain takes the engines in URL order, first one alone, so two rivals meet on the first
  engine and the loser holds nothing.

Its rooms, in the update's order: :mod:`.orchestration` (the :class:`Coordinator`, its waves
and the sync), :mod:`.survey` (steps 1-2 and the plan), :mod:`.session` (the session and its
steps 3-6), :mod:`.client` (the engines' HTTP calls) and :mod:`.result` (what an update
reports, and its errors).
"""

from mooncake_rl.coordinator.client import (
    REQUEST_ERRORS,
    RETRIES,
    RETRY_WAIT_S,
    TRANSPORT_ERRORS,
    EngineClient,
    EngineRequestFailed,
)
from mooncake_rl.coordinator.orchestration import Bracket, Coordinator
from mooncake_rl.coordinator.result import ReadmitFailed, UpdateFailed, UpdateResult
from mooncake_rl.coordinator.session import (
    ADVERTISED,
    SessionLease,
    advertised_peers,
    stage_peers,
)
from mooncake_rl.coordinator.survey import (
    BARE_PLACEMENT,
    engine_gpus,
    refusal,
    serves,
    target_of,
)

__all__ = [
    "ADVERTISED",
    "BARE_PLACEMENT",
    "REQUEST_ERRORS",
    "RETRIES",
    "RETRY_WAIT_S",
    "TRANSPORT_ERRORS",
    "Bracket",
    "Coordinator",
    "EngineClient",
    "EngineRequestFailed",
    "ReadmitFailed",
    "SessionLease",
    "UpdateFailed",
    "UpdateResult",
    "advertised_peers",
    "engine_gpus",
    "refusal",
    "serves",
    "stage_peers",
    "target_of",
]
