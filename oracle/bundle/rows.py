"""One tensor written to a safetensors file by consecutive row blocks: never whole in memory.

The streaming replay writes the head's float64 gradient (151936 x 4096 for Qwen3-VL-8B: 4.6 GiB)
one vocabulary chunk at a time. The file is an ordinary safetensors file holding one tensor: the
header first (its size is known from shape and dtype), then the rows in order. Its manifest entry
(dtype, shape, sha256 of the stored bytes, value_sha256 of the values in float64 with the shape
first, as oracle/bundle/store.py defines them) is hashed on the fly from the blocks as they are
written. Rows must arrive in order and all of them, else ``close`` refuses.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import threading
from pathlib import Path

import torch

from . import store
from .atomic_file import open_new
from .plain import plain

_ZERO_ELEMS = 2**21  # elements hashed per slice of zero rows: 16 MiB of float64 zeros, made at the first use


@functools.cache
def _zero_bytes() -> memoryview:
    return memoryview(bytes(_ZERO_ELEMS * 8))


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class RowWriter:
    def __init__(self, path: str | os.PathLike, name: str, shape: list[int], dtype: torch.dtype):
        self.path, self.name, self.shape, self.dtype = Path(path), name, [int(s) for s in shape], dtype
        self.item = dtype.itemsize  # (no tensor made: this can run inside a replay's dispatch mode)
        self.row_elems = 1
        for s in self.shape[1:]:
            self.row_elems *= s
        total = self.shape[0] * self.row_elems * self.item
        header = json.dumps({name: {"dtype": _ST_DTYPES[dtype], "shape": self.shape, "data_offsets": [0, total]}})
        header += " " * (-len(header) % 8)  # safetensors pads its header to 8 bytes
        self._f = open_new(self.path)  # a symlink left at the name is replaced, never written through
        self._f.write(struct.pack("<Q", len(header)) + header.encode())
        self._sha = hashlib.sha256()
        self._value = hashlib.sha256(json.dumps(self.shape).encode())
        self.rows = 0

    def write(self, block: torch.Tensor) -> None:
        """The next ``block.shape[0]`` rows."""
        with plain():  # the stored values and their float64 hash, whatever mode is active (plain.py)
            block = block.detach().contiguous().to(self.dtype)
            if list(block.shape[1:]) != self.shape[1:] or self.rows + block.shape[0] > self.shape[0]:
                raise ValueError(f"{self.name}: block {tuple(block.shape)} does not continue rows {self.rows} of {self.shape}")
            data = memoryview(block.reshape(-1).view(torch.uint8).numpy())
            self._f.write(data)
            self._hash(data, data if self.dtype == torch.float64 else memoryview(block.double().reshape(-1).view(torch.uint8).numpy()))
        self.rows += block.shape[0]

    def zeros(self, n: int) -> None:
        """The next ``n`` rows, every value +0.0, left as a hole in the file: a sparse file reads them back
        as zero bytes (+0.0 in every float format) and holds no disk blocks for them, so a token embedding's
        gradient (oracle/replay/streaming/embedding.py: 4.6 GiB in float64 for Qwen3-VL-8B, all but the
        step's few thousand used rows zero) costs the disk its used rows only. Hashed as if written: the
        same zero bytes in the same order, so the entry is the dense tensor's."""
        if n < 0 or self.rows + n > self.shape[0]:
            raise ValueError(f"{self.name}: {n} zero rows do not continue rows {self.rows} of {self.shape}")
        left = n * self.row_elems  # elements
        while left:
            k = min(left, _ZERO_ELEMS)
            self._hash(_zero_bytes()[: k * self.item], _zero_bytes()[: k * 8])  # float64 values: 8 zero bytes each
            left -= k
        self._f.seek(n * self.row_elems * self.item, os.SEEK_CUR)
        self.rows += n

    def _hash(self, stored: memoryview, values: memoryview) -> None:
        """Both hashes over the next bytes: from store.PARALLEL_HASH_MIN bytes on two threads
        (store.entry_hashes' reasoning: hashlib releases the GIL)."""
        worker = None
        if len(stored) >= store.PARALLEL_HASH_MIN:
            worker = threading.Thread(target=self._sha.update, args=(stored,), name="oracle-hash", daemon=True)
            worker.start()
        else:
            self._sha.update(stored)
        try:
            self._value.update(values)
        finally:
            if worker is not None:
                worker.join()

    def close(self) -> dict:
        """Flush and fsync the file; its manifest entry."""
        if self.rows != self.shape[0]:
            self._f.close()
            raise ValueError(f"{self.name}: {self.rows} of {self.shape[0]} rows written")
        self._f.truncate()  # the file's end where the last rows were zeros (a hole): size set, nothing written
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return {"dtype": str(self.dtype).removeprefix("torch."), "shape": self.shape, "sha256": self._sha.hexdigest(),
                "value_sha256": self._value.hexdigest()}  # fmt: skip
