"""mcore parameter names <-> Hugging Face names, from a recipe's template table.

Templates: ``{i}`` matches a layer index, ``{rest}`` any remaining dotted name; on the HF side
``{q,k,v}`` / ``{gate,up}`` expand, in that order, to the parts a fused mcore tensor splits into.
DDP / Float16Module wrappers add ``module.`` prefixes; they are stripped first.
"""

from __future__ import annotations

import re

from ...errors import RecipeError

_ALT = re.compile(r"\{([a-z_]+(?:,[a-z_]+)+)\}")


def strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


class NameMap:
    def __init__(self, templates: dict[str, str]):
        self.rules = []
        for mc, hf in templates.items():
            rx = re.escape(mc).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{rest\}", r"(?P<rest>.+)")
            self.rules.append((re.compile(f"^{rx}$"), hf))

    def to_hf(self, mcore: str) -> list[str]:
        name = strip_wrappers(mcore)
        for rx, hf in self.rules:
            m = rx.match(name)
            if m:
                out = hf.replace("{i}", m.groupdict().get("i") or "").replace("{rest}", m.groupdict().get("rest") or "")
                alt = _ALT.search(out)
                if not alt:
                    return [out]
                return [out[: alt.start()] + part + out[alt.end() :] for part in alt[1].split(",")]
        raise RecipeError(f"no HF name for the mcore parameter {mcore!r}; extend the recipe's megatron_names")
