"""Which recorded modules get an entry row (oracle/replay/local.py ``entries_of``) and which rows of the decoder's
first input each unrecorded module wrote (``Recipe.entry_sources``, Qwen3-VL's)."""

import torch

from oracle import recipe as recipes
from oracle.replay.local import entries_of


class _Cap:
    def __init__(self, orders: dict[str, int]):
        self.manifest = {"modules": {n: {"order": o} for n, o in orders.items()}}


def test_the_first_block_of_every_recorded_stack_gets_an_entry_row():
    """Vision blocks and decoder layers recorded (Megatron's ``layers,vit``): the first of each stack, in forward
    order; the decoder layers alone: layer 0 only (as before); a layer's sub-modules with the layer: no entry of
    their own (the layer holds them); sub-modules alone: the first recorded one."""
    vit = {f"model.visual.blocks.{i}": i for i in range(3)}
    dec = {f"model.language_model.layers.{i}": 3 + i for i in range(4)}
    assert entries_of(_Cap({**vit, **dec}), [*dec, *vit]) == ("model.visual.blocks.0", "model.language_model.layers.0")
    assert entries_of(_Cap(dec), list(dec)) == ("model.language_model.layers.0",)
    subs = {"model.language_model.layers.0.self_attn": 4, "model.language_model.layers.0.mlp": 5}
    assert entries_of(_Cap({**dec, **subs}), [*dec, *subs]) == ("model.language_model.layers.0",)
    assert entries_of(_Cap(subs), list(subs)) == ("model.language_model.layers.0.self_attn",)
    assert entries_of(_Cap({}), []) == ()


def test_qwen3_vl_image_rows_are_the_mergers_and_the_others_the_token_embeddings():
    r = recipes.get("qwen3-vl")
    cfg = {"image_token_id": 7, "video_token_id": 8}
    ids = torch.tensor([[1, 7, 7, 2, 8, 3]])
    src = r.entry_sources(cfg, {"input_ids": ids})
    assert src["model.visual.merger"].tolist() == [[False, True, True, False, True, False]]
    assert src["model.language_model.embed_tokens"].tolist() == [[True, False, False, True, False, True]]
    assert r.entry_sources(cfg, {"input_ids": torch.tensor([[1, 2, 3]])}) == {}  # text only: one writer
    assert recipes.get("qwen3").entry_sources({}, {"input_ids": ids}) == {}
