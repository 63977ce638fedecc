"""WGSL kernels from kernels/wgsl: assembly, pipelines, bind groups, uniform packing.

A kernel's source is `const` lines for its compile-time constants, then common.wgsl, then
(for kernels that read weights) weights.wgsl, then the kernel file. The kernel file is the
single source of truth for its interface: the host reads its `@binding` declarations to
build the bind group layout, and its `struct Shape` to pack the per-dispatch uniform.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import kernels

WGSL_DIR = Path(kernels.__file__).parent / "wgsl"
_PRELUDE = ("common",)
_READS_WEIGHTS = {"linear", "linear_rows", "embed"}

_BINDING = re.compile(r"@group\(0\)\s*@binding\((\d+)\)\s*var<(\w+)(?:,\s*(\w+))?>\s*(\w+)")
_SHAPE = re.compile(r"struct Shape\s*\{(.*?)\}", re.S)
_FIELD = re.compile(r"(\w+)\s*:\s*(u32|i32|f32)")


def wgsl_source(name: str) -> str:
    return (WGSL_DIR / f"{name}.wgsl").read_text()


def _constant_line(name: str, value) -> str:
    if isinstance(value, bool):
        return f"const {name}: bool = {'true' if value else 'false'};"
    if isinstance(value, int):
        return f"const {name}: u32 = {value}u;"
    if isinstance(value, float):
        return f"const {name}: f32 = {value!r};"
    raise TypeError(f"shader constant {name} must be bool, int or float, got {type(value).__name__}")


@dataclass(frozen=True)
class Binding:
    index: int
    kind: str  # "uniform", "read" or "read_write"
    name: str


class Kernel:
    """One compiled compute pipeline and the interface read from its source."""

    def __init__(self, ctx, name: str, constants: dict, dynamic: dict | None = None):
        self.ctx = ctx
        self.name = name
        # bindings bound at a dynamic offset: name -> the bytes the shader sees from that offset
        self.dynamic = dict(dynamic or {})
        own = wgsl_source(name)
        parts = [_constant_line(k, v) for k, v in sorted(constants.items())]
        parts += [wgsl_source(p) for p in _PRELUDE]
        if name in _READS_WEIGHTS:
            parts.append(wgsl_source("weights"))
        parts.append(own)
        self.source = "\n".join(parts)
        self.bindings = self._parse_bindings(self.source)
        shape = _SHAPE.search(own)
        self.shape_fields = _FIELD.findall(shape.group(1)) if shape else []

        wgpu = ctx.wgpu
        binding_types = {
            "uniform": wgpu.BufferBindingType.uniform,
            "read": wgpu.BufferBindingType.read_only_storage,
            "read_write": wgpu.BufferBindingType.storage,
        }
        layout = ctx.device.create_bind_group_layout(entries=[
            {"binding": b.index, "visibility": wgpu.ShaderStage.COMPUTE,
             "buffer": {"type": binding_types[b.kind], "has_dynamic_offset": b.name in self.dynamic}}
            for b in self.bindings
        ])
        self.layout = layout
        module = ctx.device.create_shader_module(label=name, code=self.source)
        self.pipeline = ctx.device.create_compute_pipeline(
            label=name,
            layout=ctx.device.create_pipeline_layout(bind_group_layouts=[layout]),
            compute={"module": module, "entry_point": "main"},
        )

    @staticmethod
    def _parse_bindings(source: str) -> list[Binding]:
        bindings = []
        for index, space, access, name in _BINDING.findall(source):
            kind = "uniform" if space == "uniform" else ("read_write" if access == "read_write" else "read")
            bindings.append(Binding(int(index), kind, name))
        return sorted(bindings, key=lambda b: b.index)

    def shape_words(self, values: dict) -> np.ndarray:
        """The Shape uniform's bytes: every field by name (pad fields default to 0)."""
        names = {name for name, _ in self.shape_fields}
        unknown = set(values) - names
        missing = {n for n in names if not n.startswith("pad")} - set(values)
        if unknown or missing:
            raise KeyError(f"kernel {self.name}: Shape fields unknown {sorted(unknown)}, missing {sorted(missing)}")
        words = np.zeros(max(4, (len(self.shape_fields) + 3) // 4 * 4), dtype=np.uint32)
        for i, (name, kind) in enumerate(self.shape_fields):
            value = values.get(name, 0)
            if kind == "f32":
                words[i] = np.float32(value).view(np.uint32)
            elif kind == "i32":
                words[i] = np.int32(value).view(np.uint32)
            else:
                if not 0 <= int(value) < 2**32:
                    raise OverflowError(f"kernel {self.name}: Shape.{name} = {value} does not fit in u32")
                words[i] = int(value)
        return words

    def bind(self, step, shape: dict, buffers: dict) -> "Bound":
        """A dispatchable: this pipeline, the step uniform, a Shape uniform, and named buffers."""
        resources = {"step": step, "shape": self.ctx.uniform(self.shape_words(shape), f"{self.name}.shape")}
        resources.update(buffers)
        missing = [b.name for b in self.bindings if b.name not in resources]
        if missing:
            raise KeyError(f"kernel {self.name}: no buffer for bindings {missing}")
        group = self.ctx.device.create_bind_group(layout=self.layout, entries=[
            {"binding": b.index, "resource": {"buffer": resources[b.name], "offset": 0,
                                              "size": self.dynamic.get(b.name, resources[b.name].size)}}
            for b in self.bindings
        ])
        return Bound(self, group, resources)

    @property
    def dynamic_order(self) -> list[str]:
        """Names of the dynamic-offset bindings, in the order set_bind_group takes their offsets."""
        return [b.name for b in self.bindings if b.name in self.dynamic]


@dataclass
class Bound:
    kernel: Kernel
    group: object
    resources: dict  # keeps every bound buffer alive as long as the bind group

    def encode(self, compute_pass, groups: tuple[int, int, int], offsets: tuple[int, ...] = ()) -> None:
        if 0 in groups:
            return
        compute_pass.set_pipeline(self.kernel.pipeline)
        compute_pass.set_bind_group(0, self.group, offsets)
        compute_pass.dispatch_workgroups(*groups)


class KernelCache:
    """Pipelines by (kernel, constants): each variant is compiled once per device."""

    def __init__(self, ctx):
        self.ctx = ctx
        self._kernels: dict[tuple, Kernel] = {}

    def get(self, name: str, dynamic: dict | None = None, **constants) -> Kernel:
        key = (name, tuple(sorted(constants.items())), tuple(sorted((dynamic or {}).items())))
        if key not in self._kernels:
            self._kernels[key] = Kernel(self.ctx, name, constants, dynamic)
        return self._kernels[key]
