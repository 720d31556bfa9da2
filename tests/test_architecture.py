"""The house's shape, read from the source (no import runs): layers import downward only, no
import cycle anywhere (package ``__init__`` files included), no private name crosses a module,
no function other than a Pallas kernel body takes more than 8 parameters, no file is longer than
400 lines and no function longer than 60 (``OVER_CAP``, the debt, excepted). The layers are
docs/MAP.md's.

The checks are functions of a ``Tree`` (module sources by path), so that each can be run on a
small synthetic tree with a violation injected: the tests at the end show that each one sees
what it looks for, the ways around it included (a name from the lazy root package, an
``importlib`` import, another module's private attribute, a wide function named like a kernel,
a sibling imported through its package)."""

import ast
import functools
import pathlib
import re
from typing import NamedTuple

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
MAX_PARAMS = 8
MAX_FILE_LINES = 400  # a file's lines
MAX_FUNCTION_LINES = 60  # from the ``def`` line to the body's last, decorators excluded
# Debt to pay down, not a licence: the files ("path") and functions ("path:qualified name") over
# the caps above when the caps came in, with their lengths then. An entry may only shrink: the
# test fails when one grows, and when one is back under its cap or gone (then delete the entry).
OVER_CAP = {
    "oppo_jax/pipeline/step.py:run_step": 86,
    "oppo_jax/run/setup.py:prepare_run": 63,
    "oppo_tools/memory/report.py:memory_report": 83,
    "oppo_tools/sim/cli.py:_parser": 90,
}
# Debt of the same kind: imports (importer, package) that close a cycle through the package's
# ``__init__`` (``from oppo_tools.sim import packing`` inside the package that ``__init__``
# assembles), in files another change is restructuring. The cycle check leaves these edges out;
# the test fails when one is gone or closes no cycle any more (then delete its entry).
CYCLE_DEBT = {
    ("oppo_tools.sim.engines", "oppo_tools.sim"),
    ("oppo_tools.sim.work", "oppo_tools.sim"),
}


class Import(NamedTuple):
    target: str  # the project module (or package) the statement loads
    name: str  # the name taken from it, "" for the module itself
    line: int
    in_function: bool


