"""The house's shape, read from the source (no import runs): layers import downward only, no
import cycle anywhere (package ``__init__`` files included), no private name crosses a module,
no function outside a Pallas kernel body takes more than 8 parameters, and the engine stays
within its line budget. The layers are docs/MAP.md's."""

import ast
import pathlib
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("oppo_jax", "oppo_tools")
# oppo_jax's layers, lowest first: a module imports only from lower layers or its own package.
LAYERS = (
    ("base",),
    ("config", "data", "models"),
    ("parallel",),
    ("rollout", "rewards"),
    ("scoring",),
    ("ppo",),
    ("pipeline",),
    ("demo",),
    ("run",),
    ("train", "export"),
    ("cli",),
)
# oppo_jax/, every shipped feature included: PPO's 14,000, plus 600 for the GRPO family (group
# sampling and group-atomic carry, the critic-free estimators and step, the verifiable task)
LINE_BUDGET = 14_600
MAX_PARAMS = 8


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, a package named by its ``__init__``."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _target(name: str) -> str | None:
    """The module or package an import of ``name`` loads (its longest known prefix)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, str, int, bool]]:
    """(imported module, imported name or "", line, inside a function) of every import statement
    in ``module``, at any depth (``TYPE_CHECKING`` blocks and function bodies included)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                found.extend((a.name, "", child.lineno, nested) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    if sub in MODULES:  # ``from package import module``
                        found.append((sub, "", child.lineno, nested))
                    else:
                        found.append((base, alias.name, child.lineno, nested))
            visit(child, nested)

    visit(ast.parse(path.read_text()), False)
    return [(t, n, line, f) for name, n, line, f in found if (t := _target(name))]


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _, _ in _imports(m) if t != m} for m in MODULES}


def _group(module: str) -> str:
    """oppo_jax's first-level package or root module ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycle_anywhere():
    graph, state, cycles = _graph(), {}, []

    def walk(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert not cycles, cycles


def test_layers_import_downward_only():
    rank = {group: i for i, layer in enumerate(LAYERS) for group in layer}
    engine = [m for m in MODULES if m.startswith("oppo_jax.")]
    assert {_group(m) for m in engine} == set(rank), "a package missing from LAYERS"
    upward = []
    for module in engine:
        for target, _, line, in_function in _imports(module):
            if target.startswith("oppo_tools"):
                # The tools import the engine; only the command line reaches them, lazily.
                if not (_group(module) == "cli" and in_function):
                    upward.append(f"{module}:{line} imports {target}")
                continue
            if target == "oppo_jax" or not target.startswith("oppo_jax."):
                continue
            a, b = _group(module), _group(target)
            if a != b and rank[b] >= rank[a]:
                upward.append(f"{module}:{line} ({a}) imports {target} ({b})")
    assert not upward, "\n".join(upward)


def test_no_private_name_crosses_a_module():
    crossing = []
    for module in MODULES:
        path = MODULES[module]
        aliases = {}
        for target, name, line, _ in _imports(module):
            if name.startswith("_") and not name.startswith("__") and target != module:
                crossing.append(f"{module}:{line} imports {target}.{name}")
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):  # ``import a.b as m`` / ``from a import b`` then ``m._x``
            if isinstance(node, ast.Import):
                for a in node.names:
                    if _target(a.name) == a.name:
                        aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    if f"{node.module}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                crossing.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not crossing, "\n".join(crossing)


def _is_pallas_body(fn: ast.FunctionDef) -> bool:
    """A Pallas kernel body takes its operands as refs, named ``*_ref``."""
    args = fn.args.posonlyargs + fn.args.args
    return bool(args) and args[0].arg.endswith("_ref")


def test_no_function_outside_pallas_bodies_takes_more_than_8_parameters():
    wide = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
            count = len([n for n in names if n not in ("self", "cls")])
            if count > MAX_PARAMS and not _is_pallas_body(node):
                wide.append(f"{module}.{node.name}: {count}")
    assert not wide, wide


def test_the_engine_stays_within_its_line_budget():
    lines = defaultdict(int)
    for path in (ROOT / "oppo_jax").rglob("*.py"):
        lines[path.relative_to(ROOT).parts[1]] += len(path.read_text().splitlines())
    total = sum(lines.values())
    assert total <= LINE_BUDGET, (total, sorted(lines.items(), key=lambda kv: -kv[1])[:5])


def test_the_checks_above_see_what_they_look_for():
    """The walkers find real imports (a failure here means a check above looks at nothing)."""
    step = _graph()["oppo_jax.pipeline.step"]
    assert "oppo_jax.pipeline.step_scorers" in step and "oppo_jax.pipeline.kernels" in step
    assert _is_pallas_body(ast.parse("def k(x_ref, o_ref, *, block): pass").body[0])
    imported = [t for t, _, _, f in _imports("oppo_jax.cli") if t.startswith("oppo_tools")]
    assert imported, "the CLI's lazy tool imports were not seen"


def test_the_map_and_the_readme_name_every_package_and_nothing_gone():
    """docs/MAP.md and the README's layout table stay current with the tree: every package of
    oppo_jax and oppo_tools appears in both, and every path the table names exists."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout") :].split("\n\n")[2]
    the_map = (ROOT / "docs" / "MAP.md").read_text()
    packages = sorted(
        p.relative_to(ROOT).as_posix() + "/"
        for package in PACKAGES
        for p in (ROOT / package).iterdir()
        if (p / "__init__.py").exists() or (p.is_dir() and any(p.glob("*.py")))
    )
    assert [p for p in packages if f"`{p}`" not in table] == []
    assert [p for p in packages if f"`{p.split('/', 1)[1]}`" not in the_map and
            f"`{p}`" not in the_map] == []  # fmt: skip
    named = [cell.split("`")[1] for cell in table.split("\n| ")[1:] if cell.startswith("`")]
    assert named and all((ROOT / n.rstrip("/")).exists() for n in named), named
