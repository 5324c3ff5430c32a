"""The streamed replay's work folder is ours or untouched (issue 21, item 2): a `.OUT.partial` is
adopted only when its signed header names this step and command; every journal record is signed,
names a file of ours inside the folder, and is hash-checked; a bad one is where the run resumes
from (recomputed, never published); anything not ours is left in place and named, exit 6."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import invoke

from oracle.bundle.store import Bundle
from oracle.errors import OutputExists, UsageError
from oracle.replay.run import replay
from oracle.replay.streaming import journal, workdir

BUDGET = 8 << 30


class Stop(Exception):
    """Stands in for a kill after some units have finished their backward."""


@pytest.fixture(autouse=True)
def _own_key(tmp_path_factory, monkeypatch):
    """The signing key lives under this test session's cache folder, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setattr(workdir, "_KEY", None)


@pytest.fixture(scope="module")
def whole(fp32_capture, tmp_path_factory):
    """An uninterrupted streamed oracle (same process, same threads) to compare resumed ones with."""
    return str(replay(fp32_capture, tmp_path_factory.mktemp("whole") / "o", max_memory=BUDGET))


def interrupted(cap, out: Path, monkeypatch, units: int = 3) -> Path:
    """Run a streamed replay into ``out`` and stop it once ``units`` units are journalled; -> its work folder."""
    real = journal.Journal.write_unit
    count = {"n": 0}

    def stop_after(self, unit, grads):
        real(self, unit, grads)
        count["n"] += 1
        if count["n"] >= units:
            raise Stop

    monkeypatch.setattr(journal.Journal, "write_unit", stop_after)
    with pytest.raises(Exception) as e:
        replay(cap, out, max_memory=BUDGET)
    assert "Stop" in repr(e.value) or isinstance(e.value, Stop)
    monkeypatch.setattr(journal.Journal, "write_unit", real)
    work = out.parent / f".{out.name}.partial"
    assert len(workdir.valid_records(work, work / "grads")[0]) >= units
    return work


def assert_bitwise(a, b):
    ga, gb = Bundle(a), Bundle(b)
    assert ga.names("grads") == gb.names("grads")
    assert [n for n in ga.names("grads") if not torch.equal(ga.load("grads", n), gb.load("grads", n))] == []



def test_a_user_folder_named_like_the_work_folder_is_never_touched(fp32_capture, tmp_path):
    """`.o.partial` holding the user's file: exit 6 naming it, with or without --overwrite; nothing moved or deleted."""
    mine = tmp_path / ".o.partial"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        res = invoke("replay", fp32_capture, "--out", tmp_path / "o", "--max-memory", "8G", *extra)
        assert res.exit_code == 6 and ".o.partial" in res.output and "left as it is" in res.output, res.output
        assert sorted(os.listdir(mine)) == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"
    # a forged header (right fields, no valid signature) is not ours either
    (mine / "header.json").write_text(json.dumps({"made_by": workdir.MADE_BY, "nonce": "0", "mac": "0" * 64}))
    assert invoke("replay", fp32_capture, "--out", tmp_path / "o", "--max-memory", "8G").exit_code == 6
    assert (mine / "notes.txt").read_text() == "keep me" and not (tmp_path / "o").exists()


def test_a_work_folder_of_another_run_is_named_and_replaced_only_with_overwrite(fp32_capture, tmp_path, monkeypatch, whole):
    """Ours for --threads N, rerun with another count: exit 6 naming the field; --overwrite replaces it."""
    work = interrupted(fp32_capture, tmp_path / "o", monkeypatch)
    head = json.loads((work / "header.json").read_text())
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads + 1)
    try:
        with pytest.raises(OutputExists, match="another run .*threads"):
            replay(fp32_capture, tmp_path / "o", max_memory=BUDGET)
        assert json.loads((work / "header.json").read_text()) == head
    finally:
        torch.set_num_threads(torch_threads)
    torch.set_num_threads(torch_threads + 1)
    try:
        replay(fp32_capture, tmp_path / "o", max_memory=BUDGET, overwrite=True)
    finally:
        torch.set_num_threads(torch_threads)
    assert Bundle(tmp_path / "o").get("streaming")["resumed"] is False and not work.exists()


