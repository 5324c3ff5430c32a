"""Write docs/cli-reference.md from the typer app itself: every command, argument and option.

    python docs/generate.py          # rewrite docs/cli-reference.md
    python docs/generate.py --check  # exit 1 if the file is not what the app says (tests/integration/test_docs.py)

The reference is generated, never edited by hand, so it cannot drift from `cli.py`: the test suite
regenerates it and compares. It renders what cli.py declares (names, spellings, defaults, help), not typer's help
screen or its type labels, so the output depends neither on the terminal nor on typer's version.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "cli-reference.md"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(p) -> str:
    if p.required or p.default is None or (p.multiple and not p.default):
        return ""
    d = p.default
    if isinstance(d, bool):
        return ""  # a flag: its two spellings say it
    if isinstance(d, list | tuple):
        d = " ".join(map(str, d))
    return f"`{getattr(d, 'value', d)}`"


def render() -> str:
    import typer

    sys.path.insert(0, str(ROOT))
    from cli import EPILOG, app

    group = typer.main.get_command(app)
    ctx = group.context_class(group, info_name="oracle")
    out = [
        "# Command reference",
        "",
        "Generated from the typer app by `python docs/generate.py`; `tests/integration/test_docs.py` fails when it",
        "differs from what `cli.py` declares. Exit codes: README.md's table (`oracle/errors.py`).",
        "",
        f"`oracle --help`: {_cell(group.help or '')}",
        "",
        _cell(EPILOG),
        "",
    ]
    for name in sorted(group.list_commands(ctx)):
        cmd = group.get_command(ctx, name)
        # duck-typed (param_type_name): typer >= 0.16 vendors its own click, whose classes are not click's
        args = [p for p in cmd.params if p.param_type_name == "argument"]
        opts = [p for p in cmd.params if p.param_type_name == "option" and not p.hidden]
        usage = " ".join(["[OPTIONS]", *(p.name.upper() + ("..." if p.nargs == -1 else "") for p in args)])
        out += [f"## `oracle {name}`", "", _cell(cmd.help or ""), "", "```", f"oracle {name} {usage}", "```", ""]
        if cmd.epilog:
            out += [cmd.epilog.strip(), ""]
        if args:
            out += ["| argument | help |", "|---|---|"]
            out += [f"| `{p.name.upper()}` | {_cell(getattr(p, 'help', '') or '')} |" for p in args]
            out.append("")
        if opts:
            out += ["| option | default | help |", "|---|---|---|"]
            for p in opts:
                names = " / ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
                out.append(f"| {names} | {_default(p)} | {_cell(p.help or '')} |")
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET.relative_to(ROOT)} is stale: run python docs/generate.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
