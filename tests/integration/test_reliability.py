"""Nothing lost, nothing misread: output safety, the validated manifest, exact exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli import app
from oracle.bundle import atomic
from oracle.bundle.store import Bundle, BundleWriter, value_sha256
from oracle.errors import EXIT_CODES, BundleError, OracleError, OutputError, OutputExists, from_os_error

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def write(path, value=1.0, **kw):
    with BundleWriter(path, "capture", **kw) as w:
        w.manifest.update(recipe={"name": None, "config": {}}, loss={"value": value, "reduction": "mean", "num_tokens": 3})
        w.add("weights", {"a": torch.full((2, 3), value), "b": torch.ones(4, dtype=torch.bfloat16)})
        w.add("grads", {"a": torch.full((2, 3), -value), "b": torch.zeros(4, dtype=torch.bfloat16)})
        w.add("inputs", {"ids": torch.tensor([[1, 2, 3]])})
    return Path(path)


def value_of(path) -> float:
    return float(Bundle(path).load("weights", "a")[0, 0])


def leftovers(path: Path) -> list[str]:
    return [p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.")]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# -- output safety ----------------------------------------------------------------------------
def test_overwrite_never_replaces_a_folder_that_is_not_a_bundle(tmp_path):
    """A manifest.json of another tool, or a bundle folder holding the user's own files, is never replaced."""
    src = tmp_path / "project"
    src.mkdir()
    (src / "manifest.json").write_text('{"name": "my-app", "version": "1.0"}')
    (src / "main.py").write_text("print('mine')")
    with pytest.raises(OutputExists, match="not a bundle"):
        write(src, overwrite=True)
    b = write(tmp_path / "b")
    (b / "notes.txt").write_text("mine")
    with pytest.raises(OutputExists, match=r"not part of the bundle \(notes.txt\)"):
        write(b, 2.0, overwrite=True)
    assert (src / "main.py").read_text() == "print('mine')" and (b / "notes.txt").read_text() == "mine"
    assert value_of(b) == 1.0 and leftovers(src) == leftovers(b) == []


def test_a_folder_created_at_out_while_writing_is_never_replaced(tmp_path):
    """The existence check is repeated by the final move itself (rename without replace)."""
    for content in ([], ["precious.txt"]):
        out = tmp_path / f"out{len(content)}"
        with pytest.raises(OutputExists, match="created by someone else"):
            with BundleWriter(out, "capture") as w:
                w.add("grads", {"a": torch.ones(2)})
                out.mkdir()
                for f in content:
                    (out / f).write_text("keep")
        assert [p.name for p in out.iterdir()] == content and leftovers(out) == []


