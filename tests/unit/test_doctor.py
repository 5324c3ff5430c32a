"""oracle doctor's answer, in process (the start-up hook's probe stubbed: tests/integration/test_install.py runs
it for real): what it calls NOT READY (exit 12), what it answers ready with something left to do, and the
bad values it refuses with a usage error instead of a traceback."""

from __future__ import annotations

import json
import os
import shutil
from collections import namedtuple

import pytest

from oracle.integrations.megatron import config_source, doctor

TINY_8B = {"model_type": "qwen3_vl", "tie_word_embeddings": False,
           "text_config": {"head_dim": 128, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
                           "num_hidden_layers": 36, "num_key_value_heads": 8, "vocab_size": 151936},
           "vision_config": {"depth": 27, "hidden_size": 1152, "out_hidden_size": 4096}}  # fmt: skip


@pytest.fixture(autouse=True)
def hook_fires(monkeypatch):
    monkeypatch.setattr(doctor, "hook_fires", lambda env=None: {"fired": True, "module": doctor.__file__, "stderr": ""})
    monkeypatch.setattr(doctor, "package_versions", lambda: {d: "1.0" for d, _ in doctor.PACKAGES})


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = doctor.main(list(argv), prog="oracle doctor")
    out = capsys.readouterr()
    return code, out.out, out.err


def test_no_folder_and_no_variable_is_not_ready(monkeypatch, capsys):
    """Neither DIR nor ORACLE_CAPTURE: nothing would be captured: exit 12 with the fix."""
    monkeypatch.delenv("ORACLE_CAPTURE", raising=False)
    code, out, _ = _run(capsys)
    assert code == 12, out
    assert "ORACLE_CAPTURE is not set and no DIR was given: nothing would be captured" in out
    assert "start the training with ORACLE_CAPTURE=DIR" in out


def test_a_folder_without_the_variable_is_ready_with_the_variable_to_set(monkeypatch, capsys, tmp_path):
    """DIR given, ORACLE_CAPTURE unset in this shell: ready, and the answer names the exact variable to set."""
    monkeypatch.delenv("ORACLE_CAPTURE", raising=False)
    code, out, _ = _run(capsys, str(tmp_path))
    assert code == 0, out
    assert "ready, with 2 thing(s) to do or check:" in out
    assert f"ORACLE_CAPTURE is not set in this shell: start the training with ORACLE_CAPTURE={tmp_path}" in out


def test_a_missing_folder_is_said_to_be_made_and_a_missing_parent_is_not_ready(monkeypatch, capsys, tmp_path):
    """A folder not there yet: ready, saying the first rank makes it (a typo shows); its parent missing too: exit 12;
    neither check leaves a folder behind."""
    monkeypatch.setenv("ORACLE_CAPTURE", str(tmp_path / "h20-step"))
    code, out, _ = _run(capsys)
    assert code == 0 and f"{tmp_path / 'h20-step'} does not exist yet: the first rank makes it" in out, out
    typo = tmp_path / "shraed" / "h20-step"
    monkeypatch.setenv("ORACLE_CAPTURE", str(typo))
    code, out, _ = _run(capsys)
    assert code == 12 and f"{typo}: neither it nor its parent {typo.parent} exists (a typo?)" in out, out
    assert f"mkdir -p {typo}" in out and os.listdir(tmp_path) == []


