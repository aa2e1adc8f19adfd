"""The layering of the design page holds: checked by walking every import in the package's source.

types/config/intervals < sandbox, reward, algo, data, environments < engine < rollout < trainer <
recipe, eval, bench < cli. A module may import its own layer or lower ones. sandbox, reward and
algo import neither transformers, an inference engine nor ray. Heavy optional packages are imported
inside functions only. No modules import each other, directly or round a longer circle, not even
through an import inside a function.
"""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "codeloop"

RANK = {
    "__init__": 0,
    "__main__": 6,
    "types": 0,
    "config": 0,
    "errors": 0,
    "files": 0,
    "memory": 0,
    "progress": 0,
    "helpformat": 0,
    "intervals": 0,
    "net": 0,
    "auth": 0,
    "serving": 0,
    "bench": 5,
    "sandbox": 1,
    "reward": 1,
    "algo": 1,
    "data": 1,
    "environments": 1,
    "engine": 2,
    "rollout": 3,
    "trainer": 4,
    "recipe": 5,
    "eval": 5,
    "cli": 6,
    "reference": 6,
}
ENGINE_FREE = {"sandbox", "reward", "algo"}
ENGINES = {"transformers", "vllm", "sglang", "ray"}
LAZY_ONLY = {"vllm", "sglang", "ray", "tensorboard", "wandb"}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module top level?) for every import statement in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, id(node) in top_level))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}: use absolute imports (codeloop.x), not relative ones")
    return found


def _module(path: Path) -> str:
    """`codeloop/trainer/rl.py` -> `codeloop.trainer.rl` (a package: its `__init__`)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports (anywhere in it)."""
    files = {_module(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:  # a submodule, or a name
                targets |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                    for a in node.names
                }
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of `graph`: each set of modules that reach one another (Tarjan's strongly
    connected components of more than one module), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while (top := stack.pop()) != node:
                component.append(top)
            if component:
                found.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _violations() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = _part(path)
        assert part in RANK, f"{path}: new top-level part {part!r}: give it a layer in this test"
        for module, at_top in _imports(path):
            root = module.split(".")[0]
            if root == "codeloop" and module != "codeloop":
                target = module.split(".")[1]
                if RANK.get(target, 99) > RANK[part]:
                    problems.append(f"{path}: {part} (layer {RANK[part]}) imports {module}")
            if part in ENGINE_FREE and root in ENGINES:
                problems.append(f"{path}: {part} must not import {root}")
            if root in LAZY_ONLY and at_top:
                problems.append(f"{path}: import {root} inside the function that needs it")
    return problems


def test_layers_hold() -> None:
    assert _violations() == []


def test_the_checker_catches_violations(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fake = tmp_path / "codeloop"
    (fake / "algo").mkdir(parents=True)
    (fake / "algo" / "loss.py").write_text(
        "import ray\nfrom codeloop.trainer import loop\nimport transformers\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    problems = _violations()
    assert len(problems) == 4, problems  # ray twice (engine, top level), trainer, transformers
    assert any("imports codeloop.trainer" in p for p in problems)


def test_importing_the_core_stays_light() -> None:
    code = (
        "import sys, codeloop, codeloop.types, codeloop.config, codeloop.cli\n"
        "heavy = {'torch', 'transformers', 'numpy', 'sympy'} & set(sys.modules)\n"
        "print(sorted(heavy))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_no_module_imports_itself_round_a_circle() -> None:
    assert _cycles(_graph()) == []


def test_the_circle_finder_finds_circles(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fake = tmp_path / "codeloop"
    (fake / "trainer").mkdir(parents=True)
    (fake / "trainer" / "__init__.py").write_text("")
    (fake / "trainer" / "rl.py").write_text("from codeloop.trainer.loop import run\n")
    (fake / "trainer" / "loop.py").write_text("def f():\n    from codeloop.trainer import ends\n")
    (fake / "trainer" / "ends.py").write_text("import codeloop.trainer.rl\n")
    (fake / "trainer" / "apart.py").write_text("from codeloop.trainer import rl\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    graph = _graph()
    assert graph["codeloop.trainer.loop"] == {"codeloop.trainer.ends"}  # inside a function too
    assert _cycles(graph) == [
        ["codeloop.trainer.ends", "codeloop.trainer.loop", "codeloop.trainer.rl"]
    ]
