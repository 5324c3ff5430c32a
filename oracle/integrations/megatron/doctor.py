"""``oracle doctor``: before spending a training step, is ``ORACLE_CAPTURE`` going to capture it here?

Runs in the training environment (no typer there: ``python -m oracle doctor``; ``oracle doctor``
where the CLI is installed) and checks, without importing torch or megatron:

- the start-up hook: a fresh interpreter of this environment (``sys.executable``, this process's
  environment, ``ORACLE_CAPTURE`` set) is asked whether ``oracle_capture.pth`` ran, i.e. whether
  ``oracle.integrations.megatron.autocapture.install`` was called at start-up. That is exactly what
  ``torchrun`` / ``swift megatron sft`` start; an editable install of an old checkout, a wheel
  installed into another environment, or ``python -S`` all answer "no";
- which torch, torch_npu, megatron-core, MindSpeed, ms-swift and transformers it sees (package
  metadata; megatron-core is needed: the hook wraps its pipeline schedules);
- where the capture goes (``DIR/pre/rankNNNNN``, ``DIR/post/rankNNNNN``; DIR or ``$ORACLE_CAPTURE``,
  neither: not ready) and whether DIR can be created and written (a probe file created exclusively
  under a random name, removed again; a DIR the check created is removed; DIR and its parent both
  missing: not ready, a typo), with its free space;
- with ``--hf-config`` (a config.json, a model folder, or the ``--model`` id found in the local caches:
  config_source.py) the capture's size per rank, and whether the disk holds what ``--ranks`` ranks write;
- ``ORACLE_CAPTURE_STEP`` is an integer, ``ORACLE_CAPTURE_MODULES`` a preset or a valid regex.

Exit code 0 when ready, listing what is left to do or check (``ORACLE_CAPTURE=DIR`` to set, a folder the
first rank will make, a size not checked); ``NOT_READY`` (12, ``oracle.errors.EXIT_CODES``) when anything
above would stop the capture or leave it nowhere to go, each problem said with its fix.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import config_source
from .autocapture import PTH_LINE, PTH_NAME

NOT_READY = 12
PACKAGES = [("torch", "torch"), ("torch_npu", "torch_npu"), ("megatron-core", "megatron.core"),
            ("MindSpeed", "mindspeed"), ("ms-swift", "swift"), ("transformers", "transformers")]  # fmt: skip
PRESETS = ("layers",)  # hook.py MODULE_PRESETS (not imported: hook.py imports torch)

_PROBE = (
    "import json, sys; m = sys.modules.get('oracle.integrations.megatron.autocapture'); "
    "print(json.dumps({'fired': bool(m is not None and m._state['installed']), 'module': getattr(m, '__file__', None)}))"
)


def hook_fires(env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start this interpreter afresh with ``ORACLE_CAPTURE`` set and ask it whether the hook ran."""
    env = dict(os.environ if env is None else env)
    env.setdefault("ORACLE_CAPTURE", os.path.join(os.getcwd(), "oracle-doctor-probe"))
    env.pop("RANK", None)  # not a training rank: the hook's at-exit note stays silent
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        out = {"fired": False, "module": None}
    out["stderr"] = r.stderr.strip()
    return out


def pth_files() -> list[str]:
    """Every ``oracle_capture.pth`` in this interpreter's site directories (the ones start-up reads)."""
    import site

    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [os.path.join(d, PTH_NAME) for d in dict.fromkeys(dirs) if os.path.isfile(os.path.join(d, PTH_NAME))]


def package_versions() -> dict[str, str | None]:
    out = {}
    for dist, module in PACKAGES:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            out[dist] = "present (no package metadata)" if found else None
    return out


