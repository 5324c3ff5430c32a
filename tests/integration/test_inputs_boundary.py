"""A capture's inputs are checked where a replay reads them, before any replay path (issue 32, item 2):
ids against the embedding, positions against the ids (oracle/replay/inputs.py), image tokens against
the vision features and the grid against the pixels (the qwen3-vl recipe's check_inputs). Each broken
tensor is exit 4 naming it, through the CLI as a user runs it, never exit 1 or a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli import app
from oracle.bundle.store import Bundle, BundleWriter


def broken(src, dst, change):
    """A copy of capture ``src`` whose inputs went through ``change(inputs, config)`` (in place)."""
    b = Bundle(src)
    inputs = b.load_group("inputs")
    change(inputs, b.get("recipe")["config"])
    with BundleWriter(dst, b.kind) as w:
        w.manifest.update({k: v for k, v in b.manifest.items() if k not in ("tensors", "schema_version", "kind")})
        for group in b.groups():
            w.add(group, inputs if group == "inputs" else b.load_group(group))
    return dst


def _vocab(cfg):
    return cfg["text_config"]["vocab_size"]


def _set(name, fn):
    def change(x, cfg):
        x[name] = fn(x[name].clone(), cfg)

    return change


def _first_text(ids, cfg):
    """Index of the first token that is not an image token."""
    return int((ids[0] != cfg["image_token_id"]).nonzero()[0])


def _replace_image_token(ids, cfg):
    i = int((ids[0] == cfg["image_token_id"]).nonzero()[0])
    ids[0, i] = ids[0, _first_text(ids, cfg)]
    return ids


def _extra_image_token(ids, cfg):
    ids[0, _first_text(ids, cfg)] = cfg["image_token_id"]
    return ids


def _ids_at(value):
    def fn(ids, cfg):
        ids[0, 3] = value(cfg)
        return ids

    return fn


def _image_token_removed(x, cfg):
    """The first image token cut out of the ids, labels and positions alike (the sequence one shorter)."""
    ids = x["input_ids"]
    keep = [j for j in range(ids.shape[1]) if j != int((ids[0] == cfg["image_token_id"]).nonzero()[0])]
    for k in ("input_ids", "labels", "position_ids"):
        x[k] = x[k][..., keep].contiguous()


def _negative_position(t, cfg):
    t[..., 5] = -3
    return t


def _grid_taller(g, cfg):
    g[0, 1] *= 2
    return g


CASES = {
    "ids-past-the-vocabulary": (_set("input_ids", _ids_at(_vocab)), "inputs/input_ids holds ids"),
    "ids-negative": (_set("input_ids", _ids_at(lambda cfg: -1)), "inputs/input_ids holds ids from -1"),
    "ids-float": (_set("input_ids", lambda t, cfg: t.float()), "inputs/input_ids is float32"),
    "positions-one-short": (_set("position_ids", lambda t, cfg: t[..., :-1].contiguous()), "inputs/position_ids has shape [3, 1, 143]"),
    "image-token-replaced": (_set("input_ids", _replace_image_token), "image token(s)"),
    "image-token-extra": (_set("input_ids", _extra_image_token), "image token(s)"),
    "image-token-removed": (_image_token_removed, "image token(s)"),
    "positions-negative": (_set("position_ids", _negative_position), "inputs/position_ids holds negative positions"),
    "positions-2d": (_set("position_ids", lambda t, cfg: t[0].contiguous()), "inputs/position_ids has shape [1, 144]: with images"),
    "labels-all-ignored": (_set("labels", lambda t, cfg: t.fill_(-100)), "inputs/labels: no token carries a loss"),
    "grid-against-pixels": (_set("image_grid_thw", _grid_taller), "inputs/pixel_values has 24 patch row(s)"),
    "pixels-one-patch-short": (_set("pixel_values", lambda t, cfg: t[:-1].contiguous()), "inputs/pixel_values has 23 patch row(s)"),
}  # fmt: skip


@pytest.fixture(scope="module")
def captures(fp32_capture, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken-inputs")
    return {name: broken(fp32_capture, root / name, change) for name, (change, _) in CASES.items()}


def _replay(cap, out, *extra):
    res = CliRunner().invoke(app, ["replay", str(cap), "--out", str(out), *extra])
    assert "Traceback" not in res.output, res.output
    return res


@pytest.mark.parametrize("name", list(CASES))
def test_a_broken_input_is_exit_4_naming_the_tensor_before_any_replay(captures, tmp_path, name):
    """oracle replay (in memory, fp64, --no-verify: it skips the certificate, never the inputs' checks; issue 41:
    negative or 2-D positions and all labels -100 were replayed, exit 0) of the capture with one input broken:
    exit 4, the tensor named with what it should be, nothing written."""
    res = _replay(captures[name], tmp_path / "o", "--no-verify")
    assert res.exit_code == 4, res.output
    assert CASES[name][1] in res.output and "input(s) a replay cannot use" in res.output, res.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["ids-past-the-vocabulary", "pixels-one-patch-short"])
def test_the_streamed_and_emulated_replays_check_the_same_boundary(captures, tmp_path, name):
    """The same refusal from the streaming replay (--max-memory), its --dry-run and an emulated one (--dtype bf16)."""
    for extra in (["--max-memory", "1G"], ["--max-memory", "1G", "--dry-run"], ["--dtype", "bf16"]):
        res = _replay(captures[name], tmp_path / "o", *extra)
        assert res.exit_code == 4 and CASES[name][1] in res.output, (extra, res.output)


def test_every_offender_is_listed_in_one_message(fp32_capture, tmp_path):
    """Ids past the vocabulary and positions one short: both named in the one refusal."""

    def change(x, cfg):
        _set("input_ids", _ids_at(_vocab))(x, cfg)
        _set("position_ids", lambda t, c: t[..., :-1].contiguous())(x, cfg)

    res = _replay(broken(fp32_capture, tmp_path / "c", change), tmp_path / "o")
    assert res.exit_code == 4 and "inputs/input_ids" in res.output and "inputs/position_ids" in res.output, res.output


def test_the_untouched_capture_passes_the_boundary(fp32_capture):
    """The honest tiny capture passes (the checks refuse only what a replay cannot use)."""
    from oracle.replay.inputs import check_inputs

    check_inputs(Bundle(fp32_capture))  # raises on any problem


def test_judge_of_two_runs_with_broken_inputs_is_exit_4_before_any_replay(captures, tmp_path):
    """oracle judge on two captures of one step whose ids are past the vocabulary: its first replay
    meets the boundary, exit 4 naming inputs/input_ids, no report written."""
    import shutil

    a = captures["ids-past-the-vocabulary"]
    b = shutil.copytree(a, tmp_path / "b")
    res = CliRunner().invoke(app, ["judge", str(a), str(b), "--out", str(tmp_path / "j")])
    assert res.exit_code == 4 and "inputs/input_ids holds ids" in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "j").exists()
