"""Fuzzing the boundaries: manifests, safetensors headers, truncated files, samples.

The property everywhere: a damaged input is refused with an OracleError (a documented exit code,
never 1), or, if accepted, every tensor loaded from it is bit-identical to what was written. No
other exception escapes. Examples are bounded and derandomised so that CI runs are repeatable.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.control import event as _event
from typer.testing import CliRunner

from cli import app
from oracle.bundle.store import Bundle, BundleWriter
from oracle.errors import EXIT_CODES, BundleError, OracleError

pytestmark = pytest.mark.rare  # a fuzzer: .ci/run's `pytest tests -m rare` (tests/conftest.py)

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
TENSORS = {
    "weights": {"w.a": torch.arange(6, dtype=torch.float32).view(2, 3), "w.b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)},
    "grads": {"g.a": torch.full((2, 3), 0.25), "g.b": torch.tensor([3.0, 4.0], dtype=torch.bfloat16), "g.s": torch.tensor(7.0)},
    "inputs": {
        "ids": torch.tensor([[1, 2, 3]]),
        "mask": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    },
}
ORIGINAL = {n: t for group in TENSORS.values() for n, t in group.items()}
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)


def event(what: str) -> None:
    """Counted in --hypothesis-show-statistics (how many inputs were refused or read)."""
    if currently_in_test_context():
        _event(what)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    with BundleWriter(root / "b", "capture") as w:
        w.manifest.update(recipe={"name": None, "config": {}}, precision="fp32", loss={"value": 1.0, "reduction": "mean"})
        for group, tensors in TENSORS.items():
            w.add(group, tensors)
    return root / "b"


def verdict(path: Path) -> str:
    """'refused' (an OracleError with a documented code other than 1) or 'accepted' (all tensors exact)."""
    try:
        b = Bundle(path)
        got = {n: b.load(g, n) for g in b.groups() for n in b.names(g)}
    except OracleError as e:
        assert e.exit_code in EXIT_CODES and e.exit_code not in (0, 1, 2), e
        event(f"refused, exit {e.exit_code}")
        return "refused"
    for n, t in got.items():
        assert n in ORIGINAL and t.dtype == ORIGINAL[n].dtype and torch.equal(t, ORIGINAL[n]), f"accepted a wrong {n}"
    event("accepted")
    return "accepted"


@pytest.fixture
def work(small, tmp_path) -> Path:
    shutil.copytree(small, tmp_path / "b")
    return tmp_path / "b"


def _paths(tree, prefix=()):
    yield prefix
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _paths(v, (*prefix, i))


def _mutate(tree, path, op, value):
    """Set, delete or rename the node at ``path`` of a JSON tree (in place on a copy)."""
    if not path:
        return value
    parent = tree
    for k in path[:-1]:
        parent = parent[k]
    last = path[-1]
    if op == "set":
        parent[last] = value
    elif op == "delete":
        del parent[last]
    elif op == "rename" and isinstance(parent, dict):
        parent[str(value)[:12]] = parent.pop(last)
    return tree


mutation = st.tuples(st.integers(0, 10**6), st.sampled_from(["set", "delete", "rename"]), JSON)


@FUZZ
@given(mutations=st.lists(mutation, min_size=1, max_size=3))
def test_fuzzed_manifests_are_refused_or_read_exactly(work, small, mutations):
    m = json.loads((small / "manifest.json").read_text())
    for pick, op, value in mutations:
        paths = list(_paths(m))
        m = _mutate(copy.deepcopy(m), paths[pick % len(paths)], op, value)
    (work / "manifest.json").write_text(json.dumps(m))
    verdict(work)


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4),
       target=st.sampled_from(["manifest.json", "weights.safetensors", "grads.safetensors", "inputs.safetensors"]))  # fmt: skip
def test_bit_flips_anywhere_are_refused_or_harmless(work, small, flips, target):
    raw = bytearray((small / target).read_bytes())
    for pos, mask in flips:
        raw[pos % len(raw)] ^= mask
    (work / target).write_bytes(bytes(raw))
    if verdict(work) == "accepted":  # only a flip in JSON whitespace or a field the tensors do not depend on
        assert target == "manifest.json"


@FUZZ
@given(pick=st.integers(0, 10**6), op=st.sampled_from(["set", "delete", "rename"]), value=JSON,
       target=st.sampled_from(["weights.safetensors", "grads.safetensors", "inputs.safetensors"]))  # fmt: skip
def test_fuzzed_safetensors_headers_are_refused_or_read_exactly(work, small, pick, op, value, target):
    raw = (small / target).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    paths = list(_paths(header))
    header = _mutate(copy.deepcopy(header), paths[pick % len(paths)], op, value)
    new = json.dumps(header).encode()
    (work / target).write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])
    verdict(work)


def test_truncation_at_every_offset_is_refused(work, small):
    """Every proper prefix of every file of a small bundle is refused (exit 4), never read."""
    for f in sorted(p.name for p in small.iterdir()):
        raw = (small / f).read_bytes()
        for cut in reversed(range(len(raw))):  # shortening in place: rewriting a file is ~100x slower here
            os.truncate(work / f, cut)
            assert verdict(work) == "refused", (f, cut)
        (work / f).write_bytes(raw)
    assert verdict(work) == "accepted"


def test_fuzzed_bundles_through_the_cli_exit_with_documented_codes(work, small, tmp_path):
    """No traceback and no exit 1 from `oracle replay` / `oracle score` on damaged bundles."""
    runner = CliRunner()
    raw = (small / "manifest.json").read_bytes()
    for cut in (0, 1, len(raw) // 2, len(raw) - 1):
        (work / "manifest.json").write_bytes(raw[:cut])
        for args in (["replay", str(work), "--out", str(tmp_path / "o")], ["score", str(work), str(work)]):
            r = runner.invoke(app, args)
            assert r.exit_code == 4 and "Traceback" not in r.output, r.output


# -- samples ------------------------------------------------------------------------------------
# Mostly well-formed samples (so that many are read), with every kind of damage mixed in.
GOOD_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=12)}),
    st.fixed_dictionaries({"type": st.just("image"), "image": st.just("a.png")}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.sampled_from([{"url": "a.png"}, "a.png"])}),
)
BAD_PART = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image", "video", "audio"]), "image": st.sampled_from(["missing.png", "t.txt", "", "data:x"])}
    ),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.sampled_from([{}, 3, {"url": None}])}),
    JSON,
)
PART = st.one_of(GOOD_PART, GOOD_PART, GOOD_PART, BAD_PART)
CONTENT = st.one_of(st.text(max_size=20), st.sampled_from(["<image>hi", "<image><image>x", "y"]), st.lists(PART, max_size=3),
                    st.lists(GOOD_PART, min_size=1, max_size=3), JSON)  # fmt: skip
ROLE = st.sampled_from(["system", "user", "user", "assistant", "assistant", "tool", 3, None])
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": ROLE, "content": CONTENT}), st.fixed_dictionaries({"role": ROLE, "content": CONTENT}), JSON
)
ANSWER = {"role": "assistant", "content": "ok"}
IMAGES = st.one_of(st.lists(st.sampled_from(["a.png", "a.png", "t.txt", "no.png", 5, {"path": "a.png"}]), max_size=2), JSON)
SAMPLE = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, min_size=1, max_size=3).map(lambda ms: [*ms, ANSWER])}, optional={"images": IMAGES}),
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=3)}, optional={"images": IMAGES}),
    JSON,
)  # fmt: skip


@pytest.fixture(scope="module")
def step(source, tmp_path_factory):
    from PIL import Image

    from oracle.capture.steps import build_model

    d = tmp_path_factory.mktemp("samples")
    Image.new("RGB", (40, 30), (10, 200, 30)).save(d / "a.png")
    (d / "t.txt").write_text("not an image")
    return d, build_model(source.recipe, source.config, source.weights, torch.float32)


@settings(FUZZ, max_examples=150)
@given(sample=SAMPLE, raw=st.one_of(st.none(), st.none(), st.none(), st.binary(max_size=40)))
def test_fuzzed_samples_are_read_or_refused_with_exit_3_or_7(source, step, sample, raw):
    from oracle.capture.samples import read_sample

    d, model = step
    line = raw if raw is not None else json.dumps(sample).encode()
    (d / "s.jsonl").write_bytes(line.replace(b"\n", b" ") or b"{}")
    try:
        inputs = source.recipe.prepare_inputs(source, model, read_sample(str(d / "s.jsonl")))
    except OracleError as e:
        assert e.exit_code in (3, 7), e
        event(f"refused, exit {e.exit_code}")
        return
    event("read")
    assert inputs["input_ids"].shape == inputs["labels"].shape and inputs["input_ids"].shape[0] == 1


# -- issue 21: packed boundaries, work folders, option values, patterns, coverage ----------------
@FUZZ
@given(cu=st.one_of(st.lists(st.integers(-3, 14), max_size=6), st.lists(st.floats(-2, 14), min_size=1, max_size=4)),
       restart=st.sets(st.integers(1, 11), max_size=3), rows=st.sampled_from([1, 2]))  # fmt: skip
def test_fuzzed_cu_seqlens_are_validated_or_refused_with_exit_4(cu, restart, rows):
    """Any cu_seqlens with any positions: accepted only if it starts at 0, increases, ends at B x T, has every
    row start, and agrees with the restarting positions (or they never restart); else BundleError, exit 4."""
    from oracle.capture.packing import check_boundaries
    from oracle.errors import BundleError

    T = 12
    pos = torch.arange(T)
    for r in sorted(restart):
        pos[r:] = torch.arange(T - r)
    inputs = {"input_ids": torch.zeros(rows, T, dtype=torch.int64), "position_ids": pos.expand(rows, T).contiguous(),
              "cu_seqlens": torch.tensor(cu)}  # fmt: skip
    try:
        got = check_boundaries(inputs, "fuzz")
    except BundleError as e:
        assert e.exit_code == 4 and "cu_seqlens" in str(e)
        event("refused, exit 4")
        return
    event("accepted")
    starts = {0} | {i * T + r for i in range(rows) for r in restart}
    assert got[0] == 0 and got[-1] == rows * T and all(b > a for a, b in zip(got, got[1:]))
    assert set(got[:-1]) == starts or not restart


@FUZZ
@given(lines=st.lists(st.one_of(
    st.binary(max_size=30).map(lambda b: b.decode("latin-1")),
    st.fixed_dictionaries({"kind": st.sampled_from(["unit", "call", "x"]), "unit": st.just("u"), "index": st.just(0),
                           "file": st.sampled_from(["../x.safetensors", "/etc/passwd", "shard-00001.safetensors",
                                                    "shard-00009.safetensors", "link.safetensors", "gin-0123456789ab-0.safetensors"]),
                           "entries": st.just({}), "sha256": st.one_of(st.just({}), JSON)},
                          optional={"mac": st.text(max_size=64)}).map(json.dumps),
), max_size=4), sign=st.booleans())  # fmt: skip
def test_fuzzed_journals_adopt_only_our_files_and_touch_nothing_outside(tmp_path_factory, lines, sign):
    """Whatever the journal says (forged, signed with our key, garbled): only regular files of ours inside
    the member folder that match their hashes are adopted; the file outside is never moved or changed."""
    from oracle.replay.streaming import journal, workdir

    root = tmp_path_factory.mktemp("journal")
    (root / "x.safetensors").write_bytes(b"user data")
    work, adopted = workdir.open_work(root / "o", {"fingerprint": "f"})
    j = journal.Journal(work, "grads")
    j.write_unit("u", {"a": torch.ones(3)})
    (work / "grads" / "link.safetensors").symlink_to(root / "x.safetensors")
    with open(work / "grads" / "journal.jsonl", "a") as f:
        for line in lines:
            if sign and line.startswith("{"):
                line = json.dumps(workdir.seal(work, {k: v for k, v in json.loads(line).items() if k != "mac"}))
            f.write(line.replace("\n", " ") + "\n")
    recs, _ = workdir.valid_records(work, work / "grads")
    assert recs and recs[0]["file"] == "shard-00001.safetensors"
    for rec in recs:
        p = work / "grads" / rec["file"]
        assert workdir.FILE_NAME.fullmatch(rec["file"]) and p.is_file() and not p.is_symlink()
    assert (root / "x.safetensors").read_bytes() == b"user data"
    assert workdir.open_work(root / "o", {"fingerprint": "f"})[1] is True  # still ours
    event(f"{len(recs)} record(s) adopted")


@FUZZ
@given(memory=st.one_of(st.sampled_from(["inf", "1e400", "nan", "-inf", "1e19G", "0x10", "", " ", "1e-400"]),
                        st.text(alphabet="0123456789.eE+-KMGTinfa ", max_size=8)),
       margin=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([float("inf"), float("nan"), 0.0, 1.0])))  # fmt: skip
def test_fuzzed_option_values_exit_with_documented_codes(small, memory, margin):
    """--max-memory and --margin of any value: a usage error (2) or the command's own outcome, never exit 1."""
    from oracle.replay.streaming.engine import parse_size
    from oracle.score.tolerance import check_margin

    for fn, value in ((parse_size, memory), (check_margin, margin)):
        try:
            got = fn(value)
        except OracleError as e:
            assert e.exit_code == 2, e
            event("refused, exit 2")
            continue
        assert got > 0 and got < float("inf")
        event("accepted")
    r = CliRunner().invoke(app, ["score", str(small), str(small), "--margin", repr(margin)])
    assert r.exit_code in (2, 4) and "Traceback" not in r.output, r.output


