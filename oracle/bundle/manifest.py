"""The manifest of a bundle: its schema, and the one function that reads and checks it.

A manifest is read only through :func:`read_manifest`, which

1. refuses what is not a small JSON object in UTF-8 (duplicate keys too: with ``json`` the last one
   would silently win), and nesting so deep that the parser gives up;
2. checks the type of every field it knows against the pydantic v2 models below, in strict mode
   (``true`` is not a schema version, ``"1.5"`` is not a loss), and reports every offender at once,
   each by its path in the manifest (``tensors.grads.lm_head.weight.shape.0``).

Unknown top-level fields are kept (a newer writer of the same schema version may add some); known
fields of the wrong type are refused. The validated manifest is returned as the plain dict it was
read as, so that readers index it as before. Checks against the files themselves (tensors listed
but missing, symlinks leaving the bundle, safetensors headers that disagree) live in bundle.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import BundleError, problem_lines
from .jsonio import no_duplicate_keys

SCHEMA_VERSION = 1
KINDS = ("capture", "oracle", "emulation", "norms", "local")
MAX_MANIFEST_BYTES = 256 * 2**20  # a Qwen3-VL-8B capture with every module boundary is a few MiB
# safetensors dtype codes <-> the names the manifest stores (torch names without the prefix)
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
          "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
          "BOOL": "bool"}  # fmt: skip

_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.safetensors")
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=0)]
Name = Annotated[str, Field(min_length=1)]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


def _plain_file_name(name: str) -> str:
    """A file directly in the bundle directory: no separator, no leading dot, no traversal."""
    if not _FILE.fullmatch(name):
        raise ValueError("bad file name: must be a plain NAME.safetensors inside the bundle (letters, digits, '_', '.', '-')")
    return name


class TensorEntry(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    file: Annotated[str, AfterValidator(_plain_file_name)]
    dtype: Literal[tuple(DTYPES.values())]  # type: ignore[valid-type]
    shape: list[Count]
    sha256: Sha256
    value_sha256: Sha256


class RecipeRef(_Model):
    name: str | None = None
    config: dict[str, Any]


class Loss(_Model):
    value: float | None = None
    reduction: Literal["mean", "sum"] = "mean"
    num_tokens: Count | None = None
    members: list[float | None] | None = None


class Device(_Model):
    type: str | None = None


class Certificate(_Model):
    fd_rel_residual: float
    directions: Count


class Numerics(_Model):
    compute: str | None = None
    promotions: Count = 0


class ModuleMeta(_Model):
    calls: Count = 1
    in_spec: str | None = None
    out_spec: str | None = None
    in_static: dict[str, Any] = {}
    grad_in: list[Count] = []
    grad_out: list[Count] = []


class Coords(_Model):
    tp_rank: Count = 0
    tp_size: Annotated[int, Field(ge=1)] = 1


class Megatron(_Model):
    stage: str | None = None
    coords: Coords | None = None
    config: dict[str, Any] = {}
    layout: dict[str, dict[str, Any]] = {}
    warnings: list[str] = []
    merged_from: list[str] = []


class LocalRow(_Model):
    module: Name
    calls: Count = 1
    fwd: float | None = None
    bwd: float | None = None
    param: float | None = None
    expected_fwd: float | None = None
    expected_bwd: float | None = None
    expected_param: float | None = None
    inherited: float | None = None


class Manifest(_Model):
    schema_version: Annotated[int, Field(ge=SCHEMA_VERSION, le=SCHEMA_VERSION)]  # strict: true is not 1
    kind: Literal[KINDS]  # type: ignore[valid-type]
    # required: every writer lists its tensors (an empty dict for a norm log), and every reader indexes it
    tensors: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.]+$")], dict[Name, TensorEntry]]
    recipe: RecipeRef | None = None
    precision: str | None = None
    device: Device | None = None
    versions: dict[str, str] | None = None
    seed: int | None = None
    loss: Loss | None = None
    captured_loss: Loss | None = None
    static_inputs: dict[str, Any] | None = None
    no_grad: list[str] | None = None
    metadata: dict[str, Any] | None = None
    modules: dict[str, ModuleMeta] | None = None
    modules_over_budget: list[str] | None = None
    source: dict[str, Any] | None = None
    fingerprint: dict[str, dict[str, Sha256]] | None = None
    numerics: Numerics | None = None
    backward_order: list[str] | None = None
    certificate: Certificate | None = None
    seconds: float | None = None
    members: Annotated[int, Field(ge=1)] | None = None
    emulation: dict[str, str] | None = None
    emulated: str | None = None
    norms: dict[str, float] | None = None
    order: list[str] | None = None
    megatron: Megatron | None = None
    local: list[LocalRow] | None = None

    @model_validator(mode="after")
    def _kind_needs(self) -> Manifest:
        """What each kind's readers index without a default."""
        if self.kind == "norms" and self.norms is None:
            raise ValueError("a norms bundle needs 'norms' (parameter name -> gradient norm)")
        if self.kind == "local" and self.local is None:
            raise ValueError("a local bundle needs 'local' (one row per replayed module)")
        weights = self.tensors.get("weights", {})
        for group, entries in self.tensors.items():
            if group == "grads" or group.startswith("grads."):
                bad = [
                    f"{n} {e.shape} (weight {weights[n].shape})"
                    for n, e in entries.items()
                    if n in weights and e.shape != weights[n].shape
                ]
                if bad:
                    raise ValueError(
                        f"{len(bad)} gradient(s) in '{group}' have another shape than their weight: {', '.join(bad[:3])}"
                    )
        if self.kind == "capture" and not self.tensors.get("grads"):
            raise ValueError("a capture needs its gradients: the 'grads' group is missing or empty (nothing to score); "
                             "capture the step again after the backward")  # fmt: skip
        if self.kind == "emulation":
            missing = [g for g in ["grads"] + [f"grads.{k}" for k in range(1, self.members or 1)] if g not in self.tensors]
            if missing:
                raise ValueError(f"an emulation bundle of {self.members or 1} member(s) needs the groups {missing}")
        return self