def _existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_folder(folder: str) -> tuple[str | None, str, str | None]:
    """Can ``folder`` be created and written? ``(problem or None, the report's line, a note for the
    answer or None)``. Leaves nothing behind that was not there: the probe file is created exclusively
    under a random name (never a user's file), a folder the check made is removed again."""
    p = Path(folder).expanduser().absolute()
    created: list[Path] = []
    try:
        existing = _existing(p)
        if existing not in (p, p.parent):
            return (f"{p}: neither it nor its parent {p.parent} exists (a typo?): correct the path, or make the folder "
                    f"first (mkdir -p {p}) on a disk every rank writes to", "NOT there, nor its parent", None)  # fmt: skip
        for d in reversed([p, *p.parents]):
            if not d.exists():
                d.mkdir()
                created.append(d)
        fd, probe = tempfile.mkstemp(prefix=".oracle-doctor-probe-", dir=p)
        os.close(fd)
        os.unlink(probe)
        free = shutil.disk_usage(existing).free / 2**30
    except OSError as e:
        return (f"{p}: cannot be written ({e.strerror or e}); give a folder every rank can write, on a disk with room",
                "NOT writable", None)  # fmt: skip
    finally:
        for d in reversed(created):
            try:
                d.rmdir()
            except OSError:
                pass
    line = f"{p}: writable, {free:.1f} GiB free; each rank writes {p}/pre/rankNNNNN and {p}/post/rankNNNNN"
    if created:
        return None, line.replace("writable", "writable (not there yet: the first rank makes it)", 1), \
            f"{p} does not exist yet: the first rank makes it; if that is not the folder you meant, correct the path"
    return None, line, None


def size_lines(hf_config: str, layout: dict[str, Any], modules: str | None) -> tuple[list[str], int]:
    """The capture's size per rank (capture_size.py) from a HF config.json and the layout; the bytes
    one rank writes (pre + post, with the layers' boundaries where ``modules`` is set, the vision blocks'
    too where it names the preset ``vit``)."""
    from . import capture_size

    sizes = {k: v for k, v in layout.items() if k != "ranks"}
    try:
        with open(hf_config) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--hf-config {hf_config}: cannot read it as a config.json ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--hf-config {hf_config}: holds a JSON {type(config).__name__}, not a config object; give the "
                         "model's config.json (one JSON object)")  # fmt: skip
    text = config.get("text_config", config)
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")  # every HF language model's config says these
    missing = [k for k in shape if not isinstance(text, dict) or k not in text]
    if missing:  # capture_size fills what a config leaves out: any JSON object would price a made-up model
        raise ValueError(f"--hf-config {hf_config}: names no model's shape (no {', '.join(missing)} in it"
                         f"{' or its text_config' if 'text_config' not in config else ''}); give the model's Hugging Face config.json")  # fmt: skip
    try:
        s = capture_size.per_rank(config, **sizes)
        text = capture_size.render(s, **sizes)
    except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError, OverflowError) as e:
        raise ValueError(f"--hf-config {hf_config}: cannot size the capture from it ({type(e).__name__}: {e}); give "
                         "the model's Hugging Face config.json") from None  # fmt: skip
    vit = bool(modules) and "vit" in [x.strip() for x in modules.split(",")]
    return [text], s["rank_with_layers_vit" if vit else "rank_with_layers" if modules else "rank"]


LAYOUT_DEFAULTS = {"tp": 1, "pp": 1, "tokens": 4096, "sequence_parallel": True, "images": 4, "image_side": 448, "ranks": 8}
LAYOUT_MIN = {"tp": 1, "pp": 1, "tokens": 1, "images": 0, "image_side": 1, "ranks": 1}
# beyond any real run (a 1G-token micro-batch, a million ranks): a larger value is a typo, refused before any arithmetic
LAYOUT_MAX = {"tp": 1 << 20, "pp": 1 << 20, "tokens": 1 << 30, "images": 1 << 20, "image_side": 1 << 16, "ranks": 1 << 20}


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)" if isinstance(v, int) else f"{text[:12]}..."


def check_layout(hf_config: str | None, layout: dict[str, Any] | None) -> dict[str, Any]:
    """The size options, validated once for both entry points (typer's and argparse's): whole numbers
    within their range (a TP of 0 divides by zero, a negative one prints negative sizes, a 400-digit one
    overflows), given only with --hf-config (they size the capture; alone they would be ignored)."""
    lay = {**LAYOUT_DEFAULTS, **(layout or {})}
    for k, lo in LAYOUT_MIN.items():
        v, hi = lay[k], LAYOUT_MAX[k]
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise ValueError(f"--{k.replace('_', '-')} {_shown(v)}: expected a whole number >= {lo} (at most {hi})")
    if hf_config is None and lay != LAYOUT_DEFAULTS:
        given = [f"--{k.replace('_', '-')}" if k != "sequence_parallel" else "--no-sp" for k in lay if lay[k] != LAYOUT_DEFAULTS[k]]
        raise ValueError(f"{', '.join(given)} size the capture: give --hf-config (the model's config.json) as well")
    return lay


