"""Stand-in for ``torchair`` (Ascend's torch.compile backend to the GE graph engine), test support.

MindSpeed's op builders import it only to register graph-mode converters for their custom ops
(``@register_fx_node_ge_converter(op)``), which run when a model is compiled to a GE graph, never in
eager mode (the user's step). Here the decorator registers nothing and returns the converter; any
graph-building call (``ge.custom_op`` ...) raises."""

from . import ge  # noqa: F401

CONVERTERS: list = []


def register_fx_node_ge_converter(op):
    def register(fn):
        CONVERTERS.append((op, fn))
        return fn

    return register
