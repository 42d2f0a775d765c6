"""The ``mooncake-rl`` commands, one module per group; :mod:`mooncake_rl.cli` is the program.

    argv --> :func:`mooncake_rl.cli.build_parser` (each group adds its subcommands and
    flags) --> ``args.func(args)``: the command opens what it needs (a Store client from
    the client flags, :mod:`.store_client`) and calls the library --> JSON or a table on
    stdout, an exit code

Groups: :mod:`.services` (``master``, ``holder``: the Store's processes in the foreground),
:mod:`.generations` (``publish``, ``status``, ``gc``, ``activate``, ``verify``: a model's
generations in the Store, over :mod:`mooncake_rl.generations.commands`) and :mod:`.engines`
(``update``, ``router``: the engines behind a coordinator and a request router).
"""
