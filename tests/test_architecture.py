"""The house rules of docs/ARCHITECTURE.md, read from the source: imports run down the layers, there
is no import circle (lazy imports inside functions count), and only mingpt/cli/ defines commands."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mingpt"

# Lowest first. A module may import its own layer's package and anything below its layer; the
# packages that share a layer do not import each other.
LAYERS = [
    {"mingpt.errors"},
    {"mingpt.storage", "mingpt.claim", "mingpt.torch_internals"},
    {"mingpt.rundir", "mingpt.shape"},
    {"mingpt.model", "mingpt.tokenizers"},
    {"mingpt.checkpoint", "mingpt.data", "mingpt.metrics"},
    {"mingpt.interop"},
    {"mingpt.training"},
    {"mingpt.cli"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(path): ast.parse(path.read_text(), str(path)) for path in PACKAGE.rglob("*.py")}


def imported(tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules that `tree` imports anywhere in it, functions included."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def unit(module: str) -> str:
    """The layer entry a module belongs to: its package (mingpt.data) or itself (mingpt.model)."""
    for layer in LAYERS:
        for entry in layer:
            if module == entry or module.startswith(entry + "."):
                return entry
    return module


def level(module: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit(module) in layer)


def test_every_module_has_a_layer():
    unplaced = [m for m in modules() if m != "mingpt" and not any(unit(m) in layer for layer in LAYERS)]
    assert unplaced == []


def test_imports_only_run_down_the_layers():
    found = modules()
    wrong = []
    for module, tree in found.items():
        if module == "mingpt":  # the package's lazy table of public names
            continue
        for target in imported(tree, set(found)) - {"mingpt"}:
            same_unit = unit(target) == unit(module)
            if not same_unit and level(target) >= level(module):
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_the_import_graph_has_no_circle():
    found = modules()
    graph = {module: imported(tree, set(found)) - {module, "mingpt"} for module, tree in found.items()}
    done, on_path = set(), []

    def visit(module: str) -> None:
        if module in on_path:
            raise AssertionError("import circle: " + " -> ".join(on_path[on_path.index(module):] + [module]))
        if module in done:
            return
        on_path.append(module)
        for target in sorted(graph[module]):
            visit(target)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_only_cli_modules_define_a_command_main():
    outside = [module for module, tree in modules().items() if not module.startswith("mingpt.cli.")
               and any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)]
    assert outside == []


def test_the_launcher_and_the_snapshot_commands_leave_the_sharding_machinery_unimported():
    """FSDP, DCP and DTensor cost about 0.7 s of CPU to import: every torchrun agent, and every command
    that reads a snapshot, would pay it for nothing unless the model or the snapshot is sharded."""
    heavy = ("torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor")
    code = ("import sys, mingpt.cli.torchrun, mingpt.cli.sample, mingpt.cli.export, mingpt.cli.snapshot; "
            f"print(sorted(m for m in sys.modules if m.startswith({heavy!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
