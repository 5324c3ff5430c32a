import json

import pytest
import torch

from oracle.bundle.store import Bundle, BundleWriter, value_sha256
from oracle.errors import BundleError, InputNotFound, OutputExists


def _write(path, **kw):
    with BundleWriter(path, "capture", **kw) as w:
        w.manifest["loss"] = {"value": 1.5}
        w.add("grads", {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)})
        w.add("inputs", {"ids": torch.tensor([[1, 2, 3]])})
    return path


def test_round_trip_keeps_values_dtypes_and_metadata(tmp_path):
    b = Bundle(_write(tmp_path / "b"))
    assert b.kind == "capture" and b.get("loss") == {"value": 1.5}
    assert b.load("grads", "b").dtype == torch.bfloat16
    assert torch.equal(b.load("grads", "a"), torch.arange(6, dtype=torch.float32).view(2, 3))
    assert b.names("inputs") == ["ids"]


def test_value_hash_is_dtype_independent_but_value_sensitive():
    x = torch.randn(5).to(torch.bfloat16)
    assert value_sha256(x) == value_sha256(x.float()) == value_sha256(x.double())
    assert value_sha256(x.float()) != value_sha256(x.float() + 1e-3)


def test_corrupted_tensor_bytes_are_detected(tmp_path):
    p = _write(tmp_path / "b")
    f = p / "grads.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF  # flip bits in the last tensor's data
    f.write_bytes(bytes(raw))
    b = Bundle(p)
    with pytest.raises(BundleError, match="does not match its sha256"):
        b.load_group("grads")


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with BundleWriter(tmp_path / "b", "capture") as w:
            w.add("grads", {"a": torch.ones(2)})
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_refused_and_non_bundles_never_replaced(tmp_path):
    p = _write(tmp_path / "b")
    with pytest.raises(OutputExists, match="--overwrite"):
        _write(p)
    _write(p, overwrite=True)  # a bundle may be replaced when asked
    other = tmp_path / "mydata"
    other.mkdir()
    (other / "precious.txt").write_text("keep")
    with pytest.raises(OutputExists, match="not a bundle"):
        _write(other, overwrite=True)
    assert (other / "precious.txt").read_text() == "keep"


def test_manifest_problems_are_named(tmp_path):
    with pytest.raises(InputNotFound):
        Bundle(tmp_path / "nope")
    p = _write(tmp_path / "b")
    m = json.loads((p / "manifest.json").read_text())
    m["tensors"]["grads"]["a"]["file"] = "../escape.safetensors"
    (p / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="bad file name"):
        Bundle(p)
    m["schema_version"] = 99
    (p / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="schema_version 99 is not supported"):
        Bundle(p)
    (p / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        Bundle(p)


def test_entry_hashes_on_two_threads_are_the_one_thread_hashes(monkeypatch, tmp_path):
    """store.entry_hashes (and a RowWriter) hash a large tensor's stored bytes on a second thread beside its values:
    the digests must be those of tensor_sha256 / value_sha256 one after the other, for every stored dtype, a
    non-contiguous tensor, and inside a band member's mode; a failure on the helper thread reaches the caller
    (no hang)."""
    import oracle.bundle.store as store
    from oracle.bundle.store import entry_hashes, tensor_sha256
    from oracle.precision.mode import PrecisionMode

    monkeypatch.setattr(store, "PARALLEL_HASH_MIN", 1024)  # small tensors take the threaded path too
    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(700, 33, generator=g, dtype=torch.float64), torch.randn(500, 41, generator=g),
             torch.randn(900, 17, generator=g).to(torch.bfloat16), torch.randint(0, 9, (4000,), generator=g),
             torch.randn(64, 90, generator=g, dtype=torch.float64).t(), torch.randn(3)]  # fmt: skip
    for t in cases:
        want = {"sha256": tensor_sha256(t.contiguous()), "value_sha256": value_sha256(t)}
        assert entry_hashes(t) == want, t.dtype
        with PrecisionMode(torch.float32, torch.bfloat16, jitter_seed=5):
            assert entry_hashes(t) == want, f"{t.dtype} inside a jittered member's mode"
    assert entry_hashes(cases[0])["sha256"] != entry_hashes(cases[0] + 1)["sha256"]
    from oracle.bundle.rows import RowWriter  # the row writer's two streams on two threads: the same entry

    for k, t in enumerate(cases[:3]):
        w = RowWriter(tmp_path / f"rows-{k}.bin", "g", list(t.shape), t.dtype)
        for rows in t.split(200):
            w.write(rows)
        got = w.close()
        assert {n: got[n] for n in ("sha256", "value_sha256")} == entry_hashes(t), t.dtype

    def broken(t):
        raise OSError("disk gone")

    monkeypatch.setattr(store, "_byte_view", broken)  # the helper thread's every slice
    with pytest.raises(OSError, match="disk gone"):
        entry_hashes(cases[0])


def test_value_hashes_are_the_same_inside_an_emulated_replays_mode(tmp_path):
    """A streamed band member hashes its gradients inside its PrecisionMode (float32 compute), which turned the
    hash's float64 upcast into float32 and rounded it: the journal then held other hashes than the same values
    outside the mode. value_sha256 and a row writer's entry are now the same inside any mode as outside."""
    from oracle.bundle.rows import RowWriter
    from oracle.precision.mode import PrecisionMode

    x = torch.randn(300, 7).to(torch.bfloat16).float() * 3  # a member's gradient: float32 holding bf16 values
    y = torch.randn(300, 7) + 1e-3  # and one that is not
    entries = []
    for mode in (None, PrecisionMode(torch.float32, torch.bfloat16), PrecisionMode(torch.float32, torch.bfloat16, "amp")):
        with mode or torch.no_grad():
            w = RowWriter(tmp_path / f"rows-{len(entries)}.bin", "g", list(y.shape), torch.float32)
            w.write(y[:100])
            w.write(y[100:])
            entries.append((value_sha256(x), value_sha256(y), w.close()))
    assert entries[0][0] == value_sha256(x.double()) and entries[0][2]["value_sha256"] == value_sha256(y)
    assert entries[1] == entries[0] and entries[2] == entries[0]
    assert (tmp_path / "rows-0.bin").read_bytes() == (tmp_path / "rows-1.bin").read_bytes()
