"""``torchair.ge`` stand-in: the names MindSpeed's converters annotate with; graph building raises."""


class Tensor:  # a GE graph tensor (annotations only here)
    pass


class TensorSpec:
    pass


class DataType:
    DT_FLOAT, DT_FLOAT16, DT_BF16, DT_INT8, DT_UINT8, DT_INT32, DT_INT64, DT_UINT64 = range(8)


def _graph_only(name):
    def call(*a, **k):
        raise RuntimeError(f"torchair stand-in: ge.{name} builds a GE graph (graph mode), which the CPU stand-in has not")

    return call


custom_op = _graph_only("custom_op")
Const = _graph_only("Const")
Cast = _graph_only("Cast")
Fill = _graph_only("Fill")