@settings(FUZZ, max_examples=60)
@given(pattern=st.text(alphabet="()[]{}+*?|.^$\\adws0-9,<>P=:!", max_size=24).map(lambda p: f"(?P<name>{p})=(?P<value>\\S+)"))
def test_fuzzed_patterns_parse_or_exit_8_within_the_time_guard(tmp_path_factory, monkeypatch, pattern):
    """Any --pattern: lines parsed, or LogParseError (exit 8) when the guard stops it; never another exception."""
    from oracle.integrations import normlog

    monkeypatch.setattr(normlog, "PATTERN_LINE_SECONDS", 0.05)
    log = tmp_path_factory.mktemp("log") / "x.log"
    log.write_text("a.weight=1.5\n" + "a" * 40 + "b=2\n((((x=3\n")
    try:
        normlog.parse(log, pattern=pattern)
        event("parsed")
    except OracleError as e:
        assert e.exit_code == 8, e
        event("refused, exit 8")


@settings(FUZZ, max_examples=12)
@given(keep=st.lists(st.booleans(), min_size=1, max_size=200), extra=st.booleans())
def test_no_within_noise_for_gradients_not_checked(fp32_capture, oracle_bundle, tmp_path_factory, keep, extra):
    """A capture holding any proper subset of the oracle's gradients (plus maybe a foreign one) is never
    within_noise: it is incomplete, and its coverage names exactly what is missing."""
    from oracle.score.scorer import score

    src = Bundle(fp32_capture)
    names = src.names("grads")
    held = [n for i, n in enumerate(names) if keep[i % len(keep)]]
    if len(held) == len(names):
        held = held[1:]
    dst = tmp_path_factory.mktemp("subset") / "c"
    with BundleWriter(dst, "capture") as w:
        w.manifest.update({k: v for k, v in src.manifest.items() if k not in ("tensors", "schema_version", "kind")})
        for group in src.groups():
            tensors = src.load_group(group)
            if group == "grads":
                tensors = {n: tensors[n] for n in held} | ({"foreign.weight": torch.ones(2)} if extra else {})
            w.add(group, tensors)
    if not held and not extra:  # no gradient at all: refused at the boundary (exit 4), never scored
        with pytest.raises(BundleError, match="a capture needs its gradients"):
            score(oracle_bundle, [dst])
        event("no gradients, exit 4")
        return
    c = score(oracle_bundle, [dst])["captures"][0]
    assert c["verdict"]["class"] == "incomplete"
    assert sorted(c["coverage"]["missing"]) == sorted(set(names) - set(held))
    assert c["coverage"]["extra"] == (["foreign.weight"] if extra else [])
    event(f"incomplete, {len(held)} of {len(names)}")