def test_too_little_space_for_a_nodes_ranks_is_not_ready(monkeypatch, capsys, tmp_path):
    """8B at TP 8 and 65536 tokens: 17.91 GiB per rank, 143.28 GiB for 8 ranks; 65.9 GiB free is NOT READY (exit 12),
    enough for one rank (--ranks 1) is ready."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_8B))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda p: usage(2**40, 0, int(65.9 * 2**30)))
    monkeypatch.setenv("ORACLE_CAPTURE", str(tmp_path))
    code, out, _ = _run(capsys, "--hf-config", str(cfg), "--tp", "8", "--tokens", "65536")
    assert code == 12, out
    assert f"{tmp_path}: 65.9 GiB free, 8 rank(s) write 143.28 GiB (17.91 GiB each, pre + post)" in out
    code, out, _ = _run(capsys, "--hf-config", str(cfg), "--tp", "8", "--tokens", "65536", "--ranks", "1")
    assert code == 0 and out.rstrip().endswith("ready: ORACLE_CAPTURE will capture in this environment"), out


def test_the_probe_file_never_touches_a_users_file(tmp_path):
    """A user's files named as the old probe was (.oracle-doctor-PID) and as the new one's prefix stay, byte for byte."""
    mine = [tmp_path / f".oracle-doctor-{os.getpid()}", tmp_path / ".oracle-doctor-probe-x"]
    for i, p in enumerate(mine):
        p.write_text(f"mine {i}")
    problem, line, _ = doctor.check_folder(str(tmp_path))
    assert problem is None and "writable" in line
    assert [p.read_text() for p in mine] == ["mine 0", "mine 1"] and sorted(os.listdir(tmp_path)) == sorted(p.name for p in mine)


def test_bad_values_are_said_not_raised(monkeypatch, capsys, tmp_path):
    """A 300-character folder name is NOT READY with the reason; a 400-digit --tokens and an --hf-config holding a
    JSON list are usage errors (exit 2) naming the option; a missing config is exit 3: never a traceback."""
    monkeypatch.setenv("ORACLE_CAPTURE", str(tmp_path / ("a" * 300)))
    code, out, _ = _run(capsys)
    assert code == 12 and "cannot be written (File name too long)" in out, out
    (tmp_path / "list.json").write_text("[1, 2]")
    code, _, err = _run(capsys, str(tmp_path), "--hf-config", str(tmp_path / "list.json"))
    assert code == 2 and "holds a JSON list, not a config object" in err, err
    code, _, err = _run(capsys, str(tmp_path), "--hf-config", str(tmp_path / "list.json"), "--tokens", "9" * 400)
    assert code == 2 and "--tokens 999999999999... (400 digits): expected a whole number >= 1" in err, err
    code, _, err = _run(capsys, str(tmp_path), "--hf-config", str(tmp_path / "none.json"))
    assert code == 3 and "none.json" in err, err
    (tmp_path / "bogus.json").write_text('{"foo": 1}')  # a JSON object that is no model's config (a manifest, a typo'd file)
    code, out, err = _run(capsys, str(tmp_path), "--hf-config", str(tmp_path / "bogus.json"))
    assert code == 2 and "names no model's shape (no hidden_size, num_hidden_layers" in err and "GiB per bundle" not in out, err


def test_a_model_id_is_found_in_the_local_caches_offline(tmp_path):
    """--hf-config Qwen/Qwen3-VL-8B-Instruct: the snapshot refs/main names in $HF_HOME/hub, else the ModelScope
    cache's copy; where it came from is said; not found names every place looked in."""
    mid = "Qwen/Qwen3-VL-8B-Instruct"
    repo = tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-VL-8B-Instruct"
    for rev in ("old", "abc123"):
        (repo / "snapshots" / rev).mkdir(parents=True)
        (repo / "snapshots" / rev / "config.json").write_text(json.dumps({"rev": rev}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    os.utime(repo / "snapshots" / "old" / "config.json", (2e9, 2e9))  # the newest file is not the one main names
    path, origin = config_source.resolve(mid, {"HF_HOME": str(tmp_path / "hf")})
    assert path == str(repo / "snapshots" / "abc123" / "config.json")
    assert origin == f"{mid} in the Hugging Face cache {tmp_path / 'hf' / 'hub'}"
    ms = tmp_path / "ms" / "models" / "Qwen" / "Qwen3-VL-8B-Instruct"
    ms.mkdir(parents=True)
    (ms / "config.json").write_text("{}")
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "MODELSCOPE_CACHE": str(tmp_path / "ms")}
    assert config_source.resolve(mid, env) == (str(ms / "config.json"), f"{mid} in the ModelScope cache {tmp_path / 'ms'}")
    shutil.rmtree(tmp_path / "ms")
    with pytest.raises(FileNotFoundError) as e:
        config_source.resolve(mid, env)
    assert str(tmp_path / "empty" / "models--Qwen--Qwen3-VL-8B-Instruct") in e.value.strerror
    assert "the --model id the training downloaded" in e.value.strerror


def test_doctor_reports_where_the_config_came_from(monkeypatch, capsys, tmp_path):
    """The report names the config file and its origin (here a model folder)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_8B))
    monkeypatch.setenv("ORACLE_CAPTURE", str(tmp_path))
    code, out, _ = _run(capsys, "--hf-config", str(tmp_path / "model"), "--ranks", "1")
    assert f"model config: {tmp_path / 'model' / 'config.json'} (the model folder {tmp_path / 'model'})" in out, out
    assert "capture size per rank" in out and code in (0, 12)
