"""A run's programs as one object: every program of the compile plan, lowered from abstract
arguments (shapes, dtypes and shardings, nothing allocated) and compiled ahead of time, for
this host or for a target it does not have (``parallel.targets``).

Each ``Program`` keeps its family and shape (``pipeline.compile_plan``'s), the model it runs,
its compile seconds and the compiler's own memory and cost analyses. The compile report
(``oppo-jax compile-plan``) and the memory report are views of a ``Registry``; a lookup at a
family and shape the plan did not list raises ``UnplannedProgram`` naming both.

Costs: XLA counts a loop's body once (``lax.scan`` over layers, decode steps, epochs), so
``program_cost`` multiplies each known trip count in (``pipeline.program_cost``).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax

from oppo_jax.pipeline.program_cost import program_cost

# custom-call targets of the kernels a report names: Pallas's Triton and Mosaic calls, cuDNN's
CUSTOM_KERNELS = ("triton", "tpu_custom_call", "mosaic", "cudnn")


class UnplannedProgram(KeyError):
    """A program asked for at a (family, shape) the compile plan does not list."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """One device's bytes of a compiled program (``compiled.memory_analysis()``)."""

    argument: int  # inputs, donated ones included
    output: int  # outputs, those written into donated inputs included
    alias: int  # outputs written in place of donated inputs
    temp: int  # XLA temporaries: activations, gathered weights, gradients...
    host: int  # bytes the program keeps in host memory (offloaded arguments, outputs, temps)

    @classmethod
    def of(cls, compiled) -> ProgramMemory:
        m = compiled.memory_analysis()
        host = sum(
            getattr(m, f"host_{kind}_size_in_bytes", 0) for kind in ("argument", "output", "temp")
        )
        sizes = (m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes)
        return cls(*sizes, m.temp_size_in_bytes, host)

    @property
    def peak(self) -> int:
        """Inputs, new outputs and temporaries all live at once (an upper bound)."""
        return self.argument + self.output - self.alias + self.temp


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program of a run."""

    family: str  # the compile plan's family (``shapes.FAMILIES``)
    shape: tuple  # its shape in the plan (what ``compile_plan.Family.shapes`` lists)
    role: str  # the model it runs: actor, reference, critic, reward ("" for no one model)
    compiled: Any  # jax.stages.Compiled
    compile_s: float  # lowering and compilation, seconds
    memory: ProgramMemory
    cost: dict  # {"flops", "bytes_accessed"} per device, loop trip counts multiplied in

    @property
    def key(self) -> tuple:
        return (self.family, self.shape, self.role)

    @property
    def kernels(self) -> list[str]:
        """The custom kernels the compiled program calls: Pallas (Triton on a GPU, Mosaic on
        a TPU) and cuDNN's, by their custom-call targets."""
        text = self.compiled.as_text() or ""
        calls = set(re.findall(r'custom_call_target="([^"]+)"', text))
        return sorted(c for c in calls if any(k in c for k in CUSTOM_KERNELS))

    def row(self) -> dict:
        """The program as the compile report prints it."""
        return {
            "family": self.family,
            "shape": list(self.shape),
            "role": self.role,
            "compile_s": round(self.compile_s, 3),
            **{f"{k}_bytes": v for k, v in dataclasses.asdict(self.memory).items()},
            "peak_bytes": self.memory.peak,
            **self.cost,
            "kernels": self.kernels,
        }


@dataclasses.dataclass
class Registry:
    """Every planned program of a run, compiled for one target."""

    target: str  # the target's name (``parallel.targets.Target.name``)
    compiler: str  # e.g. "XLA:TPU (libtpu 0.0.42.1, jaxlib 0.10.2)"
    programs: list[Program] = dataclasses.field(default_factory=list)
    # (family, shape, role) -> the program that serves it: each program's own key, and the
    # keys of roles served by another role's program (the reference by the actor's)
    served: dict = dataclasses.field(default_factory=dict)

    def add(self, program: Program, key: tuple | None = None) -> None:
        """Record ``program``; with ``key``, as serving that (family, shape, role) too."""
        if key is None:
            self.programs.append(program)
        self.served[key or program.key] = program

    def program(self, family: str, shape: tuple, role: str = "actor") -> Program:
        """The program of ``family`` at ``shape`` for ``role``; ``UnplannedProgram`` if the
        plan did not list it."""
        key = (family, tuple(shape), role)
        if key in self.served:
            return self.served[key]
        planned = sorted({str(k[1]) for k in self.served if k[0] == family})
        raise UnplannedProgram(
            f"{family} program at shape {tuple(shape)} for {role} is not in the compile plan "
            f"(planned shapes of {family}: {', '.join(planned) or 'none'})"
        )

    def by_family(self) -> dict[str, list[Program]]:
        out: dict[str, list[Program]] = {}
        for p in self.programs:
            out.setdefault(p.family, []).append(p)
        return out

    @property
    def compile_s(self) -> float:
        return sum(p.compile_s for p in self.programs)

    def worst(self) -> Program | None:
        """The program whose new outputs and temporaries take the most bytes per device."""
        return max(
            self.programs,
            key=lambda p: p.memory.temp + p.memory.output - p.memory.alias,
            default=None,
        )


def compile_program(
    family: str, shape: tuple, role: str, fn: Callable, args: Iterable, options=None
) -> Program:
    """Lower ``fn`` (a ``jax.jit``) at ``args`` (ShapeDtypeStructs with their shardings) and
    compile it, with XLA ``options`` (a dict of debug options, or None)."""
    start = time.perf_counter()
    compiled = fn.lower(*args).compile(options or None)
    seconds = time.perf_counter() - start
    return Program(
        family,
        tuple(shape),
        role,
        compiled,
        seconds,
        ProgramMemory.of(compiled),
        program_cost(compiled),
    )


def abstract_like(tree):
    """``tree`` of ShapeDtypeStructs (a compiled program's ``out_info``) as arguments of the
    next program: shape, dtype and sharding, without the layout a compiled output carries."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        tree,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
    )