def diagnose(folder: str | None = None, env: dict[str, str] | None = None, *, hf_config: str | None = None,
             layout: dict[str, Any] | None = None) -> tuple[int, str]:  # fmt: skip
    """The report's text and its exit code (0 ready, ``NOT_READY`` otherwise). With ``hf_config``
    (a config.json, a model folder or a model id in the local caches: config_source.py; and ``layout``:
    tp, pp, tokens, sequence_parallel, images, image_side, ranks) also the capture's size per rank, and
    whether the capture folder's disk holds what ``ranks`` ranks write. A missing config:
    ``FileNotFoundError``; a bad option value or config: ``ValueError``."""
    layout = check_layout(hf_config, layout)
    env = dict(os.environ if env is None else env)
    origin = None
    if hf_config is not None:
        hf_config, origin = config_source.resolve(hf_config, env)
    variable = env.get("ORACLE_CAPTURE")
    folder = folder or variable
    problems: list[str] = []
    notes: list[str] = []  # what the user must still do, or check, for the answer to hold
    lines = [f"oracle doctor: {sys.executable} (Python {sys.version.split()[0]})"]
    here = os.path.dirname(os.path.abspath(__file__))
    pths = pth_files()
    fired = hook_fires(env)
    if fired["fired"]:
        lines.append(f"  start-up hook: fires ({', '.join(pths) or PTH_NAME})")
        loaded = os.path.dirname(os.path.abspath(fired["module"] or ""))
        if fired["module"] and loaded != here:
            lines.append(f"    note: the hook loads {fired['module']}, this check runs {here}: two copies of oracle; "
                         "the hook's is the one that captures")  # fmt: skip
    else:
        why = (f"{', '.join(pths)} is there but did not run at start-up (not a site directory of this interpreter, or "
               "python -S)" if pths else f"no {PTH_NAME} in this interpreter's site-packages (an editable install "
               "of an older checkout, or oracle installed into another environment)")  # fmt: skip
        bad = [p for p in pths if open(p).read().strip() != PTH_LINE]
        if bad:
            why += f"; {', '.join(bad)} does not hold the hook's line"
        lines.append("  start-up hook: will NOT fire")
        problems.append(f"start-up hook will NOT fire: {why}; ORACLE_CAPTURE would capture nothing. Fix: install the "
                        "wheel (pip install --no-index --no-deps oracle_fp64-*.whl) or run "
                        "`python -m oracle.integrations.megatron.autocapture install-pth` once")  # fmt: skip
        if fired["stderr"]:
            lines.append(f"    the probe said: {fired['stderr'].splitlines()[-1]}")
    vers = package_versions()
    lines.append("  sees: " + ", ".join(f"{k} {v or 'not found'}" for k, v in vers.items()))
    if vers["megatron-core"] is None:
        problems.append("megatron-core is not installed here: the hook wraps megatron.core's pipeline schedules; "
                        "run the doctor in the training environment")  # fmt: skip
    need = None
    if hf_config:
        lines.append(f"  model config: {hf_config} ({origin})")
        more, need = size_lines(hf_config, layout, env.get("ORACLE_CAPTURE_MODULES"))
        lines += more
    if folder:
        problem, text, note = check_folder(folder)
        lines.append(f"  capture folder: {text}")
        problems += [problem] if problem else []
        notes += [note] if note else []
        if problem is None and need is not None:
            free, ranks = shutil.disk_usage(_existing(Path(folder).expanduser().absolute())).free, layout["ranks"]
            if free < need * ranks:
                problems.append(f"{folder}: {free / 2**30:.1f} GiB free, {ranks} rank(s) write {need * ranks / 2**30:.2f} GiB "
                                f"({need / 2**30:.2f} GiB each, pre + post): give a folder on a disk with room, or --ranks "
                                "as many as write to this disk (default 8: one 8-GPU node)")  # fmt: skip
        elif problem is None:
            notes.append("the capture's size is not checked against the free space: give --hf-config (the model's "
                         "config.json, or the --model id the training runs) and the run's --tp / --tokens")  # fmt: skip
        if not variable:
            notes.append(f"ORACLE_CAPTURE is not set in this shell: start the training with ORACLE_CAPTURE={folder} "
                         f"(ORACLE_CAPTURE={folder} swift megatron sft ...)")  # fmt: skip
        elif Path(variable).expanduser().absolute() != Path(folder).expanduser().absolute():
            notes.append(f"this checked {folder}, while ORACLE_CAPTURE here names {variable}: the training writes there")
    else:
        lines.append("  capture folder: ORACLE_CAPTURE is not set here")
        problems.append("ORACLE_CAPTURE is not set and no DIR was given: nothing would be captured, and no folder was "
                        "checked; check the folder with `oracle doctor DIR` (or ORACLE_CAPTURE=DIR oracle doctor), then "
                        "start the training with ORACLE_CAPTURE=DIR")  # fmt: skip
    step = env.get("ORACLE_CAPTURE_STEP", "0")
    if re.fullmatch(r"\s*\d+\s*", step):
        lines.append(f"  step: training call {int(step)} (ORACLE_CAPTURE_STEP; 0 = the first with forward_only=False)")
    else:
        problems.append(f"ORACLE_CAPTURE_STEP={step!r} is not a non-negative integer: nothing would be captured")
    mods = env.get("ORACLE_CAPTURE_MODULES")
    if mods:
        parts = [x.strip() for x in mods.split(",") if x.strip()]
        near = [p for x in parts for p in difflib.get_close_matches(x, PRESETS, n=1, cutoff=0.75) if p != x]
        try:
            if not all(x in PRESETS for x in parts):
                re.compile(mods)
            if near and all(re.fullmatch(r"[A-Za-z_]+", x) for x in parts):
                raise re.error(f"did you mean {', '.join(near)!r}?")
            lines.append(f"  module boundaries: ORACLE_CAPTURE_MODULES={mods!r}")
        except re.error as e:
            problems.append(f"ORACLE_CAPTURE_MODULES={mods!r} is neither a preset ({', '.join(PRESETS)}) nor a regex "
                            f"({e}): the step would be captured without module boundaries")  # fmt: skip
    if problems:
        lines += ["NOT READY:"] + [f"  - {p}" for p in problems]
        return NOT_READY, "\n".join(lines)
    if notes:
        lines += [f"ready, with {len(notes)} thing(s) to do or check:"] + [f"  - {n}" for n in notes]
        return 0, "\n".join(lines)
    lines.append("ready: ORACLE_CAPTURE will capture in this environment")
    return 0, "\n".join(lines)