STATED = ("recipe", "precision", "loss")  # every writer of a capture states them (null: known not to be known)


def missing_fields(manifest: dict[str, Any]) -> list[str]:
    """What a capture's manifest leaves unsaid, each with what it costs: a field absent (an edited or
    foreign manifest; every writer states it, null where it is not known), or a precision not given."""
    if manifest.get("kind") != "capture":
        return []
    why = {"recipe": "the model it belongs to is unknown (replay needs it)",
           "precision": "its band and tolerance cannot be chosen",
           "loss": "the replayed loss cannot be checked against the device's"}  # fmt: skip
    out = [f"'{f}' is missing: {why[f]}" for f in STATED if f not in manifest]
    if "precision" in manifest and not manifest["precision"]:
        out.append(f"'precision' is not given: {why['precision']}")
    return out


def parse_json(raw: bytes, where: str, what: str = "the bundle is damaged, write it again") -> Any:
    """Strict JSON: UTF-8, no duplicate keys, bounded nesting. Errors are BundleErrors naming ``where``."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except UnicodeDecodeError as e:
        raise BundleError(f"{where} is not UTF-8 text ({e}); {what}") from None
    except RecursionError:
        raise BundleError(f"{where} nests too deeply to be a manifest; {what}") from None
    except ValueError as e:  # JSONDecodeError is a ValueError; so is a duplicate key
        raise BundleError(f"{where} is not valid JSON ({e}); {what}") from None


def _describe(err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    got = repr(err.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    return f"{loc}: {err['msg']} (found {got})" if err["type"] != "missing" else f"{loc}: missing"


def validate(manifest: Any, where: str) -> dict[str, Any]:
    """Check a parsed manifest against the schema; every offender is named in one BundleError."""
    if not isinstance(manifest, dict) or "schema_version" not in manifest:
        raise BundleError(f"{where}: no schema_version; not an oracle bundle")
    v = manifest["schema_version"]
    if type(v) is int and v != SCHEMA_VERSION:
        raise BundleError(
            f"{where}: schema_version {v} is not supported (this oracle reads {SCHEMA_VERSION}); use the oracle version that wrote it"
        )
    try:
        Manifest.model_validate(manifest)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        raise BundleError(
            f"{where} does not follow the bundle schema ({len(errs)} problem(s)); the bundle is damaged or "
            "was edited, write it again:" + problem_lines([_describe(x) for x in errs], 40)
        ) from None
    return manifest


def read_manifest(path: Path) -> dict[str, Any]:
    """Read and validate ``path`` (a bundle's manifest.json)."""
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{path} is {size / 2**20:.0f} MiB, over the {MAX_MANIFEST_BYTES // 2**20} MiB a manifest may be")
    return validate(parse_json(path.read_bytes(), str(path)), str(path))


def looks_like_bundle(path: Path) -> bool:
    """Whether ``path/manifest.json`` is a manifest of a kind and schema version this oracle writes."""
    try:
        m = read_manifest(path / "manifest.json")
    except (BundleError, OSError):
        return False
    return m["kind"] in KINDS
