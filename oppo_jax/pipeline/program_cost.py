"""FLOPs and bytes a compiled program moves per device, with its loops' trip counts in.

XLA's cost analysis visits a ``while`` body once, so a ``lax.scan`` over 28 layers or C decode
steps is counted as one iteration. The optimized HLO records each loop's ``known_trip_count``;
the true cost of a computation is then

    T(c) = xla(c) - sum_w xla(body_w) + sum_w n_w * T(body_w)

over the loops w that ``c`` runs (directly, or through calls and conditionals), where xla(c)
is XLA's count of ``c`` as an entry computation (its loops' bodies once each). Where the compiler
recorded no trip count (XLA:TPU), a loop counting ``i < N`` from 0 runs N times; any other
loop counts once, as XLA counts it.

The analysis is XLA's ``HloCostAnalysis`` run on the host's CPU client over the optimized
per-device module: the one route that works for every target (a deviceless GPU executable
has no ``cost_analysis()``). Pallas and other custom calls count no FLOPs there.
"""

from __future__ import annotations

import functools
import re

import jax

KEYS = {"flops": "flops", "bytes accessed": "bytes_accessed"}
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) ")
_WHILE = re.compile(r"\bwhile\(.*\bcondition=%([\w.\-]+), body=%([\w.\-]+)")
_CONSTANT = re.compile(r"%([\w.\-]+) = s32\[\]\S* constant\((\d+)\)")
_LESS = re.compile(r"compare\(%([\w.\-]+), %([\w.\-]+)\), direction=LT")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(
    r"\b(?:calls|to_apply|true_computation|false_computation|branch_computations)="
    r"\{?(%[\w.\-]+(?:, ?%[\w.\-]+)*)\}?"
)


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    """{name: its lines} of an HLO module's text, and the entry computation's name."""
    found, entry, name = {}, "", None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head and line.rstrip().endswith("{"):
            name = head.group(2)
            found[name] = [line]
            entry = name if head.group(1) else entry
        elif name is not None:
            found[name].append(line)
            if line.rstrip() == "}":  # a custom call's config may hold a line opening "}}"
                name = None
    return found, entry


def _loops(comps: dict[str, list[str]], name: str) -> list[tuple[str, int, bool]]:
    """(body, trip count, exact) of every loop ``name`` runs, through calls but not through
    loops (``_bound`` where the compiler recorded no count)."""
    loops, todo, seen = [], [name], set()
    while todo:
        current = todo.pop()
        if current in seen or current not in comps:
            continue
        seen.add(current)
        for line in comps[current][1:]:
            if (loop := _WHILE.search(line)) is not None:
                condition, body = loop.groups()
                trip = _TRIP.search(line)
                loops.append(
                    (body, *((int(trip.group(1)), True) if trip else _bound(comps, condition)))
                )
                continue
            for called in _CALLED.findall(line):
                todo += [c.strip().lstrip("%") for c in called.split(",")]
    return loops


def _bound(comps: dict[str, list[str]], condition: str) -> tuple[int, bool]:
    """(trip count, exact) of a loop the compiler recorded none for (XLA:TPU's scans; a
    ``while_loop`` that may stop early, as the decode chunk does at the cut): the ``N`` of
    the condition's one ``i < N`` on a constant, a scan's count when that compare is the whole
    condition and an upper bound when more is and-ed to it; (1, False) when there is none."""
    lines = comps.get(condition, [])
    called = [c.strip().lstrip("%") for line in lines for m in _CALLED.findall(line)
              for c in m.split(",")]  # fmt: skip
    within = lines + [line for c in called for line in comps.get(c, [])]  # its fusions
    constants = dict(_CONSTANT.findall("\n".join(within)))
    bounds = set()
    for line in within:
        if (lt := _LESS.search(line)) is not None and lt.group(2) in constants:
            bounds.add(int(constants[lt.group(2)]))
    if len(bounds) != 1:
        return 1, False
    root = next((line for line in lines if "ROOT" in line), "")
    exact = "direction=LT" in root or ("compare" in root and len(called) <= 1 and "and" not in root)
    return bounds.pop(), exact


def _as_entry(text: str, comps: dict[str, list[str]], entry: str, name: str) -> str:
    """The module's text with ``name`` as its entry computation (the old one kept, unused)."""
    # the module's name only: its entry layout and aliasing describe the old entry
    header = text.splitlines()[0].split(",")[0]
    body = []
    for comp, lines in comps.items():
        first = lines[0].removeprefix("ENTRY ")
        body.append(("ENTRY " + first if comp == name else first, *lines[1:]))
    return "\n".join([header, *("\n".join(lines) for lines in body)])


@functools.cache
def _cpu_client():
    return jax.devices("cpu")[0].client


def _xla_cost(text: str) -> dict[str, float]:
    from jax._src.lib import _jax
    from jaxlib import _hlo

    module = _hlo.hlo_module_from_text(text)
    raw = _jax.hlo_module_cost_analysis(_cpu_client(), module)
    return {out: float(raw.get(key, 0.0)) for key, out in KEYS.items()}


def program_cost(compiled) -> dict:
    """{"flops", "bytes_accessed"} one device runs in ``compiled``, loops' trip counts
    multiplied in (module docstring); "loops_multiplied": whether that worked (False: XLA's
    own counts, each loop body once); "upper_bound": whether a loop that may stop early (the
    decode chunk's, at the cut) was counted at its bound (C steps)."""
    text = compiled.runtime_executable().hlo_modules()[0].to_string()
    text = re.sub(r", metadata=\{[^}]*\}", "", text)  # source locations the parser rejects
    comps, entry = _computations(text)
    memo: dict[str, dict[str, float]] = {}
    bounded = []  # loops counted at an upper bound of their trips

    def total(name: str) -> dict[str, float]:
        if name not in memo:
            own = _xla_cost(_as_entry(text, comps, entry, name))
            for body, trips, exact in _loops(comps, name):
                once, inner = _xla_cost(_as_entry(text, comps, entry, body)), total(body)
                own = {k: own[k] - once[k] + trips * inner[k] for k in own}
                bounded.extend([] if exact else [body])
            memo[name] = own
        return memo[name]

    try:
        cost = total(entry)
        return {k: int(v) for k, v in cost.items()} | {
            "loops_multiplied": True,
            "upper_bound": bool(bounded),  # a loop that may stop early counted to its bound
        }
    except Exception:  # an HLO this route cannot parse: XLA's own counts, labelled as such
        raw = compiled.cost_analysis()
        raw = (raw[0] if isinstance(raw, list) else raw) or {}
        counts = {out: int(raw.get(key, 0)) for key, out in KEYS.items()}
        return counts | {"loops_multiplied": False, "upper_bound": False}