# One text for both entry points: ``oracle doctor`` (typer, oracle/cli/app.py) and ``python -m oracle
# doctor`` (argparse: the training environment may have no typer), so the two --help read the same.
SUMMARY = ("Before spending a training step: will ORACLE_CAPTURE capture in this environment, and how much "
           "will it write? Exit 0 ready, 12 not.")  # fmt: skip
WHERE = ("Run it in the training environment (the one torchrun / swift megatron sft start), on each cluster; "
         "there it runs without typer as python -m oracle doctor.")  # fmt: skip
EXAMPLES = (
    ("the hook, the folder, and the capture's size per rank: Qwen3-VL-8B, TP 8, one 64k-token micro-batch",
     "{prog} /shared/h20-step --hf-config config.json --tp 8 --tokens 65536"),
    ("is the start-up hook active here, and can every rank write the folder?", "ORACLE_CAPTURE=/shared/h20-step {prog}"),
)  # fmt: skip
ARGUMENT_HELP = "The folder ORACLE_CAPTURE will name (default: $ORACLE_CAPTURE)."
# (flag, metavar, help); the defaults are LAYOUT_DEFAULTS
OPTIONS = (
    ("--hf-config", "PATH", "The model's Hugging Face config.json, its folder, or the --model id the training runs "
     "(Qwen/Qwen3-VL-8B-Instruct, found offline in the Hugging Face or ModelScope cache): print the capture's size per "
     "rank and check the folder's free space."),
    ("--tp", "INTEGER", "Tensor-parallel size of the run."),
    ("--pp", "INTEGER", "Pipeline-parallel size of the run."),
    ("--tokens", "INTEGER", "Tokens of the captured micro-batch (packed)."),
    ("--no-sp", None, "The run has no sequence parallel (each rank's boundaries hold every row)."),
    ("--images", "INTEGER", "Images in the captured micro-batch."),
    ("--image-side", "INTEGER", "Their side in pixels."),
    ("--ranks", "INTEGER", "Ranks writing to the folder's disk (one 8-GPU node: 8; all the run's where it is shared)."),
)
OPTION_HELP = {flag[2:].replace("-", "_"): text for flag, _, text in OPTIONS}
EXIT_TEXT = ("Exit codes: 0 ready (what is left to do said below the answer); 12 not ready (each problem said with "
             "its fix); 2 usage error (an option out of range, an --hf-config that is not a model's config.json); "
             "3 no --hf-config there (no such file, folder or cached model id).")  # fmt: skip


