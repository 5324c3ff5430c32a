"""``torch_npu.contrib`` stand-in: only ``transfer_to_npu`` (imported by mindspeed.megatron_adaptor)."""
