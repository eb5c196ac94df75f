"""lmforge's import graph: no cycles, no module importing a layer above its own, no training kind
importing another, and no code outside a kind's folder that tests a family or kind name (compares with
one, ``startswith`` / ``endswith`` it, matches a ``case`` of it, looks it up in a dict literal keyed by
family or kind names, or compares with a class's ``family``: ask the registry or the model class instead).

Every ``import`` statement counts, at module level or inside a function (a lazy import is still a
dependency), and so does a reference a kind's spec imports on first use (``Lazy("package.module:name")``,
``Family(name, "package.module:Class")``). The registry's list of built-in kinds
(``lmforge.recipes.BUILTIN``) names packages as strings, the plug-in link, and is not an import statement. Run alone: ``python -m pytest -q
tests/test_architecture.py``."""

from __future__ import annotations

import ast
from pathlib import Path

import lmforge
from lmforge import recipes

ROOT = Path(lmforge.__file__).parent

# Lowest first. A module may import its own layer or a lower one. The first prefix that matches
# a module's name gives its layer; `lmforge.recipes` alone is the registry, its subpackages the kinds.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("lmforge.errors", "lmforge.files", "lmforge.typed", "lmforge.cli_common", "lmforge.recipes=")),
    ("formats", ("lmforge.device", "lmforge.safe_state", "lmforge.checkpoint", "lmforge.chat", "lmforge.go_syntax")),
    ("tokenizer", ("lmforge.tokenizer",)),
    ("models and data", ("lmforge.models", "lmforge.data")),
    ("config", ("lmforge.config",)),
    ("inference and evaluation", ("lmforge.infer", "lmforge.eval")),
    ("training, export, serving", ("lmforge.train", "lmforge.export", "lmforge.serve", "lmforge.plot")),
    ("post-training library", ("lmforge.posttrain",)),
    ("training kinds", ("lmforge.recipes.",)),
    ("command line", ("lmforge.cli", "lmforge.cli_data", "lmforge.bench", "lmforge.quickstart", "lmforge.__main__",
                      "lmforge.staged_guide", "lmforge.pipeline", "lmforge=")),
]


# What a spec names by reference ("package.module:name"), imported on first use: an import too.
REFERENCES = ("Lazy", "Family")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if prefix.endswith("="):
                if module == prefix[:-1]:
                    return index
            elif module == prefix or module.startswith(prefix + ".") or (prefix.endswith(".") and module.startswith(prefix)):
                return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_architecture.py")