def examples(prog: str) -> str:
    return "\n".join(f"  # {what}\n  {cmd.format(prog=prog)}" for what, cmd in EXAMPLES)


def help_text(prog: str = "python -m oracle doctor") -> str:
    """``python -m oracle doctor --help``: typer's sections (Usage, Arguments, Options), its help
    texts and defaults, the examples and the exit codes."""
    import textwrap

    defaults = {flag: LAYOUT_DEFAULTS[flag[2:].replace("-", "_")] for flag, metavar, _ in OPTIONS
                if metavar == "INTEGER"}  # fmt: skip
    width = min(shutil.get_terminal_size((100, 24)).columns, 100)

    def row(left: str, text: str) -> list[str]:
        body = textwrap.wrap(text, width - 26) or [""]
        first = f"  {left:<22} {body[0]}" if len(left) <= 22 else f"  {left}\n  {'':<22} {body[0]}"
        return [first] + [f"  {'':<22} {b}" for b in body[1:]]

    lines = [f"Usage: {prog} [OPTIONS] [DIR]", "", *textwrap.wrap(SUMMARY, width), "",
             *textwrap.wrap(WHERE, width), "", "Arguments:", *row("[DIR]", ARGUMENT_HELP), "", "Options:"]  # fmt: skip
    for flag, metavar, text in OPTIONS:
        d = defaults.get(flag)
        lines += row(f"{flag} {metavar}" if metavar else flag, text + (f"  [default: {d}]" if d is not None else ""))
    lines += row("--help", "Show this message and exit.")
    lines += ["", "Examples:", examples(prog), "", *textwrap.wrap(EXIT_TEXT, width)]
    return "\n".join(lines) + "\n"


def parser(prog: str = "python -m oracle doctor"):
    import argparse

    class Parser(argparse.ArgumentParser):
        def format_help(self) -> str:
            return help_text(prog)

        def error(self, message: str):  # as typer says a usage mistake: the usage, a hint, the error; exit 2
            self.exit(2, f"Usage: {prog} [OPTIONS] [DIR]\nTry '{prog} --help' for help.\n\nError: {message}\n")

    p = Parser(prog=prog, add_help=False)
    p.add_argument("--help", action="help")
    p.add_argument("dir", nargs="?")
    for flag, metavar, _ in OPTIONS:
        if metavar is None:
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=int if metavar == "INTEGER" else str, metavar=metavar,
                           default=LAYOUT_DEFAULTS.get(flag[2:].replace("-", "_")))  # fmt: skip
    return p


def main(argv: list[str], prog: str = "python -m oracle doctor") -> int:
    """``python -m oracle doctor [DIR] [--hf-config ...]``: the check without the CLI's packages (typer);
    also ``oracle doctor`` where the console script finds no typer (oracle/cli/app.py)."""
    a = parser(prog).parse_args(argv)  # a usage mistake: the usage, a hint and the error, exit 2
    layout = {"tp": a.tp, "pp": a.pp, "tokens": a.tokens, "sequence_parallel": not a.no_sp, "images": a.images,
              "image_side": a.image_side, "ranks": a.ranks}  # fmt: skip
    try:
        code, text = diagnose(a.dir, hf_config=a.hf_config, layout=layout)
    except ValueError as e:
        print(f"Error: {e} (see {prog} --help)", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"Error: {e.strerror}: {e.filename}", file=sys.stderr)
        return 3  # EXIT_CODES: an input path does not exist
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
