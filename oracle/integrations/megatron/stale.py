"""Rank folders left in a capture folder by an earlier run: named before any merge.

``capture_rank`` writes ``DIR/rankNNNNN`` per rank; a rerun with fewer ranks (DP 2 then DP 1) replaces
``rank00000`` and leaves ``rank00001`` of the earlier run beside it. Every rank of one run records
the same parallel layout (TP, PP, DP, CP sizes) and a rank number inside its world; ranks of several
layouts are several runs: the ranks of the most recently written layout are taken as the run, the
others are named as stale (with what differs and the fix), MismatchError (exit 5).
"""

from __future__ import annotations

from ...bundle.store import Bundle
from ...errors import MismatchError, problem_lines

SIZES = ("tp_size", "pp_size", "dp_size", "cp_size")


def _layout(b: Bundle) -> tuple[int, ...]:
    c = b.manifest["megatron"].get("coords") or {}
    return tuple(int(c.get(k, 1) or 1) for k in SIZES)


def _written(b: Bundle) -> float:
    try:
        return (b.path / "manifest.json").stat().st_mtime
    except OSError:
        return 0.0


def _text(layout: tuple[int, ...]) -> str:
    return " x ".join(f"{k.split('_')[0].upper()} {v}" for k, v in zip(SIZES, layout))


def check_stale(bundles: list[Bundle]) -> None:
    """MismatchError naming the rank captures of an earlier run (another parallel layout, or a rank number
    outside the newest layout's world) among ``bundles``."""
    groups: dict[tuple[int, ...], list[Bundle]] = {}
    for b in bundles:
        groups.setdefault(_layout(b), []).append(b)
    newest = max(groups, key=lambda k: max(_written(b) for b in groups[k]))
    world = 1
    for v in newest:
        world *= v
    stale = [b for k, bs in groups.items() if k != newest for b in bs]
    stale += [b for b in groups[newest] if int((b.manifest["megatron"].get("coords") or {}).get("rank", 0)) >= world]
    if not stale:
        return
    lines = [f"{b.path}: {_text(_layout(b))}, rank {(b.manifest['megatron'].get('coords') or {}).get('rank')}" for b in stale]
    raise MismatchError(
        f"{len(stale)} rank capture(s) are not of the newest run in this folder ({_text(newest)}, {world} rank(s), "
        f"written last); left by an earlier run?" + problem_lines(lines, 8)
        + "\nMove them out of the folder (or capture each run into a folder of its own) and merge again."
    )