@pytest.fixture(scope="module")
def other_step(fp32_capture, tmp_path_factory):
    """The fp32 capture with one weight nudged: another step (another fingerprint), everything else the same."""
    from oracle.bundle.store import BundleWriter

    src = Bundle(fp32_capture)
    out = tmp_path_factory.mktemp("other-step") / "cap"
    with BundleWriter(out, "capture") as w:
        w.manifest.update({k: v for k, v in src.manifest.items() if k not in ("tensors", "schema_version", "kind", "fingerprint")})
        for group in src.groups():
            t = src.load_group(group)
            if group == "weights":
                name = sorted(t)[0]
                t[name] = t[name] + 1e-3
            w.add(group, t)
    assert Bundle(out).fingerprint() != src.fingerprint()
    return str(out)


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder``: a file's bytes, None for a folder."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def test_a_work_folder_of_another_step_is_kept_even_with_overwrite(fp32_capture, other_step, tmp_path, monkeypatch):
    """Issue 41: an interrupted streamed replay of one capture into o, then a replay of another step into o with
    --overwrite (library and CLI): exit 6 naming the folder as another step's, every byte of it kept; only a
    caller owning the folder around --out (the judge's stages: replace="any-ours") replaces it."""
    work = interrupted(fp32_capture, tmp_path / "o", monkeypatch)
    before = _tree(work)
    with pytest.raises(OutputExists, match=r"\.o\.partial exists and was left as it is: .*of a replay of another step"):
        replay(other_step, tmp_path / "o", max_memory=BUDGET, overwrite=True)
    assert _tree(work) == before and not (tmp_path / "o").exists()
    res = invoke("replay", other_step, "--out", tmp_path / "o", "--max-memory", "8G", "--overwrite")
    assert res.exit_code == 6 and "another step" in res.output and "delete it" in res.output, res.output
    assert _tree(work) == before and not (tmp_path / "o").exists()
    head = {k: v for k, v in json.loads((work / "header.json").read_text()).items() if k not in ("made_by", "nonce", "mac")}
    other = {**head, "fingerprint": json.dumps(Bundle(other_step).fingerprint(), sort_keys=True)}
    with pytest.raises(OutputExists, match="another step"):
        workdir.open_work(tmp_path / "o", other, overwrite=True)
    assert _tree(work) == before
    assert workdir.open_work(tmp_path / "o", other, replace="any-ours") == (work, False)
    assert sorted(os.listdir(work)) == ["header.json"]


