"""Megatron-core / MindSpeed support: a per-rank capture hook (hook.py), the TP/PP/DP merge into an
ordinary capture (merge.py) with its HF config written from the run (hfconfig.py) and packed-sequence
boundaries (packing.py), the layouts and partial-sum rule both ways (layout.py), mcore <-> HF names
(names.py), and the rank view of an oracle (rankview.py). megatron-core is never imported at module
import time; only the hook asks it for parallel coordinates."""
