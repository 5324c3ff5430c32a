"""``oracle rank-view`` as a library call: what one Megatron rank held, from the oracle and its
recorded layout (each recorded value overridable), set against that rank's captures or the norm
logs it printed; the report printed through ``echo``, the JSON document returned."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Echo = Callable[[str], None]


@dataclass(frozen=True)
class RankViewOptions:
    oracle: str
    rank: int = 0
    pp_rank: int = 0
    tp: int | None = None  #: None: as recorded (likewise sp, stage, per_token_loss)
    sp: bool | None = None
    stage: str | None = None
    per_token_loss: bool | None = None
    seq_len_padded: int | None = None
    compare: tuple[str, ...] = ()  #: rank bundles of that rank
    logs: tuple[str, ...] = ()  #: grad-norm logs printed on that rank
    names: tuple[str, ...] | None = None
    occurrence: int | None = None
    json_out: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "oracle", os.fspath(self.oracle))
        object.__setattr__(self, "compare", tuple(os.fspath(p) for p in self.compare or ()))
        object.__setattr__(self, "logs", tuple(os.fspath(p) for p in self.logs or ()))
        object.__setattr__(self, "names", tuple(self.names) if self.names else None)
        if self.json_out is not None:
            object.__setattr__(self, "json_out", os.fspath(self.json_out))


def rank_view(opts: RankViewOptions, echo: Echo = print, warn: Echo | None = None) -> dict[str, Any]:
    """Print the view's comparison with each rank bundle and log; write ``json_out``; return the document."""
    from pathlib import Path

    from ..bundle.store import Bundle
    from ..integrations.megatron import rankview
    from ..report.outputs import check_file, writing

    json_out = Path(opts.json_out) if opts.json_out else None
    check_file(json_out, "--json", (opts.oracle, *opts.compare, *opts.logs))
    warnings: list[str] = []
    view = rankview.rank_view(opts.oracle, rank=opts.rank, pp_rank=opts.pp_rank, tp_size=opts.tp, sequence_parallel=opts.sp,
                              stage=opts.stage, calculate_per_token_loss=opts.per_token_loss,
                              seq_len_padded=opts.seq_len_padded, warnings=warnings)  # fmt: skip
    lay, _ = rankview.recorded_layout(Bundle(opts.oracle), tp_size=opts.tp, sequence_parallel=opts.sp, stage=opts.stage,
                                      calculate_per_token_loss=opts.per_token_loss)  # fmt: skip
    for wmsg in warnings:
        (warn or echo)(f"warning: {wmsg}")
    loss = "per-token (sum before finalize)" if lay["calculate_per_token_loss"] else "mean"
    echo(f"rank view: TP={lay['tp_size']}{' SP' if lay['sequence_parallel'] else ''} rank {opts.rank}, stage {opts.pp_rank} "
         f"of PP {lay['pp_size']}, {lay['stage']}, {loss} loss: {len(view)} gradients")  # fmt: skip
    doc: dict[str, Any] = {"layout": lay, "rank": opts.rank, "pp_rank": opts.pp_rank, "warnings": warnings, "compare": {},
                           "logs": None}  # fmt: skip
    for b in opts.compare:
        errs = rankview.compare_rank(view, b)
        doc["compare"][str(b)] = errs
        if not errs:
            echo(f"  {b}: no gradient in common with the view")
            continue
        worst = max(errs, key=errs.get)
        echo(f"  {b}: {len(errs)} gradients, max rel L2 {errs[worst]:.2e} ({worst})")
        w = max(len(n) for n in errs)
        echo(f"    {'parameter':<{w}} {'rel L2':>9}")
        for n in sorted(errs):
            echo(f"    {n:<{w}} {errs[n]:>9.2e}")
    if opts.logs:
        from ..integrations import normlog

        parsed = [normlog.parse(p, occurrence=opts.occurrence) for p in opts.logs]
        labels = list(opts.names) if opts.names else [Path(p).stem for p in opts.logs]
        echo(rankview.compare_logs(view, parsed, labels))
        doc["logs"] = rankview.log_rows(view, parsed, labels)
    if json_out:
        from ..bundle.atomic_file import write_json

        with writing("--json", json_out):
            write_json(doc, json_out)
        echo(f"json: {json_out}")
    return doc
