"""Spreading a replay over processes and machines: launch, rank heartbeats and faults, tensor
parallel. Imports bundle and the root."""
