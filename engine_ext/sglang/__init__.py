"""SGLang adapter: ``--load-format mooncake``, the in-engine receiver and ``/mooncake/*``.

Everything plugs in through SGLang's ``sglang.srt.plugins`` entry point (see
:mod:`engine_ext.sglang.plugins`); nothing here is imported unless SGLang is installed.
"""
