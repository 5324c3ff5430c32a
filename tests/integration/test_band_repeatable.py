"""The noise band, and so the whole judge report, does not depend on the machine's state (issue 41, item 4).

Two streamed judges of the same captures on a loaded machine gave different band numbers (a member's band,
excess and spread; member 0 equal). The store of a streamed replay keeps activations in memory up to what
``--max-memory`` leaves after the process's measured resident set, and spills the rest: a loaded machine
spills other tensors. A spilled tensor came back contiguous, and the jitter of a member was drawn in memory
order (``empty_like``), so the same values laid out otherwise drew other jitter; under amp it came back as
real bf16 (safetensors saw the emulation's apparent dtype) and the backward failed. Now the draw is in the
elements' logical order, and a spilled tensor comes back bitwise in its dtype and layout."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from helpers import invoke

from oracle.precision.mode import PrecisionMode
from oracle.replay.streaming import driver
from oracle.replay.streaming.engine import parse_size
from oracle.replay.streaming.spill import ActivationStore


def test_a_members_jitter_does_not_depend_on_the_memory_layout():
    """The same values, row-major or transposed in memory: one jittered rounding, bitwise (was: other draws)."""
    x = torch.randn(96, 80, dtype=torch.float32)
    laid = x.t().contiguous().t()  # equal values, column-major storage
    assert torch.equal(x, laid) and not laid.is_contiguous()
    got = []
    for t in (x, laid):
        mode = PrecisionMode(torch.float32, torch.bfloat16, jitter_seed=1001)
        got.append(mode._round_values(t))
    assert torch.equal(got[0], got[1])
    assert not torch.equal(got[0], x.to(torch.bfloat16).to(torch.float32))  # the jitter moved some roundings


def test_a_spilled_activation_comes_back_in_its_dtype_and_layout_under_amp(tmp_path):
    """Under the amp emulation, a float32 tensor held "in bf16" and laid out column-major, spilled (budget 0) and
    taken back: float32, the same strides, bitwise (was: a real bf16 tensor, contiguous)."""
    mode = PrecisionMode(torch.float32, torch.bfloat16, ops="amp", jitter_seed=1001, device_type="cpu")
    with mode:
        x = torch.randn(64, 48).to(torch.bfloat16).to(torch.float32).t()
        mode.mark_low(x)
        store = ActivationStore(0, tmp_path)
        h = store.put([x])
        assert store.spilled_bytes > 0
        (y,) = store.take(h)
    assert y.dtype == torch.float32 and y.stride() == x.stride() and torch.equal(y, x)


def _comparable(doc):
    """A judge document without what differs between two honest runs: the time each stage took."""
    if isinstance(doc, dict):
        return {k: _comparable(v) for k, v in doc.items() if k not in ("seconds", "report_files")}
    if isinstance(doc, list):
        return [_comparable(v) for v in doc]
    return doc


def test_a_streamed_judge_rerun_on_a_loaded_machine_gives_the_same_report(amp_capture, tmp_path, monkeypatch):
    """`oracle judge A B --max-memory M --threads 2`, then its band replayed again where a loaded machine leaves
    the activations no memory (the measured resident set is the whole budget: every activation spilled): the band
    bitwise, judge.json equal but for timings, judge.txt byte for byte. M is derived from this process (issue 42):
    the floor a dry run at 1M names, plus 1 GiB of room (the first run keeps activations in memory)."""
    twin = shutil.copytree(amp_capture, tmp_path / "B")  # the same step in another folder (a folder judged against itself is refused)
    pair = ["judge", amp_capture, twin, "--name", "A", "--name", "B"]
    dry = invoke(*pair, "--dry-run", "--max-memory", "1M", "--threads", "2", "--out", tmp_path / "dry")
    floor = re.search(r"raise it to at least ([\d.]+)G", dry.output)
    assert dry.exit_code == 2 and floor, dry.output
    budget = f"{float(floor[1]) + 1:.1f}G"
    args = [*pair, "--max-memory", budget, "--threads", "2"]
    first = invoke(*args, "--out", tmp_path / "j1")
    assert first.exit_code == 0, first.output
    assert first.stdout.startswith("answer: A and B are one capture (byte-identical manifests"), first.stdout[:300]
    shutil.copytree(tmp_path / "j1", tmp_path / "j2")  # the truth reused; the band, score and report made again
    for p in ("band-amp-bf16", ".band-amp-bf16.key", "score.json", "report"):
        shutil.rmtree(tmp_path / "j2" / p) if (tmp_path / "j2" / p).is_dir() else (tmp_path / "j2" / p).unlink()
    reserve = {}
    need = driver.budgets.need
    monkeypatch.setattr(driver.budgets, "need", lambda *a, **k: reserve.update(need(*a, **k)) or dict(reserve))
    monkeypatch.setattr(driver, "rss_bytes", lambda: parse_size(budget) - reserve["bytes"] - (64 << 10))  # 64 KiB left
    second = invoke(*args, "--out", tmp_path / "j2")
    assert second.exit_code == 0, second.output
    from oracle.bundle.store import Bundle

    a, b = Bundle(tmp_path / "j1" / "band-amp-bf16"), Bundle(tmp_path / "j2" / "band-amp-bf16")
    assert b.get("streaming")["activations_spilled"] > a.get("streaming")["activations_spilled"]
    for g in a.member_groups():
        assert [n for n in a.names(g) if not torch.equal(a.load(g, n), b.load(g, n))] == [], g
    def read(j: str, name: str) -> str:  # the work folder's own path said as OUT
        return (tmp_path / j / "report" / name).read_text().replace(str(tmp_path / j), "OUT")

    docs = [json.loads(read(j, "judge.json")) for j in ("j1", "j2")]
    assert _comparable(docs[0]) == _comparable(docs[1])
    assert read("j1", "judge.txt") == read("j2", "judge.txt")


@pytest.fixture(autouse=True)
def _threads():
    """The judge sets the thread count it was given; the next test gets this one's back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