def test_two_writers_one_out_exactly_one_wins(tmp_path):
    """Two concurrent writers of one new --out: one bundle, one OutputExists, no temporaries."""
    out = tmp_path / "b"
    barrier, results = threading.Barrier(2), []

    def go(v):
        try:
            with BundleWriter(out, "capture") as w:
                w.add("grads", {"a": torch.full((3,), float(v))})
                barrier.wait()
            results.append("ok")
        except OutputExists:
            results.append("exists")

    threads = [threading.Thread(target=go, args=(v,)) for v in (1, 2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(results) == ["exists", "ok"] and leftovers(out) == []
    Bundle(out).load_group("grads")


def test_an_existing_output_is_refused_before_any_work(tmp_path):
    """replay, local replay and capture check --out first, not after the step (hours on a large model)."""
    from oracle.capture.steps import capture_recipe_step
    from oracle.replay.local import replay_local
    from oracle.replay.run import replay

    cap, out = write(tmp_path / "cap"), write(tmp_path / "out")
    for run in (lambda: replay(cap, out), lambda: replay_local(cap, out), lambda: capture_recipe_step(None, {}, str(out))):
        with pytest.raises(OutputExists, match="--overwrite"):
            run()  # a capture without a recipe or modules, and no model source: any work would fail otherwise


@pytest.mark.parametrize("native", [True, False], ids=["renameat2", "fallback"])
def test_overwrite_swaps_and_new_writes_do_not_replace(tmp_path, monkeypatch, native):
    """Both the renameat2 path and the portable fallback replace a bundle and refuse to clobber."""
    if not native:
        monkeypatch.setattr(atomic, "_renameat2", None)
    elif atomic._renameat2 is None:
        pytest.skip("renameat2 is not available on this platform")
    b = write(tmp_path / "b", 1.0)
    write(b, 2.0, overwrite=True)
    assert value_of(b) == 2.0 and leftovers(b) == []
    with pytest.raises(OutputExists, match="--overwrite"):
        write(b, 3.0)
    assert value_of(b) == 2.0


def test_overwrite_keeps_the_old_bundle_readable_until_the_new_one_is_complete(tmp_path):
    """A reader polling the name during many --overwrite writes always finds a complete bundle."""
    b = write(tmp_path / "b", 0.0)
    stop, seen, errors = threading.Event(), set(), []

    def read():
        while not stop.is_set():
            try:
                seen.add(value_of(b))
            except OracleError as e:  # files swapped between opening and loading: a hash mismatch, detected
                errors.append(str(e))

    t = threading.Thread(target=read)
    t.start()
    for v in range(1, 30):
        write(b, float(v), overwrite=True)
    stop.set()
    t.join()
    assert not [e for e in errors if "does not exist" in e or "missing" in e], errors[:3]
    assert value_of(b) == 29.0 and len(seen) > 1


def signed(final: Path, what: str, pid: int, host: str | None = None) -> Path:
    """A writer's folder name of ``final`` as this tool signs it, for writer ``pid``."""
    host, token = host or atomic._host(), "0123abcd"
    return final.with_name(f".{final.name}.{what}-{host}-{pid}-{token}-{atomic._sign(final.name, what, host, str(pid), token)}")


def test_a_displaced_old_bundle_is_moved_back_by_the_next_reader_or_named_when_it_cannot_be(tmp_path, monkeypatch):
    """NAME missing and its signed .NAME.old-* of a dead writer beside it: opening NAME restores it; where
    the move fails (a read-only folder) the error names the kept bundle and the mv that restores it."""
    b = write(tmp_path / "b", 7.0)
    old = signed(b, "old", dead_pid())
    os.rename(b, old)
    assert value_of(b) == 7.0 and leftovers(b) == []
    os.rename(b, old)
    monkeypatch.setattr(atomic, "rename2", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    monkeypatch.setattr(atomic.os, "rename", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    r = runner.invoke(app, ["score", str(b), str(b)])
    assert r.exit_code == 3 and f"mv '{old}' '{b}'" in r.output and "Traceback" not in r.output, r.output
    assert old.is_dir() and not b.exists()


def test_a_folder_named_like_ours_but_unsigned_is_never_touched(tmp_path):
    """Another program's .NAME.tmp-* / .NAME.old-* (no valid signature) is left and named, not removed or moved."""
    b = tmp_path / "b"
    forged = [b.with_name(f".b.tmp-{atomic._host()}-{dead_pid()}-0123abcd"),
              b.with_name(f".b.old-{atomic._host()}-{dead_pid()}-0123abcd-{'0' * 16}")]  # fmt: skip
    for d in forged:
        d.mkdir()
        (d / "theirs.txt").write_text("keep")
    r = runner.invoke(app, ["score", str(b), str(b)])
    assert r.exit_code == 3 and "does not exist" in r.output
    write(b)
    assert all((d / "theirs.txt").read_text() == "keep" for d in forged)


def test_stale_temporaries_of_dead_writers_are_removed_live_ones_kept(tmp_path):
    """The next writer into a folder removes every dead writer's signed temporary there (any name); one
    held by a live writer (its flock), or of another host, is kept."""
    dead = signed(tmp_path / "b", "tmp", dead_pid())
    dead_other = signed(tmp_path / "c", "claim", dead_pid())
    live = signed(tmp_path / "c", "tmp", os.getppid())
    other_host = signed(tmp_path / "b", "tmp", dead_pid(), host="elsewhere")
    for d in (dead, dead_other, live, other_host):
        d.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)", str(live)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        write(tmp_path / "b")
        assert not dead.exists() and not dead_other.exists() and live.exists() and other_host.exists()
    finally:
        holder.kill()
        holder.wait()


def test_scoring_a_temporary_says_what_it_is(tmp_path):
    """A killed writer's .NAME.tmp-* given as a bundle: exit 4 saying it is an unfinished temporary of NAME."""
    tmp = signed(tmp_path / "truth", "tmp", dead_pid())
    tmp.mkdir()
    (tmp / "grads.safetensors").write_bytes(b"")
    r = runner.invoke(app, ["score", str(tmp), str(tmp)])
    assert r.exit_code == 4 and "unfinished temporary folder of an oracle writer" in r.output and "no longer running" in r.output, r.output


@pytest.mark.parametrize("mask,dmode,fmode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640), (0o002, 0o775, 0o664)])
def test_permissions_follow_the_umask(tmp_path, mask, dmode, fmode):
    old = os.umask(mask)
    try:
        b = write(tmp_path / "b")
    finally:
        os.umask(old)
    assert b.stat().st_mode & 0o777 == dmode
    assert {p.name: p.stat().st_mode & 0o777 for p in b.iterdir()} == {p.name: fmode for p in b.iterdir()}


def test_tied_parameters_are_written(tmp_path):
    """Two names of one storage (tied embeddings on CPU) are stored as two equal tensors."""
    w = torch.randn(4, 3)
    with BundleWriter(tmp_path / "b", "capture") as bw:
        bw.add("weights", {"embed.weight": w, "lm_head.weight": w})
        bw.add("grads", {"embed.weight": w, "lm_head.weight": w})
    b = Bundle(tmp_path / "b")
    assert torch.equal(b.load("weights", "embed.weight"), b.load("weights", "lm_head.weight"))


def test_unwritable_output_is_exit_9_not_a_bug(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="cannot write the bundle"):
        write(tmp_path / "file" / "b")
    log = tmp_path / "norms.log"
    log.write_text("[DEBUG_GRAD_NORM][X] a.weight norm=1.5\n")
    r = runner.invoke(app, ["import-log", str(log), "--out", str(tmp_path / "file" / "b")])
    assert r.exit_code == 9 and "is a file, not a directory" in r.output and "Traceback" not in r.output
    assert from_os_error(OSError(28, "No space left on device", "x")).exit_code == 9
    assert from_os_error(PermissionError(13, "Permission denied", "y")).exit_code == 3


# -- the manifest ---------------------------------------------------------------------------
def edit_manifest(b: Path, fn) -> None:
    m = json.loads((b / "manifest.json").read_text())
    fn(m)
    (b / "manifest.json").write_text(json.dumps(m))


def test_every_wrongly_typed_field_is_named_at_once_exit_4(tmp_path):
    b = write(tmp_path / "b")

    def damage(m):
        m["tensors"]["grads"]["a"] = "x"
        del m["tensors"]["weights"]["b"]["dtype"]
        m["certificate"] = "fine"
        m["members"] = "x"
        m["recipe"] = "qwen3-vl"
        m["loss"]["num_tokens"] = True

    edit_manifest(b, damage)
    with pytest.raises(BundleError) as e:
        Bundle(b)
    for where in ("tensors.grads.a", "tensors.weights.b.dtype: missing", "certificate", "members", "recipe", "loss.num_tokens"):
        assert where in str(e.value), where
    assert "6 problem(s)" in str(e.value)
    r = runner.invoke(app, ["replay", str(b), "--out", str(tmp_path / "o")])
    assert r.exit_code == 4 and "Traceback" not in r.output


@pytest.mark.parametrize(
    "raw,message",
    [
        ('{"schema_version": 1, "schema_version": 1, "kind": "capture", "tensors": {}}', "duplicate key 'schema_version'"),
        ('{"schema_version": true, "kind": "capture", "tensors": {}}', "schema_version"),
        ("[" * 100_000 + "]" * 100_000, "nests too deeply"),
        (b'{"schema_version": 1, "kind": "capture\xff"}', "not UTF-8"),
        ('{"schema_version": 1, "kind": "capture", "tensors": {"grads": []}}', "tensors.grads"),
    ],
)
def test_malformed_manifests_are_refused(tmp_path, raw, message):
    b = write(tmp_path / "b")
    (b / "manifest.json").write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    with pytest.raises(BundleError, match=message):
        Bundle(b)


def test_symlinks_leaving_the_bundle_are_refused(tmp_path):
    b = write(tmp_path / "b")
    outside = tmp_path / "outside.safetensors"
    shutil.move(b / "grads.safetensors", outside)
    os.symlink(outside, b / "grads.safetensors")
    with pytest.raises(BundleError, match="symlink leading out of the bundle"):
        Bundle(b)
    os.remove(b / "grads.safetensors")
    shutil.copy(outside, b / "grads.safetensors")
    shutil.move(b / "manifest.json", tmp_path / "m.json")
    os.symlink(tmp_path / "m.json", b / "manifest.json")
    with pytest.raises(BundleError, match="symlink leading out"):
        Bundle(b)


def test_a_gradient_of_another_shape_than_its_weight_is_refused(tmp_path):
    with BundleWriter(tmp_path / "b", "capture") as w:
        w.add("weights", {"a": torch.ones(2, 3)})
        w.add("grads", {"a": torch.ones(3, 2)})
    with pytest.raises(BundleError, match=r"a \[3, 2\] \(weight \[2, 3\]\)"):
        Bundle(tmp_path / "b")


def _built_off_meta(monkeypatch) -> list[str]:
    """Every Qwen3-VL model built from here on off the meta device (the default device at build time); the
    shape checks build theirs on meta only, so a refused huge config leaves this list empty."""
    from oracle_replays.qwen3_vl.recipe import Qwen3VLRecipe

    built, build = [], Qwen3VLRecipe.build

    def counted(self, config):
        where = torch.empty(()).device.type
        if where != "meta":
            built.append(where)
        return build(self, config)

    monkeypatch.setattr(Qwen3VLRecipe, "build", counted)
    return built


def test_a_config_describing_a_huge_model_is_refused_before_building_it(tmp_path, monkeypatch):
    """hidden_size 1e6 would build ~22 GB; the meta-device check refuses it before any model is built off meta."""
    from oracle import recipe as recipes
    from oracle.bundle.shapes import expected_shapes
    from oracle.replay.run import run_step
    from oracle_replays.qwen3_vl.flavors import TINY

    r = recipes.get("qwen3-vl")
    b = tmp_path / "big"
    with BundleWriter(b, "capture") as w:  # a capture of the tiny model's shapes (values do not matter here)
        w.manifest.update(recipe={"name": "qwen3-vl", "config": TINY})
        shapes = expected_shapes(r, TINY)
        w.add("weights", {n: torch.zeros(s) for n, s in shapes.items()})
        w.add("grads", {n: torch.zeros(s) for n, s in list(shapes.items())[:1]})
        w.add("inputs", {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    edit_manifest(b, lambda m: m["recipe"]["config"]["text_config"].update(hidden_size=1_000_000))
    built = _built_off_meta(monkeypatch)
    with pytest.raises(BundleError, match=r"embed_tokens.weight: stored \[272, 64\], the recipe's model has \[272, 1000000\]"):
        run_step(Bundle(b), "fp64")
    assert built == []


def test_value_hash_in_slices_equals_the_hash_of_the_whole(monkeypatch):
    """value_sha256 upcasts a slice at a time; the digest is that of the whole upcast tensor."""
    import hashlib

    import oracle.bundle.store as bundle

    x = torch.randn(3, 1000).to(torch.bfloat16)
    whole = hashlib.sha256(json.dumps([3, 1000]).encode() + x.double().numpy().tobytes()).hexdigest()
    monkeypatch.setattr(bundle, "VALUE_SLICE", 7)
    monkeypatch.setattr(bundle, "HASH_SLICE", 13)
    assert value_sha256(x) == whole
    assert bundle.tensor_sha256(x) == hashlib.sha256(x.view(torch.int16).numpy().tobytes()).hexdigest()


def test_damaged_or_mismatched_model_files_exit_7(tmp_path, monkeypatch):
    """A garbage model.safetensors or index is a RecipeError; a checkpoint that does not fit its
    config.json is refused from the headers, before the model is built."""
    from safetensors.torch import save_file

    from oracle.bundle.weights import SafetensorsDir
    from oracle.capture.steps import capture_recipe_step
    from oracle.errors import RecipeError
    from oracle.recipe import ModelSource
    from oracle_replays.qwen3_vl.recipe import Qwen3VLRecipe

    (tmp_path / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(RecipeError, match="not a readable safetensors file"):
        SafetensorsDir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ["x"]}')
    with pytest.raises(RecipeError, match="not a safetensors index"):
        SafetensorsDir(tmp_path)
    os.remove(tmp_path / "model.safetensors.index.json")
    save_file({"lm_head.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    src = ModelSource(Qwen3VLRecipe(), {"model_type": "qwen3_vl", "text_config": {"hidden_size": 1_000_000}},
                      SafetensorsDir(tmp_path), origin=str(tmp_path))  # fmt: skip
    built = _built_off_meta(monkeypatch)
    with pytest.raises(RecipeError, match=r"lm_head.weight: stored \[3, 3\], the recipe's model has \[151936, 1000000\]"):
        capture_recipe_step(src, {}, str(tmp_path / "c"))
    assert built == [] and not (tmp_path / "c").exists()  # refused from the headers, before the model is built


def test_hashing_a_large_tensor_copies_none_of_it():
    """sha256 and value_sha256 of a 256 MiB tensor raise the peak by less than half its size (the
    whole-tensor copies before: +1028 MiB)."""
    code = (
        "import resource, torch; x = torch.randn(64 * 2**20); base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "from oracle.bundle.store import tensor_sha256, value_sha256; tensor_sha256(x); value_sha256(x)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert int(r.stdout) < 128, f"peak grew by {r.stdout.strip()} MiB"


# -- samples --------------------------------------------------------------------------------
def test_content_lists_read_as_the_string_form(source, sample):
    """The OpenAI/ms-swift list form and the <image>-tag form give the same token ids and pixels."""
    from oracle.capture.steps import build_model

    model = build_model(source.recipe, source.config, source.weights, torch.float32)
    ((user_i, user),) = [(i, m) for i, m in enumerate(sample["messages"]) if "<image>" in m["content"]]
    parts = [{"type": "image", "image": sample["images"][0]}, {"type": "text", "text": user["content"].replace("<image>", "")}]
    listed = dict(sample, images=[], messages=[*sample["messages"][:user_i], {"role": "user", "content": parts},
                                              *sample["messages"][user_i + 1 :]])  # fmt: skip
    a = source.recipe.prepare_inputs(source, model, sample)
    b = source.recipe.prepare_inputs(source, model, listed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "line,message",
    [
        (b'{"messages": ["hi"]}', "a message must be an object"),
        (b'{"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}]}', "part type 'video'"),
        (b'{"messages": [{"role": "user", "content": "\xff"}]}', "not UTF-8"),
        (
            b'{"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}], "images": ["t.txt"]}',
            "not an image PIL can decode",
        ),
        (
            b'{"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}], "images": ["big.png"]}',
            "too large to decode",
        ),
    ],
)
def test_bad_samples_and_images_exit_7(tmp_path, line, message):
    from PIL import Image

    (tmp_path / "t.txt").write_text("not an image")
    Image.new("1", (12000, 12000)).save(tmp_path / "big.png")  # 144 M pixels, a few KB on disk
    (tmp_path / "s.jsonl").write_bytes(line)
    r = runner.invoke(app, ["capture", "--out", str(tmp_path / "c"), "--sample", str(tmp_path / "s.jsonl")])
    assert r.exit_code == 7 and message in r.output and "Traceback" not in r.output, r.output


# -- cost -----------------------------------------------------------------------------------
def test_the_cli_starts_without_torch():
    """`oracle --help` and argument errors import neither torch nor transformers (0.15-0.3 s)."""
    code = "import sys, cli; bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


class _Counted(str):
    """A name that counts what is done with it: every comparison and hash (the work of any search or sort of names)."""

    ops = 0

    def __eq__(self, other):
        _Counted.ops += 1
        return str.__eq__(self, other)

    def __lt__(self, other):
        _Counted.ops += 1
        return str.__lt__(self, other)

    def __hash__(self):
        _Counted.ops += 1
        return str.__hash__(self)


def test_comparing_two_large_logs_is_not_quadratic():
    """compare() of two logs of N names, in opposite orders, compares or hashes names O(N log N) times, counted
    (a search of one list per name, the quadratic way, makes N^2 / 2 = 4.5e6 comparisons at N = 3000)."""
    from oracle.integrations.normlog import NormLog, compare

    n = 3000
    names = [_Counted(f"decoder.layers.{i // 10}.mlp.linear_fc{i % 10}.weight") for i in range(n)]
    a = NormLog("a", {n: 1.0 for n in names}, names)
    b = NormLog("b", {n: 2.0 for n in names}, names[::-1])
    _Counted.ops = 0
    r = compare(a, b)
    assert _Counted.ops <= 20 * n, _Counted.ops  # 12 log2(3000) = 139 per name would still pass; n / 2 = 1500 would not
    assert [p["name"] for p in r["params"]][:2] == [
        "decoder.layers.299.mlp.linear_fc0.weight",
        "decoder.layers.299.mlp.linear_fc1.weight",
    ]


# -- SIGKILL at random points, in a separate process --------------------------------------------
@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
def test_sigkill_during_capture_replay_and_merge_loses_nothing(tmp_path):
    """Every kill leaves the old bundle or the new one, complete; reruns succeed; no temporaries
    remain; two simultaneous writers of one name: one bundle and one exit 6."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "kill_worker.py"), str(tmp_path), "0"], env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    for kind in ("capture", "replay", "merge"):
        assert report[kind]["temporaries left"] == 0, report
        assert report[kind].get("killed in write", 0) >= 1, report  # some kills landed inside the write
    assert report["concurrent"] == {"exit codes": [0, 6], "temporaries left": 0}


def test_readme_tables_use_exactly_the_codes_of_errors_py():
    """README's exit-code table lists the codes of EXIT_CODES; docs/errors.md's bad-input table uses only those, never 1."""
    import re

    readme = (ROOT / "README.md").read_text()
    codes = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    bad = (ROOT / "docs" / "errors.md").read_text().split("# Bad inputs: what you see", 1)[1].split("\n# ", 1)[0]
    assert {int(c) for c in re.findall(r"^\| (\d+) \|", codes, re.M)} == set(EXIT_CODES)
    used = {int(c) for c in re.findall(r"\| (\d+) \|$", bad, re.M)}
    assert used and used <= set(EXIT_CODES) - {0, 1, 2}


# -- --overwrite killed at its worst moment, in a real process ---------------------------------
CHILD = """
import os, sys, time
from oracle.bundle import atomic
from oracle.replay.run import replay
cap, out, mark, path = sys.argv[1:5]
def stop():
    open(mark, "w").close()
    time.sleep(600)
if path == "fallback":
    atomic._renameat2 = None
    atomic._between_renames = stop
else:
    atomic._after_exchange = stop
replay(cap, out, overwrite=True)
"""


@pytest.mark.rare  # a rare path at many moments: .ci/run's `pytest tests -m rare` (tests/conftest.py)
@pytest.mark.parametrize("path", ["renameat2", "fallback"])
def test_overwrite_sigkilled_between_its_moves_keeps_the_old_bundle_or_the_new_one(fp32_capture, oracle_bundle, tmp_path, path):
    """`oracle replay --overwrite` SIGKILLed between the fallback's two renames (NAME absent), or after the
    exchange: `oracle score` then reads the old bundle (moved back) or the new one; a rerun of the replay
    leaves no temporaries and the bundle bitwise equal to an uninterrupted one."""
    if path == "renameat2" and atomic._renameat2 is None:
        pytest.skip("renameat2 is not available on this platform")
    truth = tmp_path / "truth"
    shutil.copytree(oracle_bundle, truth)
    before = (truth / "manifest.json").read_bytes()
    mark = tmp_path / "between"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(fp32_capture), str(truth), str(mark), path], env=env)
    try:
        t0 = time.time()
        while not mark.exists():
            assert child.poll() is None and time.time() - t0 < 300, "the child ended before the moment to kill it"
            time.sleep(0.02)
        child.kill()
    finally:
        child.wait()
    if path == "fallback":
        assert not truth.exists()  # the moment the issue describes: NAME absent, the old bundle aside
    r = runner.invoke(app, ["score", str(truth), str(fp32_capture)])
    assert r.exit_code == 0, r.output
    if path == "fallback":
        assert "was restored from" in r.output and (truth / "manifest.json").read_bytes() == before
    r = subprocess.run([sys.executable, "-m", "oracle", "replay", str(fp32_capture), "--out", str(truth), "--overwrite"],
                       env=env, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert leftovers(truth) == []
    a, b = Bundle(truth), Bundle(oracle_bundle)
    assert all(torch.equal(a.load("grads", n), b.load("grads", n)) for n in b.names("grads"))


def test_a_displaced_old_bundle_is_kept_when_its_name_now_holds_something_else(tmp_path):
    """A dead writer's .NAME.old-* beside a NAME that is not a bundle (a folder made since): kept and named, never deleted."""
    b = write(tmp_path / "b", 5.0)
    old = signed(b, "old", dead_pid())
    os.rename(b, old)
    b.mkdir()
    (b / "mine.txt").write_text("keep")
    write(tmp_path / "c")
    assert old.is_dir() and (b / "mine.txt").read_text() == "keep"
    assert json.loads((old / "manifest.json").read_text())["loss"]["value"] == 5.0
