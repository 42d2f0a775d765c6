"""Consume-side planning: pure, deterministic functions from (manifest, demands, topology)
to a routing table that reads every demanded byte from the Store exactly once."""
