"""Loaded by every Python process of a test engine whose PYTHONPATH names this folder.

Each fault is armed by its environment variable (a marker file's path) and fires while the
file exists:

- ``MOONCAKE_RL_TEST_STALE_EXPERTS``: puts back the upstream vLLM 0.32 behaviour that
  mooncake-rl works around: a weight reload does not re-run the CPU MoE prepack, so the
  experts keep the old generation's packed bytes. The post-landing check must catch it and
  the engine must never serve the result.
- ``MOONCAKE_RL_TEST_FAIL_TE_WRITE``: every Transfer Engine batch write returns the
  engine's failure code, as a write to a peer that went away does.
- ``MOONCAKE_RL_TEST_KILL_SENDER``: a broadcast sender SIGKILLs itself right after its
  first bucket, as a sender whose node dies mid-sync does.
"""

import os

_stale_marker = os.environ.get("MOONCAKE_RL_TEST_STALE_EXPERTS")
_write_marker = os.environ.get("MOONCAKE_RL_TEST_FAIL_TE_WRITE")
_sender_marker = os.environ.get("MOONCAKE_RL_TEST_KILL_SENDER")

if _stale_marker:
    import engine_ext.vllm.worker as _worker

    _repack = _worker.repack_cpu_experts

    def _repack_unless_faulted(model):
        if not os.path.exists(_stale_marker):
            _repack(model)

    _worker.repack_cpu_experts = _repack_unless_faulted

if _write_marker:
    import mooncake_rl.engine as _engine

    _init = _engine.TransferEngineClient.__init__

    class _FailingWrites:
        def __init__(self, engine):
            self._engine = engine

        def __getattr__(self, name):
            return getattr(self._engine, name)

        def batch_transfer_sync_write(self, *args):
            if os.path.exists(_write_marker):
                return -1
            return self._engine.batch_transfer_sync_write(*args)

    def _init_with_failing_writes(self, settings):
        _init(self, settings)
        self._engine = _FailingWrites(self._engine)

    _engine.TransferEngineClient.__init__ = _init_with_failing_writes

if _sender_marker:
    import signal

    import mooncake_rl.transport.group as _group

    _broadcast = _group.BroadcastGroup.broadcast

    def _broadcast_then_die(self, tensor):
        _broadcast(self, tensor)
        if self.spec.rank == 0 and os.path.exists(_sender_marker):
            os.kill(os.getpid(), signal.SIGKILL)

    _group.BroadcastGroup.broadcast = _broadcast_then_die
