"""The one control message between SGLang's API process and its schedulers (TP ranks).

Both types travel over SGLang's own IPC (msgpack structs, registered with
``hook_custom_types``). Arguments and replies are JSON text so that the msgpack schema
stays fixed while the worker protocol carries nested routing slices.
"""

from __future__ import annotations

from sglang.srt.managers.io_struct import BaseReq


class MooncakeRLReqInput(BaseReq, kw_only=True):
    engine_id: str
    method: str
    args: str = "[]"


class MooncakeRLReqOutput(BaseReq, kw_only=True):
    replies: str  # JSON list: one reply per TP rank, in rank order