def import_graph() -> dict[str, set[str]]:
    """module -> the lmforge modules it imports (a `from pkg import name` counts as pkg.name when that
    is a module, else pkg)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in REFERENCES:
                targets = [arg.value.partition(":")[0] for arg in node.args
                           if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and ":" in arg.value]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
                  for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    return cycles


def kind_crossings(graph: dict[str, set[str]]) -> list[str]:
    def kind(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[:2] == ["lmforge", "recipes"] else None

    return [f"{a} imports {b}" for a, targets in graph.items() for b in targets
            if kind(a) and kind(b) and kind(a) != kind(b)]


def test_every_module_has_a_layer_and_imports_point_down():
    upward = upward_imports(import_graph())
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_the_import_graph_has_no_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_a_kind_imports_no_other_kind():
    crossing = kind_crossings(import_graph())
    assert not crossing, "\n".join(crossing)


def _named_constants(node: ast.AST, constants: dict[str, list[str]] | None = None) -> list[str]:
    """The strings ``node`` spells: a literal, a tuple / list / set of them, or a module-level name bound
    to one of those (``constants``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [c.value for c in node.elts if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    if isinstance(node, ast.Name) and constants:
        return constants.get(node.id, [])
    return []


def _module_constants(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level ``NAME = "hrgc"`` / ``NAME = ("gpt", ...)``: a name a comparison may hide a literal behind."""
    found: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and _named_constants(node.value):
                    found[target.id] = _named_constants(node.value)
    return found


def _a_family_constant(node: ast.AST) -> bool:
    """``GPT.family``: one family's name, read off its model class."""
    return (isinstance(node, ast.Attribute) and node.attr == "family" and isinstance(node.value, ast.Name)
            and node.value.id[:1].isupper())


def _affix_names(node: ast.Call, names: set[str]) -> bool:
    """``x.startswith("hrgc")`` / ``x.endswith(("trm", "hrm"))``: an argument that is a name, or (3 characters
    or more) the start / end of one."""
    method = node.func.attr  # type: ignore[attr-defined]
    for value in (v for arg in node.args[:1] for v in _named_constants(arg)):
        if value in names or (len(value) >= 3 and any(getattr(n, method)(value) for n in names)):
            return True
    return False


def _case_names(pattern: ast.AST, names: set[str]) -> bool:
    """A ``case`` pattern that matches one of ``names`` (or ``GPT.family``), alone or among alternatives."""
    for node in ast.walk(pattern):
        if isinstance(node, ast.MatchValue) and (names.intersection(_named_constants(node.value))
                                                 or _a_family_constant(node.value)):
            return True
    return False


def family_tests(source: str, names: set[str]) -> list[int]:
    """Lines of ``source`` that test something against one of ``names`` (family and kind names): a
    comparison (== / != / in / not in) with a literal of them, a module-level constant holding them or a
    class's ``family`` (``x != GPT.family``); a ``startswith`` / ``endswith`` on them; a ``case`` of them;
    and a lookup in a dict literal keyed by them (``{"hrgc": ...}[family]``, ``{...}.get(family)``)."""
    tree = ast.parse(source)
    constants = _module_constants(tree)
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(names.intersection(_named_constants(side, constants)) or _a_family_constant(side)
                   for side in sides):
                lines.add(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and _affix_names(node, names)):
            lines.add(node.lineno)
        elif isinstance(node, ast.match_case) and _case_names(node.pattern, names):
            lines.add(node.pattern.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
            if any(key is not None and names.intersection(_named_constants(key)) for key in node.value.keys):
                lines.add(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and isinstance(node.func.value, ast.Dict)):
            if any(key is not None and names.intersection(_named_constants(key)) for key in node.func.value.keys):
                lines.add(node.lineno)
    return sorted(lines)


def test_no_code_outside_a_kinds_folder_tests_a_family_or_kind_name():
    names = set(recipes.families()) | {spec.name for spec in recipes.kinds()}
    found = [f"{module_name(path)}:{line}" for path in ROOT.rglob("*.py")
             if not module_name(path).startswith("lmforge.recipes.")
             for line in family_tests(path.read_text(), names)]
    assert not found, "family or kind names tested outside lmforge/recipes/<kind>/:\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for():
    """Each check fails on a graph or source that breaks its rule, and the walker sees lazy imports."""
    graph = import_graph()
    assert "lmforge.recipes" in graph["lmforge.models"]  # module level
    assert "lmforge.train.loggers" in graph["lmforge.plot"]
    assert "lmforge.recipes.puzzles.sudoku" in graph["lmforge.recipes.puzzles.cli"]  # inside a function
    assert {"lmforge.recipes.puzzles.training", "lmforge.recipes.puzzles.hrm"} <= graph["lmforge.recipes.puzzles"]  # references
    bad = {**graph, "lmforge.data.loader": graph["lmforge.data.loader"] | {"lmforge.train.loop"}}
    assert upward_imports(bad) == ["lmforge.data.loader (models and data) imports lmforge.train.loop "
                                   "(training, export, serving)"]
    bad = {**graph, "lmforge.train.loop": graph["lmforge.train.loop"] | {"lmforge.train"}}
    assert any("lmforge.train.loop -> lmforge.train" in c for c in find_cycles(bad))
    bad = {**graph, "lmforge.recipes.hrgc.model": graph["lmforge.recipes.hrgc.model"] | {"lmforge.recipes.puzzles.model"}}
    assert kind_crossings(bad) == ["lmforge.recipes.hrgc.model imports lmforge.recipes.puzzles.model"]
    assert family_tests('if model.family == "hrgc":\n    pass\nok = x in ("trm", "hrm")', {"hrgc", "trm"}) == [1, 3]


def test_the_family_check_sees_names_behind_affixes_cases_lookups_and_constants():
    """Each way of testing a name that the comparison alone missed is found; the look-alikes are not."""
    names = {"hrgc", "trm", "hrm", "gpt", "sft"}
    source = """KIND = "sft"
a = family.startswith("hrgc")
b = family.startswith("hrg")
c = name.endswith(("x", "trm"))
d = {"hrgc": 1, "gpt": 2}[family]
e = {"hrgc": 1}.get(family)
match family:
    case "hrgc":
        pass
    case "x" | "trm":
        pass
    case GPT.family:
        pass
f = family != GPT.family
g = kind == KIND
ok = text.startswith("h") or path.endswith(".py") or {"plan": 1}[key] or model.family == other.family
ok = family_weights["hrgc"] if "x" in y else kinds.get(name)
"""
    assert family_tests(source, names) == [2, 3, 4, 5, 6, 8, 10, 12, 14, 15]
    # the comparison lmforge.eval.harness made (`family != GPT.family`) before it asked for the model class
    assert family_tests("from lmforge.models.gpt import GPT\nif family != GPT.family:\n    raise E", names) == [2]
