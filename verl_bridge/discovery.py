"""Find the rollout engines' HTTP servers among VeRL's Ray actors.

VeRL 0.9.x starts one HTTP server actor per node of each rollout replica and names it
``{vllm|sglang}_server_{replica_rank}_{node_rank}`` (``RolloutReplica.launch_servers``); the
node-0 server is the replica's OpenAI-compatible address (``replica.server_address``), which
is also where the ``/mooncake/*`` routes live. Reward and teacher models use
``..._server_reward_...`` / ``..._server_teacher_...`` names and are never matched.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

from mooncake_rl.errors import ConfigurationError

POLICY_SERVER = re.compile(r"^(?:vllm|sglang)_server_(\d+)_0$")


def policy_server_names(names: Iterable[str]) -> list[str]:
    """Node-0 server actor of every policy replica, in replica order."""
    matched = [(int(m.group(1)), name) for name in names if (m := POLICY_SERVER.match(name))]
    return [name for _, name in sorted(matched)]


def server_url(host: str, port: int) -> str:
    """``http://host:port``, bracketing IPv6 hosts as VeRL does for ``server_address``."""
    try:
        bracket = ipaddress.ip_address(host).version == 6
    except ValueError:
        bracket = False
    return f"http://[{host}]:{port}" if bracket else f"http://{host}:{port}"


def discover_engine_urls() -> list[str]:
    """Ask each policy replica's server actor (same Ray namespace) for its address."""
    import ray

    if not ray.is_initialized():
        raise ConfigurationError(
            "no engine_urls configured and not inside a Ray job: cannot discover engines"
        )
    names = policy_server_names(ray.util.list_named_actors())
    if not names:
        raise ConfigurationError(
            "no rollout server actors (vllm_server_<replica>_0) found in this Ray namespace; "
            "set engine_kwargs.mooncake_store.engine_urls"
        )
    addresses = ray.get([ray.get_actor(n).get_server_address.remote() for n in names])
    return [server_url(str(host), int(port)) for host, port in addresses]
