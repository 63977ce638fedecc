"""The writer of experts.bin, the routed experts' record file (the layout and the reader are
quant/expert_file.py)."""
from __future__ import annotations

import os

import numpy as np
import zstandard
from isal.isal_zlib import crc32

from quant import QuantizedTensor
from quant.expert_file import ALIGNMENT, COMPRESSIONS, INDEX_SHA256, ExpertLayout, ExpertRecord, align, index_sha256


class ExpertFileWriter:
    """Appends expert records, aligned, optionally zstd-compressed; `entry()` is the manifest's index,
    sealed with its sha256."""

    def __init__(self, path: str, compression: str | None = None, level: int = 3):
        if compression not in COMPRESSIONS:
            raise ValueError(f"expert compression {compression!r} is not supported; choose none or zstd")
        self.path = path
        self.compression = compression
        self._compressor = zstandard.ZstdCompressor(level=level) if compression == "zstd" else None
        self._file = open(path, "wb")
        self._layers: dict[int, dict] = {}

    def add_layer(self, layer: int, layout: ExpertLayout, num_experts: int) -> None:
        self._layers[layer] = {"layout": layout, "num_experts": num_experts, "records": [None] * num_experts}

    def write(self, layer: int, expert: int, weights: dict[str, np.ndarray | QuantizedTensor]) -> ExpertRecord:
        info = self._layers[layer]
        raw = info["layout"].encode(weights)
        stored = self._compressor.compress(raw) if self._compressor else raw
        offset = align(self._file.tell(), ALIGNMENT)
        self._file.seek(offset)
        self._file.write(stored)
        record = ExpertRecord(offset, len(stored), crc32(stored))
        info["records"][expert] = record
        return record

    def close(self) -> None:
        if not self._file.closed:
            # pad the tail so the last record, too, can be read with an aligned O_DIRECT read
            end = align(self._file.tell(), ALIGNMENT)
            self._file.truncate(end)
            self._file.close()

    def entry(self) -> dict:
        missing = [(layer, e) for layer, info in self._layers.items()
                   for e, r in enumerate(info["records"]) if r is None]
        if missing:
            raise ValueError(f"experts never written, e.g. (layer, expert) {missing[:3]}")
        entry = {"file": os.path.basename(self.path), "alignment": ALIGNMENT, "compression": self.compression,
                 "layers": {str(layer): {"num_experts": info["num_experts"], "raw_length": info["layout"].raw_length,
                                         "projections": info["layout"].to_manifest(),
                                         "records": [[r.offset, r.length, r.crc32] for r in info["records"]]}
                            for layer, info in sorted(self._layers.items())}}
        return entry | {INDEX_SHA256: index_sha256(entry)}

    def __enter__(self) -> "ExpertFileWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

