"""Expert files for the streaming tests, written with the checkpoint's own ExpertFileWriter.

E = experts of a layer, I = an expert's intermediate size, D = hidden size.
"""
from __future__ import annotations

import os
import zlib

import numpy as np

from converters.expert_file import ExpertFileWriter
from quant import Scheme, quantize
from quant.expert_file import EXPERTS_FILE, PROJECTIONS, ExpertIndex, ExpertLayout


def expert_weights(layer: int, expert: int, intermediate: int, hidden: int, scheme: Scheme) -> dict:
    """Deterministic weights of one expert: gate/up [I, D], down [D, I], in `scheme`."""
    rng = np.random.default_rng(1000 * layer + expert)
    shapes = {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate)}
    weights = {}
    for projection, shape in shapes.items():
        value = rng.standard_normal(shape).astype(np.float32)
        weights[projection] = quantize(value, scheme) if scheme.is_quantized else value.astype(scheme.dtype)
    return weights


def write_expert_file(folder: str, layers: dict[int, int], intermediate: int = 64, hidden: int = 64,
                      scheme: str = "int4_sym_g32", compression: str | None = None) -> ExpertIndex:
    """experts.bin in `folder` with layers {layer: number of experts}; returns its index."""
    os.makedirs(folder, exist_ok=True)
    parsed = Scheme.parse(scheme)
    shapes = {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate)}
    layout = ExpertLayout.plan({p: parsed for p in PROJECTIONS}, shapes)
    with ExpertFileWriter(os.path.join(folder, EXPERTS_FILE), compression) as writer:
        for layer, n_experts in layers.items():
            writer.add_layer(layer, layout, n_experts)
            for expert in range(n_experts):
                writer.write(layer, expert, expert_weights(layer, expert, intermediate, hidden, parsed))
    return ExpertIndex(folder, writer.entry())


def raw_bytes(index: ExpertIndex, layer: int, expert: int) -> bytes:
    """The expected raw record of an expert, encoded again from its deterministic weights."""
    layout = index.layout(layer)
    gate = layout.projections["gate_proj"]
    scheme, (intermediate, hidden) = gate.scheme, gate.shape
    return layout.encode(expert_weights(layer, expert, intermediate, hidden, scheme))


def read_records_through_preadv(monkeypatch) -> None:
    """Route the store's batch reads (a compiled call that does not go through Python's os module)
    through `streaming.store.os.preadv`, so a test can hold or fail reads by patching that."""
    import ctypes

    from streaming import store as store_module

    def read_records(fd, offsets, spans, lengths, addresses, checksum, got, crcs):
        for i in range(len(offsets)):
            target = (ctypes.c_char * int(spans[i])).from_address(int(addresses[i]))
            try:
                got[i] = store_module.os.preadv(fd, [memoryview(target).cast("B")], int(offsets[i]))
            except OSError:
                got[i] = -1  # as the compiled reader reports a failed pread
                continue
            if checksum:
                crcs[i] = zlib.crc32(memoryview(target).cast("B")[:min(int(got[i]), int(lengths[i]))])
        return len(offsets)  # one read call per record

    monkeypatch.setattr(store_module, "read_records", read_records)


def damaged_copy(index: ExpertIndex, tmp_path, layer: int, expert: int, how: str) -> ExpertIndex:
    """`index` (changed in place: pass a copy) pointed at a copy of its expert file under tmp_path/damaged
    in which the record of (layer, expert) is damaged: "corrupt" (one byte flipped), "unreadable" (a zstd
    frame's magic number gone) or "truncate" (the file cut inside the record)."""
    folder = tmp_path / "damaged"
    folder.mkdir()
    data = bytearray(open(index.path, "rb").read())
    record = index.record(layer, expert)
    if how == "corrupt":
        data[record.offset + record.length // 2] ^= 0xFF
    elif how == "unreadable":  # a record whose first bytes (a zstd frame's magic number) are gone
        data[record.offset: record.offset + 4] = bytes(4)
    else:  # truncate inside the record
        data = data[: record.offset + record.length // 3]
    (folder / "experts.bin").write_bytes(bytes(data))
    index.path = os.fspath(folder / "experts.bin")
    return index
