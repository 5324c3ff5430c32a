"""Stand-in for ``torch_npu.contrib.transfer_to_npu``: the real module makes CUDA code run on the NPU
(``torch.cuda.*`` answered by ``torch.npu``, ``"cuda"`` devices mapped to ``"npu"``). Here the NPU
is the CPU: ``torch.cuda``'s device calls are ``torch.npu``'s and every tensor placed on ``cuda`` or
``npu`` is placed on the CPU, for the whole process (``npu.PlaceOnCpu``; the ranks that import it
are spawned for the step only)."""

import torch

from .. import npu

for _name in ("current_device", "device_count", "set_device", "synchronize", "empty_cache", "is_available",
              "get_device_name", "get_device_properties", "memory_allocated", "max_memory_allocated",
              "memory_reserved", "reset_max_memory_allocated", "current_stream", "default_stream", "Stream", "Event",
              "stream", "manual_seed", "manual_seed_all", "mem_get_info", "get_rng_state", "set_rng_state"):  # fmt: skip
    setattr(torch.cuda, _name, vars(npu)[_name])  # vars(): not recorded as MindSpeed touching it

for _name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):  # megatron's RNG tracker reads these
    setattr(torch.cuda.random, _name, vars(npu)[_name])

MODE = vars(npu)["PlaceOnCpu"]()
MODE.__enter__()