@pytest.mark.parametrize("signed", [False, True], ids=["forged", "signed-with-our-key"])
def test_a_journal_record_naming_a_path_outside_moves_nothing(fp32_capture, tmp_path, monkeypatch, whole, signed):
    """A record naming ../x.safetensors (forged, or even carrying a valid MAC): the user's file stays where it is,
    the run resumes before that record and ends bitwise equal to an uninterrupted one."""
    work = interrupted(fp32_capture, tmp_path / "o", monkeypatch)
    victim = tmp_path / "x.safetensors"
    victim.write_bytes(b"user data")
    rec = {"kind": "unit", "unit": "model.language_model.layers.0", "file": "../../x.safetensors", "entries": {}, "sha256": {}}
    line = workdir.seal(work, rec) if signed else {**rec, "mac": "0" * 64}
    with open(work / "grads" / "journal.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    replay(fp32_capture, tmp_path / "o", max_memory=BUDGET)
    assert victim.read_bytes() == b"user data"
    assert_bitwise(tmp_path / "o", whole)
    st = Bundle(tmp_path / "o").get("streaming")
    assert st["resumed"] is True and any("record" in n for n in st["recomputed"])


@pytest.mark.parametrize("damage", ["missing-shard", "flipped-shard", "truncated-gin", "garbled-journal", "duplicated-record"])
def test_a_damaged_work_file_is_recomputed_never_published(fp32_capture, tmp_path, monkeypatch, whole, damage):
    """A shard deleted or bit-flipped, an input-gradient file truncated, a journal line garbled or a unit's record
    written twice (issue 41: was a traceback, 'grads-00001.safetensors written twice'): the rerun exits 0 with no
    traceback, names what it recomputed, and its oracle is bitwise the uninterrupted one."""
    work = interrupted(fp32_capture, tmp_path / "o", monkeypatch, units=4)
    member = work / "grads"
    shards = sorted(member.glob("shard-*.safetensors"))
    gins = sorted(member.glob("gin-*.safetensors"))
    if damage == "missing-shard":
        shards[1].unlink()
    elif damage == "flipped-shard":
        raw = bytearray(shards[1].read_bytes())
        raw[-3] ^= 0x40
        shards[1].write_bytes(bytes(raw))
    elif damage == "truncated-gin":
        assert gins, "no input-gradient file was journalled"
        gins[0].write_bytes(gins[0].read_bytes()[:40])
    elif damage == "garbled-journal":
        lines = (member / "journal.jsonl").read_text().splitlines()
        lines[1] = lines[1].replace('"unit"', '"unlt"', 1)
        (member / "journal.jsonl").write_text("\n".join(lines) + "\n")
    else:  # the first unit's record again (signed: a copied line), after the others
        lines = (member / "journal.jsonl").read_text().splitlines()
        first = next(ln for ln in lines if json.loads(ln)["kind"] == "unit")
        (member / "journal.jsonl").write_text("\n".join([*lines, first]) + "\n")
    res = invoke("replay", fp32_capture, "--out", tmp_path / "o", "--max-memory", "8G", "--threads", torch.get_num_threads())
    assert res.exit_code == 0, res.output
    assert "recomputing from there" in res.output, res.output
    assert_bitwise(tmp_path / "o", whole)
    Bundle(tmp_path / "o").load_group("grads")  # every published hash holds


def test_a_damaged_input_gradient_file_before_a_drop_recomputes_what_it_needs(fp32_capture, tmp_path, monkeypatch, whole):
    """An input-gradient file truncated where a later record dropped a finished unit's (layers.1's file, then
    layers.2's dropped): the journal cut there names layers.2 finished without its input gradients, so it is
    recomputed, and so is layers.3, whose gradients to layers.2 were dropped before the cut (was: zeros
    handed to layers.2, 80 of 104 gradients zero); the oracle is bitwise the uninterrupted one."""
    work = interrupted(fp32_capture, tmp_path / "o", monkeypatch, units=8)
    member = work / "grads"
    recs = [json.loads(ln) for ln in (member / "journal.jsonl").read_text().splitlines()]
    finished = {r["unit"]: k for k, r in enumerate(recs) if r["kind"] == "unit"}
    # the first call record whose file is still there and after which a unit finished before it lost its file
    at = next(k for k, r in enumerate(recs) if r["kind"] == "call" and (member / r["file"]).is_file()
              and any(d["kind"] == "drop" and finished.get(d["unit"], k) < k for d in recs[k + 1:]))  # fmt: skip
    (member / recs[at]["file"]).write_bytes((member / recs[at]["file"]).read_bytes()[:40])
    res = invoke("replay", fp32_capture, "--out", tmp_path / "o", "--max-memory", "8G", "--threads", torch.get_num_threads())
    assert res.exit_code == 0, res.output
    assert f"journal record {at + 1} {recs[at]['file']}" in res.output, res.output
    assert_bitwise(tmp_path / "o", whole)


def test_a_decoder_layer_call_records_every_unit_call_feeding_it(fp32_capture, tmp_path, monkeypatch):
    """The forward's walk of the glue finds each unit call an input comes from: the vision merger into layers.0,
    the deepstack mergers into layers.1 and layers.2 (added to the hidden states between layers), and the
    position table (a resident parameter) behind the first block's input, whose gradient is then never
    dropped. On torch 2.8 the walk stopped at its first node (a freed node's id reused: seen) and found only
    the layer before, so a layer's input gradients were dropped before the merger they also feed."""
    from oracle.replay.streaming import engine

    traced = {}
    real = engine.StreamEngine._trace

    def spy(self, call, tensors):
        real(self, call, tensors)
        traced[call.unit, call.index] = ({u for u, _ in call.producers}, call.keep)

    monkeypatch.setattr(engine.StreamEngine, "_trace", spy)
    replay(fp32_capture, tmp_path / "o", max_memory=BUDGET)
    text, vision = "model.language_model.", "model.visual."
    assert traced[text + "layers.0", 0] == ({text + "embed_tokens", vision + "merger"}, False)
    assert traced[text + "layers.1", 0] == ({text + "layers.0", vision + "deepstack_merger_list.0"}, False)
    assert traced[text + "layers.2", 0] == ({text + "layers.1", vision + "deepstack_merger_list.1"}, False)
    assert traced[vision + "blocks.0", 0] == ({vision + "patch_embed"}, True)


def test_a_replay_refused_for_its_budget_leaves_no_work_folder(fp32_capture, tmp_path):
    """--max-memory below one unit: exit 2, no `.o.partial`; the next run is not '(resumed)' (issue 20 papercut)."""
    with pytest.raises(UsageError, match="--max-memory"):
        replay(fp32_capture, tmp_path / "o", max_memory=1 << 20)
    assert not (tmp_path / ".o.partial").exists()
    res = invoke("replay", fp32_capture, "--out", tmp_path / "o", "--max-memory", "8G")
    assert res.exit_code == 0 and "(resumed)" not in res.output, res.output


def test_symlinks_planted_in_a_work_folder_are_never_written_through(fp32_capture, tmp_path, monkeypatch, whole):
    """A killed run's folder with symlinks at the names its rerun writes (every next shard's and input gradient's
    temporary, the end record, the spilled activations' files) pointing at a user's file (issue 41: written
    through, into the folder they point at): the user's file stays as it was; the rerun's oracle is bitwise."""
    work = interrupted(fp32_capture, tmp_path / "o", monkeypatch)
    member = work / "grads"
    victim = tmp_path / "victim.txt"
    victim.write_text("user data")
    n = len(list(member.glob("shard-*.safetensors")))
    planted = [member / f"shard-{k:05d}.tmp" for k in range(n + 1, n + 40)] + [member / "end.json"]
    planted += [member / f"gin-{journal._slug(u)}-0.tmp" for u in ("model.language_model.layers.0", "model.visual.merger")]
    (work / "grads.spill").mkdir(exist_ok=True)
    planted += [work / "grads.spill" / f"act-{k}.safetensors" for k in range(60)]
    for p in planted:
        p.symlink_to(victim)
    res = invoke("replay", fp32_capture, "--out", tmp_path / "o", "--max-memory", "8G", "--threads", torch.get_num_threads())
    assert res.exit_code == 0, res.output
    assert victim.read_text() == "user data"
    assert_bitwise(tmp_path / "o", whole)