class Tree:
    """The project's modules: dotted name -> source, a package named by its ``__init__``."""

    def __init__(self, files: dict[str, str]):
        self.files = files  # relative posix path -> source
        self.paths = {}  # dotted module name -> relative path
        for path in files:
            parts = path.removesuffix(".py").split("/")
            if parts[-1] == "__init__":
                parts.pop()
            self.paths[".".join(parts)] = path

    @classmethod
    def from_disk(cls, root: pathlib.Path = ROOT) -> "Tree":
        return cls(
            {
                p.relative_to(root).as_posix(): p.read_text()
                for package in PACKAGES
                for p in sorted((root / package).rglob("*.py"))
            }
        )

    @functools.cache  # noqa: B019 (a tree lives as long as the test session)
    def parse(self, module: str) -> ast.Module:
        return ast.parse(self.files[self.paths[module]])

    def is_package(self, module: str) -> bool:
        return self.paths[module].endswith("__init__.py")

    def target(self, name: str) -> str | None:
        """The module or package an import of ``name`` loads (its longest known prefix)."""
        while name and name not in self.paths:
            name = name.rpartition(".")[0]
        return name or None

    def package_of(self, module: str) -> str:
        return module if self.is_package(module) else module.rpartition(".")[0]

    def absolute(self, module: str, node: ast.ImportFrom) -> str:
        """The absolute name a ``from`` import in ``module`` reads from."""
        if not node.level:
            return node.module or ""
        parts = self.package_of(module).split(".")
        parts = parts[: len(parts) - node.level + 1]
        return ".".join(parts + ([node.module] if node.module else []))

    @functools.cache  # noqa: B019
    def exports(self, package: str) -> dict[str, str]:
        """Name -> module a package's ``__init__`` hands it out from: its ``from m import name``
        statements, and the tables of a lazy ``__getattr__`` (``{"name": "module"}``, values
        absolute or relative to the package, ``**dict.fromkeys(names, "module")`` included)."""
        found = {}
        for node in self.parse(package).body:
            if isinstance(node, ast.ImportFrom):
                base = self.absolute(package, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found[alias.asname or alias.name] = sub if sub in self.paths else base
        for node in ast.walk(self.parse(package)):
            if not isinstance(node, ast.Dict):
                continue
            for key, value in zip(node.keys, node.values, strict=True):
                if key is None and _is_call(value, "fromkeys") and len(value.args) == 2:
                    names, module = value.args
                    if isinstance(names, ast.Tuple | ast.List) and _is_str(module):
                        for name in names.elts:
                            if _is_str(name):
                                found[name.value] = module.value
                elif _is_str(key) and _is_str(value):
                    found[key.value] = value.value
        resolved = {}
        for name, module in found.items():
            for candidate in (module, f"{package}.{module}"):
                if candidate in self.paths:
                    resolved[name] = candidate
                    break
        return resolved

    def providers(self, package: str, name: str) -> list[str]:
        """The modules ``from package import name`` loads to get ``name``: the module the
        package's ``__init__`` names for it, and on through a package that re-exports it."""
        chain = []
        while self.is_package(package) and name in self.exports(package):
            package = self.exports(package)[name]
            if package in chain:
                break
            chain.append(package)
        return chain

    @functools.cache  # noqa: B019
    def imports(self, module: str) -> list[Import]:
        """Every import ``module`` makes of the project, at any depth (``TYPE_CHECKING`` blocks
        and function bodies included). ``from package import sub`` runs the package's
        ``__init__`` too; a name from a package is also an import of the module it comes from;
        ``importlib.import_module("m")`` and ``__import__("m")`` are imports of ``m``."""
        found = []

        def visit(node, in_function: bool):
            for child in ast.iter_child_nodes(node):
                nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
                line = getattr(child, "lineno", 0)
                if isinstance(child, ast.Import):
                    found.extend((a.name, "", line, nested) for a in child.names)
                elif isinstance(child, ast.ImportFrom):
                    base = self.absolute(module, child)
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        if sub in self.paths:  # ``from package import module``
                            found.append((sub, "", line, nested))
                            found.append((base, "", line, nested))
                        else:
                            found.append((base, alias.name, line, nested))
                            if base in self.paths:
                                for m in self.providers(base, alias.name):
                                    found.append((m, alias.name, line, nested))
                elif (name := _dynamic_import(child, self.package_of(module))) is not None:
                    found.append((name, "", line, nested))
                visit(child, nested)

        visit(self.parse(module), False)
        return [Import(t, n, line, f) for name, n, line, f in found if (t := self.target(name))]

    def graph(self) -> dict[str, set[str]]:
        return {m: {i.target for i in self.imports(m)} - {m} for m in self.paths}


def _is_str(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _is_call(node, *names: str) -> bool:
    """``node`` calls a function named one of ``names`` (bare or as an attribute)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Name) and func.id in names) or (
        isinstance(func, ast.Attribute) and func.attr in names
    )


def _dynamic_import(node, package: str) -> str | None:
    """The module ``importlib.import_module("m")`` or ``__import__("m")`` loads, when a literal
    names it (relative names against a literal ``package=``, or the module's own package)."""
    if not _is_call(node, "import_module", "__import__") or not node.args:
        return None
    if not _is_str(name := node.args[0]):
        return None
    if not name.value.startswith("."):
        return name.value
    anchor = [k.value for k in node.keywords if k.arg == "package"] + node.args[1:2]
    base = anchor[0].value if anchor and _is_str(anchor[0]) else package
    level = len(name.value) - len(name.value.lstrip("."))
    parts = base.split(".")
    return ".".join(parts[: len(parts) - level + 1] + [name.value.lstrip(".")]).rstrip(".")


def _group(module: str) -> str:
    """oppo_jax's first-level package or root module ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


# --- the checks: each returns what it found wrong in a tree ----------------------------------


def import_cycles(tree: Tree, debt=frozenset()) -> list[list[str]]:
    """The cycles of the import graph, each a path back to its start (``debt``'s edges left
    out)."""
    graph, state, cycles = tree.graph(), {}, []
    for importer, imported in debt:
        graph[importer].discard(imported)

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
    return cycles


def cycle_debt_paid(tree: Tree, debt) -> list[str]:
    """The entries of ``debt`` whose import is gone or no longer closes a cycle."""
    graph, paid = tree.graph(), []
    for importer, imported in sorted(debt):
        seen, todo = set(), [imported]  # what the imported package reaches
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        if imported not in graph.get(importer, ()) or importer not in seen:
            paid.append(f"{importer} -> {imported}")
    return paid


def upward_imports(tree: Tree) -> list[str]:
    rank = {group: i for i, layer in enumerate(LAYERS) for group in layer}
    upward = []
    for module in (m for m in tree.paths if m.startswith("oppo_jax.")):
        for target, _, line, in_function in tree.imports(module):
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
    return upward


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_bindings(tree: Tree, module: str) -> dict[str, str]:
    """Local name -> project module, for every name ``module`` binds to a module of the project:
    ``import a.b`` (binds ``a``), ``import a.b as m``, ``from a import b`` (``b`` a module, a
    relative one included), ``m = importlib.import_module("a.b")``."""
    bound = {}
    for node in ast.walk(tree.parse(module)):
        if isinstance(node, ast.Import):
            for a in node.names:
                name = a.name if a.asname else a.name.partition(".")[0]
                if name in tree.paths:
                    bound[a.asname or name] = name
        elif isinstance(node, ast.ImportFrom):
            base = tree.absolute(module, node)
            for a in node.names:
                if f"{base}.{a.name}" in tree.paths:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = _dynamic_import(node.value, tree.package_of(module))
            if isinstance(node.targets[0], ast.Name) and name in tree.paths:
                bound[node.targets[0].id] = name
    return bound


def private_crossings(tree: Tree) -> list[str]:
    """``from m import _x`` and ``m._x`` where ``m`` is another module of the project (reached
    by any import, an attribute chain ``a.b._x`` or ``importlib`` included). ``self._x`` and
    dunders are fine."""
    crossing = set()
    for module in tree.paths:
        for target, name, line, _ in tree.imports(module):
            if _private(name) and target != module:
                crossing.add(f"{module}:{line} imports {target}.{name}")
        bound = _module_bindings(tree, module)

        def resolve(node, bound=bound, module=module) -> str | None:
            """The project module an expression names, if it names one."""
            if isinstance(node, ast.Name):
                return bound.get(node.id)
            if isinstance(node, ast.Attribute) and (owner := resolve(node.value)):
                sub = f"{owner}.{node.attr}"
                return sub if sub in tree.paths else None
            name = _dynamic_import(node, tree.package_of(module))
            return name if name in tree.paths else None

        for node in ast.walk(tree.parse(module)):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = resolve(node.value)
                if owner is not None and owner != module:
                    crossing.add(f"{module}:{node.lineno} uses {owner}.{node.attr}")
    return sorted(crossing)


def pallas_kernel_bodies(tree: Tree, module: str) -> set[str]:
    """The functions ``module`` hands to ``pallas_call`` as its kernel: directly, through
    ``functools.partial(f, ...)``, or through a local name bound to such a partial."""
    kernels = set()
    scopes = [tree.parse(module)] + [
        n for n in ast.walk(tree.parse(module)) if isinstance(n, ast.FunctionDef)
    ]
    for scope in scopes:
        partials = {}  # local name -> the function it wraps
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                wrapped = _partial_of(node.value)
                if isinstance(node.targets[0], ast.Name) and wrapped:
                    partials[node.targets[0].id] = wrapped
        for node in ast.walk(scope):
            if not _is_call(node, "pallas_call"):
                continue
            given = node.args[:1] + [k.value for k in node.keywords if k.arg == "kernel"]
            for arg in given:
                name = _partial_of(arg) or (arg.id if isinstance(arg, ast.Name) else None)
                kernels.add(partials.get(name, name))
    return kernels - {None}


def _partial_of(node) -> str | None:
    """``f`` of ``functools.partial(f, ...)``."""
    if _is_call(node, "partial") and node.args and isinstance(node.args[0], ast.Name):
        return node.args[0].id
    return None


def wide_functions(tree: Tree) -> list[str]:
    """Functions taking more than MAX_PARAMS parameters (``self``/``cls`` not counted); a
    Pallas kernel body takes one ref per operand and output, and is exempt."""
    wide = []
    for module in tree.paths:
        kernels = pallas_kernel_bodies(tree, module)
        for node in ast.walk(tree.parse(module)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
            names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
            count = len([n for n in names if n not in ("self", "cls")])
            if count > MAX_PARAMS and node.name not in kernels:
                wide.append(f"{module}.{node.name}: {count}")
    return wide


def lengths(tree: Tree) -> dict[str, int]:
    """Lines of every file ("path") and function ("path:qualified name", ``def`` line to the
    body's last, decorators excluded; methods and nested functions by their dotted names)."""
    found = {}
    for path, source in tree.files.items():
        found[path] = len(source.splitlines())

        def visit(node, prefix, path=path):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    name = prefix + child.name
                    found[f"{path}:{name}"] = child.end_lineno - child.lineno + 1
                    visit(child, name + ".")
                elif isinstance(child, ast.ClassDef):
                    visit(child, prefix + child.name + ".")
                else:
                    visit(child, prefix)

        visit(ast.parse(source), "")
    return found


def over_caps(tree: Tree, debt: dict[str, int]) -> list[str]:
    """What breaks the caps outside ``debt``, and the debt that grew, paid or went."""
    found, wrong = lengths(tree), []
    for key, n in found.items():
        cap = MAX_FUNCTION_LINES if ":" in key else MAX_FILE_LINES
        if n > cap and key not in debt:
            wrong.append(f"{key}: {n} lines (cap {cap})")
    for key, recorded in debt.items():
        cap = MAX_FUNCTION_LINES if ":" in key else MAX_FILE_LINES
        if key not in found:
            wrong.append(f"{key}: gone; delete its OVER_CAP entry")
        elif found[key] <= cap:
            wrong.append(f"{key}: {found[key]} lines, within the cap; delete its OVER_CAP entry")
        elif found[key] > recorded:
            wrong.append(f"{key}: grew from {recorded} to {found[key]} lines")
        elif found[key] < recorded:
            wrong.append(f"{key}: {found[key]} lines; lower its OVER_CAP entry from {recorded}")
    return wrong


# --- the house as built ----------------------------------------------------------------------

TREE = Tree.from_disk()


def test_no_import_cycle_anywhere():
    assert import_cycles(TREE, CYCLE_DEBT) == []
    assert cycle_debt_paid(TREE, CYCLE_DEBT) == [], "paid: delete these CYCLE_DEBT entries"


def test_layers_import_downward_only():
    rank = {group for layer in LAYERS for group in layer}
    engine = [m for m in TREE.paths if m.startswith("oppo_jax.")]
    assert {_group(m) for m in engine} == rank, "a package missing from LAYERS"
    assert upward_imports(TREE) == []


def test_no_private_name_crosses_a_module():
    assert private_crossings(TREE) == []


def test_no_function_outside_pallas_bodies_takes_more_than_8_parameters():
    assert wide_functions(TREE) == []


def test_files_and_functions_stay_within_their_caps_and_the_debt_only_shrinks():
    assert over_caps(TREE, OVER_CAP) == []


def test_the_checks_above_see_what_they_look_for():
    """The walkers find real imports and kernels (a failure here means a check above looks at
    nothing)."""
    step = TREE.graph()["oppo_jax.pipeline.step"]
    assert "oppo_jax.pipeline.step_scorers" in step and "oppo_jax.pipeline.kernels" in step
    imported = [i.target for i in TREE.imports("oppo_jax.cli") if i.target.startswith("oppo_tools")]
    assert imported, "the CLI's lazy tool imports were not seen"
    assert TREE.exports("oppo_jax")["prepare_run"] == "oppo_jax.run.setup"
    assert TREE.providers("oppo_jax", "load_config") == ["oppo_jax.config", "oppo_jax.config.load"]
    assert pallas_kernel_bodies(TREE, "oppo_jax.models.ragged_decode") == {"_kernel"}
    assert {"_forward_kernel", "_dq_kernel", "_dkv_kernel"} <= pallas_kernel_bodies(
        TREE, "oppo_jax.models.segment_attention"
    )
    assert lengths(TREE)["oppo_jax/models/ragged_decode.py:key_block"] == 4


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


MAX_STEP_MODULES = 15  # modules a reader opens to follow one step, pipeline/step.py included


def step_modules(the_map: str) -> set[str]:
    """The modules docs/MAP.md's "One step, top to bottom" table names (its third column), as
    paths under oppo_jax/, with pipeline/step.py."""
    section = the_map[the_map.index("## One step, top to bottom") :]
    table = section[section.index("| step |") :].split("\n\n")[0]
    rows = [row.split("|")[3] for row in table.splitlines()[2:]]
    return {"pipeline/step.py"} | {m for row in rows for m in re.findall(r"`([\w/]+\.py)`", row)}


def test_one_step_is_read_in_at_most_15_modules_the_step_reaches():
    """docs/MAP.md lists the modules a reader opens to follow one ``oppo`` step: at most 15,
    each one that pipeline/step.py imports, directly or through the others (so the table cannot
    name a module the step never reaches)."""
    listed = step_modules((ROOT / "docs" / "MAP.md").read_text())
    assert len(listed) <= MAX_STEP_MODULES, sorted(listed)
    graph, reached, todo = TREE.graph(), set(), ["oppo_jax.pipeline.step"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph.get(module, ()))
    modules = {"oppo_jax." + m.removesuffix(".py").replace("/", ".") for m in listed}
    assert sorted(modules - reached) == []


# --- each check on a small tree with a violation injected -----------------------------------
# Every case below passed the checks before they were hardened (except where a test says so);
# the tree is the least that shows it: a lazy root package and the modules of a few layers.

LAZY_ROOT = """
import importlib

_PUBLIC = {"prepare_run": "oppo_jax.run.setup", "Config": "oppo_jax.config"}


def __getattr__(name):
    return getattr(importlib.import_module(_PUBLIC[name]), name)
"""


def _tree(**modules: str) -> Tree:
    """A tree of ``oppo_jax`` with the lazy root above, empty ``run`` and ``config`` packages,
    and ``modules`` (dotted names under oppo_jax, "__init__" for a package's own file)."""
    files = {
        "oppo_jax/__init__.py": LAZY_ROOT,
        "oppo_jax/run/__init__.py": "",
        "oppo_jax/run/setup.py": "def prepare_run(): pass\ndef _helper(): pass\n",
        "oppo_jax/config/__init__.py": "from oppo_jax.config.schema import Config\n",
        "oppo_jax/config/schema.py": "class Config: pass\n",
        "oppo_jax/models/__init__.py": "",
    }
    for name, source in modules.items():
        files["oppo_jax/" + name.replace(".", "/") + ".py"] = source
    return Tree(files)


def test_a_name_from_the_lazy_root_is_an_import_of_the_module_behind_it():
    tree = _tree(**{"models.x": "from oppo_jax import prepare_run\n"})
    assert upward_imports(tree) == ["oppo_jax.models.x:1 (models) imports oppo_jax.run.setup (run)"]
    # a name re-exported downward is fine, and is followed to the module that defines it
    fine = _tree(**{"run.x": "from oppo_jax import Config\n"})
    assert upward_imports(fine) == []
    assert {i.target for i in fine.imports("oppo_jax.run.x")} >= {
        "oppo_jax.config",
        "oppo_jax.config.schema",
    }


def test_a_literal_importlib_import_is_an_import():
    for call in (
        'importlib.import_module("oppo_jax.run.setup")',
        'import_module("oppo_jax.run.setup")',
        '__import__("oppo_jax.run.setup")',
        'importlib.import_module(".setup", package="oppo_jax.run")',
    ):
        source = "import importlib\nfrom importlib import import_module\n\n\n"
        source += f"def f():\n    {call}\n"
        tree = _tree(**{"models.x": source})
        assert upward_imports(tree) == [
            "oppo_jax.models.x:6 (models) imports oppo_jax.run.setup (run)"
        ], call
    cycle = _tree(**{"models.a": 'import importlib\nimportlib.import_module("oppo_jax.models.b")\n',
                     "models.b": "import oppo_jax.models.a\n"})  # fmt: skip
    assert import_cycles(cycle) == [["oppo_jax.models.a", "oppo_jax.models.b", "oppo_jax.models.a"]]


def test_another_modules_private_attribute_is_a_crossing():
    helper = "oppo_jax.run.setup._helper"
    unseen_before = {  # a module reached by a dotted chain, a relative import, or importlib
        "import oppo_jax.run.setup\noppo_jax.run.setup._helper()\n": helper,
        "from oppo_jax import run\nrun.setup._helper()\n": helper,
        "from . import setup\nsetup._helper()\n": helper,
        "from .. import run\nrun.setup._helper()\n": helper,
        "import importlib\nm = importlib.import_module('oppo_jax.run.setup')\nm._helper()": helper,
        "import importlib\nimportlib.import_module('oppo_jax.run.setup')._helper()\n": helper,
    }
    seen_before = {  # the forms the check caught already, still caught
        "import oppo_jax.run.setup as m\nm._helper()\n": helper,
        "from oppo_jax.run import setup\nsetup._helper()\n": helper,
        "import oppo_jax\noppo_jax._PUBLIC\n": "oppo_jax._PUBLIC",
    }
    for source, used in {**unseen_before, **seen_before}.items():
        found = private_crossings(_tree(**{"run.other": source}))
        assert [f.split(" uses ")[1] for f in found] == [used], source
    fine = "import oppo_jax.run.setup as m\n\n\nclass A:\n    def f(self):\n        m.__name__\n"
    fine += "        return self._x, A._y\n"
    assert private_crossings(_tree(**{"run.other": fine})) == []


def test_only_a_function_handed_to_pallas_call_may_take_more_than_8_parameters():
    nine = "a_ref, b_ref, c_ref, d_ref, e_ref, f_ref, g_ref, h_ref, i_ref"
    named_like_a_kernel = f"def helper({nine}):\n    pass\n"
    assert wide_functions(_tree(**{"models.k": named_like_a_kernel})) == [
        "oppo_jax.models.k.helper: 9"
    ]
    kernels = f"""
import functools
from jax.experimental import pallas as pl


def _direct({nine}):
    pass


def _wrapped({nine}, *, block):
    pass


def _bound({nine}, *, block):
    pass


def call(x):
    pl.pallas_call(_direct, grid=(1,))(x)
    pl.pallas_call(functools.partial(_wrapped, block=8))(x)
    kernel = functools.partial(_bound, block=8)
    return pl.pallas_call(kernel, grid=(1,))(x)
"""
    assert wide_functions(_tree(**{"models.k": kernels})) == []
    assert pallas_kernel_bodies(_tree(**{"models.k": kernels}), "oppo_jax.models.k") == {
        "_direct",
        "_wrapped",
        "_bound",
    }


def test_a_sibling_imported_through_its_package_runs_the_package():
    tree = _tree(
        **{
            "models.__init__": "from oppo_jax.models.a import A\n",
            "models.a": "from oppo_jax.models import b\nA = b.B\n",
            "models.b": "B = 1\n",
        }
    )
    assert import_cycles(tree) == [["oppo_jax.models", "oppo_jax.models.a", "oppo_jax.models"]]
    direct = "import oppo_jax.models.b as b\nA = b.B\n"
    assert import_cycles(_tree(**{"models.__init__": "from oppo_jax.models.a import A\n",
                                  "models.a": direct, "models.b": "B = 1\n"})) == []  # fmt: skip


def test_the_caps_and_the_debt_ratchet():
    body = "\n".join(["def f():"] + ["    x = 1"] * 60)  # 61 lines
    decorated = "\n".join(["@decorator", "@other", "def g():"] + ["    x = 1"] * 59)  # 60
    nested = "class C:\n    def m(self):\n" + "\n".join(["        y = 2"] * 60)  # 61
    tree = _tree(**{"models.f": body, "models.g": decorated, "models.c": nested})
    assert over_caps(tree, {}) == [
        "oppo_jax/models/f.py:f: 61 lines (cap 60)",
        "oppo_jax/models/c.py:C.m: 61 lines (cap 60)",
    ]
    debt = {"oppo_jax/models/f.py:f": 61, "oppo_jax/models/c.py:C.m": 61}
    assert over_caps(tree, debt) == []
    assert over_caps(tree, {**debt, "oppo_jax/models/f.py:f": 60}) == [
        "oppo_jax/models/f.py:f: grew from 60 to 61 lines"
    ]
    assert over_caps(tree, {**debt, "oppo_jax/models/g.py:g": 70}) == [
        "oppo_jax/models/g.py:g: 60 lines, within the cap; delete its OVER_CAP entry"
    ]
    assert over_caps(tree, {**debt, "oppo_jax/models/gone.py:h": 70}) == [
        "oppo_jax/models/gone.py:h: gone; delete its OVER_CAP entry"
    ]
    long_file = _tree(**{"models.long": "x = 1\n" * 401})
    assert over_caps(long_file, {}) == ["oppo_jax/models/long.py: 401 lines (cap 400)"]
    assert over_caps(tree, {**debt, "oppo_jax/models/f.py:f": 75}) == [
        "oppo_jax/models/f.py:f: 61 lines; lower its OVER_CAP entry from 75"
    ]


def test_the_cycle_debt_ratchet():
    modules = {
        "models.__init__": "from oppo_jax.models.a import A\n",
        "models.a": "from oppo_jax.models import b\nA = b.B\n",
        "models.b": "B = 1\n",
    }
    debt = {("oppo_jax.models.a", "oppo_jax.models")}
    assert import_cycles(_tree(**modules), debt) == []
    assert cycle_debt_paid(_tree(**modules), debt) == []
    paid = {**modules, "models.a": "import oppo_jax.models.b as b\nA = b.B\n"}
    assert cycle_debt_paid(_tree(**paid), debt) == ["oppo_jax.models.a -> oppo_jax.models"]
    no_cycle = {**modules, "models.__init__": ""}
    assert cycle_debt_paid(_tree(**no_cycle), debt) == ["oppo_jax.models.a -> oppo_jax.models"]


def test_the_suite_type_checks_the_engine_and_every_tool_but_the_simulators_inner_modules():
    """pyproject's ``--jaxtyping-packages`` names oppo_jax and each module or package of
    oppo_tools (a new tool is checked once it is listed); of the simulator only its entry
    points, ``sim.cli`` and ``sim.project`` (why: the comment beside ``addopts``)."""
    import tomllib

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    flag = re.search(r"--jaxtyping-packages=(\S+)", addopts["ini_options"]["addopts"])
    listed = set(flag.group(1).split(",")) - {"beartype.beartype"}
    tools = {
        f"oppo_tools.{p.stem}"
        for p in (ROOT / "oppo_tools").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    want = (
        {"oppo_jax"} | tools - {"oppo_tools.sim"} | {"oppo_tools.sim.cli", "oppo_tools.sim.project"}
    )
    assert listed == want
