"""Megatron-core / MindSpeed support: a per-rank capture hook (hook.py), the merge of TP shards
into an ordinary capture (merge.py), and the rank view of an oracle (rankview.py). megatron-core is
never imported at module import time; only the hook asks it for parallel coordinates."""
