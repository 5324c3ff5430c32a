"""Recomputing a step: the in-memory replay, exact attention, head and loss, the finite-difference
certificate, local replay; ``streaming/`` replays within a memory budget. Imports parallel,
capture, bundle and the root."""
