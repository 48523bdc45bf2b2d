"""The conversion report: what ``convert`` did to each layer, and the sizes that follow."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["LayerRecord", "SkippedRecord", "ConversionReport", "format_bytes"]


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000.0
    return f"{n:.2f} GB"


@dataclass
class LayerRecord:
    """One converted layer.

    Attributes:
        name: module name in the model.
        role: ``stem`` / ``body`` / ``shortcut`` / ``head``.
        module: class name of the host module (its own forward is kept).
        kind: e.g. ``3x3``, ``3x3 dw``, ``1x1 g4``, ``linear``.
        weight_shape: shape of the weight (and of the temporary weights W).
        kernels: d, the number of pool vectors that build the layer.
        vector_size: D, floats per pool vector.
        pool_size: n, pool entries.
        bits: bits per stored index.
        found_by: ``torch.fx`` or ``module walk``.
        note: anything the user should know (group size fallback, ...).
    """

    name: str
    role: str
    module: str
    kind: str
    weight_shape: tuple
    kernels: int
    vector_size: int
    pool_size: int
    bits: int
    found_by: str
    note: str = ""

    @property
    def dense_bytes(self) -> int:
        return self.kernels * self.vector_size * 4

    @property
    def pool_bytes(self) -> int:
        return self.pool_size * self.vector_size * 4

    @property
    def index_bytes(self) -> int:
        """Bytes of one task's indices of this layer at fixed width (packs store that or less)."""
        return (self.kernels * self.bits + 7) // 8

    @property
    def bits_per_weight(self) -> float:
        """Index bits a task stores per weight of this layer: ``bits / vector_size``."""
        return self.bits / self.vector_size


@dataclass
class SkippedRecord:
    """A Conv2d/Linear layer left dense, with the reason."""

    name: str
    module: str
    weight_shape: tuple
    reason: str


@dataclass
class ConversionReport:
    """What :func:`nwsconvert.convert` did. ``print(report)`` shows a table.

    Attributes:
        layers: converted layers, in module order.
        skipped: layers left dense, with reasons.
        trace: how layers and roles were found (``torch.fx`` or module walk + why).
        options: the converter options (JSON-able); with the pool file they rebuild the model.
            ``options["planned_for"]``: the budget the layers were planned for, if any.
        state_bytes: one task's state (BatchNorm, biases, dense layers) at float16, as nws-train
            stores it; ``None`` in reports written before it was counted.
    """

    layers: list[LayerRecord] = field(default_factory=list)
    skipped: list[SkippedRecord] = field(default_factory=list)
    trace: str = "torch.fx"
    options: dict = field(default_factory=dict)
    state_bytes: int | None = None

    @property
    def dense_bytes(self) -> int:
        """float32 bytes of the converted layers' weights (what one dense copy costs)."""
        return sum(r.dense_bytes for r in self.layers)

    @property
    def pool_bytes(self) -> int:
        return sum(r.pool_bytes for r in self.layers)

    @property
    def index_bytes(self) -> int:
        """Bytes of one task's bit-packed indices."""
        return sum(r.index_bytes for r in self.layers)

    @property
    def kernels(self) -> int:
        return sum(r.kernels for r in self.layers)

    @property
    def bits_per_weight(self) -> float:
        """Index bits per converted weight, one task at fixed width (what ``bits_per_weight=`` budgets)."""
        weights = sum(r.dense_bytes for r in self.layers) // 4
        return 8 * self.index_bytes / weights if weights else 0.0

    @property
    def task_bytes(self) -> int | None:
        """One task at fixed width: indices + state (what ``budget=`` budgets); packs store that or less."""
        return None if self.state_bytes is None else self.index_bytes + self.state_bytes

    def to_dict(self) -> dict:
        return {
            "trace": self.trace,
            "options": self.options,
            "layers": [asdict(r) for r in self.layers],
            "skipped": [asdict(r) for r in self.skipped],
            "totals": {
                "kernels": self.kernels,
                "dense_bytes": self.dense_bytes,
                "pool_bytes": self.pool_bytes,
                "index_bytes_per_task": self.index_bytes,
                "bits_per_weight": self.bits_per_weight,
                "state_bytes_per_task": self.state_bytes,
                "task_bytes": self.task_bytes,
            },
        }

    def table(self) -> str:
        head = ("layer", "role", "module", "kind", "weight", "kernels d", "D", "pool n", "bits", "bits/w", "task bytes")
        rows = [
            (
                r.name,
                r.role,
                r.module,
                r.kind,
                "x".join(map(str, r.weight_shape)),
                f"{r.kernels:,}",
                str(r.vector_size),
                str(r.pool_size),
                str(r.bits),
                f"{r.bits_per_weight:.2f}",
                format_bytes(r.index_bytes),
            )
            for r in self.layers
        ]
        widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]

        def line(cells):
            return "  ".join(c.rjust(w) if i >= 5 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

        out = [f"NWS conversion ({self.trace}): {len(self.layers)} layers converted, {len(self.skipped)} left dense"]
        out.append(line(head))
        out.append("  ".join("-" * w for w in widths))
        out.extend(line(r) for r in rows)
        for r in self.layers:
            if r.note:
                out.append(f"  note {r.name}: {r.note}")
        for s in self.skipped:
            out.append(f"  dense {s.name} ({s.module}, {'x'.join(map(str, s.weight_shape))}): {s.reason}")
        out.append(
            f"totals: {self.kernels:,} kernels | dense weights {format_bytes(self.dense_bytes)} | "
            f"pools {format_bytes(self.pool_bytes)} | indices per task {format_bytes(self.index_bytes)} "
            f"({self.bits_per_weight:.2f} bits a weight)"
        )
        if self.task_bytes is not None:
            planned = self.options.get("planned_for")
            out.append(
                f"a task at fixed width: {format_bytes(self.task_bytes)} = indices {format_bytes(self.index_bytes)} + "
                f"state {format_bytes(self.state_bytes or 0)} (float16; packs store that or less)"
                + (f"; planned for {planned}" if planned else "")
            )
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()
