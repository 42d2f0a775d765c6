"""``python -m bench`` / ``mooncake-rl bench``: the side-by-side run, or the simulator.

python -m bench [run] [--size 256MiB --workers 4 --nodes 2 --out out/bench-compare.png]
python -m bench simulate [--model kimi-k2 --trainer-gpus 256 --instances 16 --tp 8 ...]
python -m bench transports [--hidden 512 --layers 4 --repeats 3 --batch 8MiB --root DIR]
python -m bench load [--updates 5 --modes rolling all_at_once --drain abort wait keep --hidden 1024]
python -m bench control-plane [--engines 1000 --tp 1 --mode direct]
python -m bench scale [--model llama-70b --engines 16,128,1000 --tp 8 --dtype fp8]
python -m bench failover [--masters 2 --kills 3 --generations 20]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = __doc__


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["simulate"]:
        from bench.simulate import main as simulate

        return simulate(args[1:])
    if args[:1] == ["control-plane"]:
        from bench.control_plane import main as control_plane

        return control_plane(args[1:])
    if args[:1] == ["failover"]:
        from bench.failover import main as failover

        return failover(args[1:])
    if args[:1] == ["scale"]:
        from bench.scale import main as scale

        return scale(args[1:])
    if args[:1] in (["transports"], ["load"]):
        if args[0] == "load":
            from bench.load import main as load

            return load(args[1:])
        from bench.transports import main as transports

        return transports(args[1:])
    if args[:1] == ["run"]:
        args = args[1:]
    from bench.compare import main as compare

    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
