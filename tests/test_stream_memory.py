"""The streaming replay's memory and disk: token-chunked units, an honest dry run, disk in proportion."""

from __future__ import annotations

import torch

from oracle.bundle.store import Bundle
from oracle.replay.run import replay


def _grads(path) -> dict[str, torch.Tensor]:
    return Bundle(path).load_group("grads")


def test_token_chunked_mlps_equal_the_unchunked_replay(fp32_capture, tmp_path):
    """MLPs run by 16-token chunks (144 text tokens, 24 patches): the loss and every gradient that is
    not a sum over tokens bitwise equal; the MLP weights' gradients (sums split by chunk) within 1e-12."""
    whole = replay(fp32_capture, tmp_path / "whole", max_memory=8 << 30, token_chunk=1 << 20)
    cut = replay(fp32_capture, tmp_path / "cut", max_memory=8 << 30, token_chunk=16)
    a, b = _grads(whole), _grads(cut)
    assert Bundle(whole).get("loss")["value"] == Bundle(cut).get("loss")["value"]
    split = [n for n in a if ".mlp." in n]
    assert split and set(a) == set(b)
    worst = max(float((a[n] - b[n]).norm() / a[n].norm()) for n in split)
    assert worst <= 1e-12, worst
    moved = [n for n in a if n not in split and not torch.equal(a[n], b[n])]
    assert moved == [], moved
