"""The house rules of docs/ARCHITECTURE.md, read from the source: imports run down the layers, there
is no import circle (lazy imports inside functions count), and only mingpt/cli/ defines commands."""

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mingpt"

# Lowest first. A module may import its own layer's package and anything below its layer; the
# packages that share a layer do not import each other.
LAYERS = [
    {"mingpt.errors"},
    {"mingpt.storage", "mingpt.claim", "mingpt.processes", "mingpt.torch_internals"},
    {"mingpt.rundir", "mingpt.shape", "mingpt.jobenv"},
    {"mingpt.model", "mingpt.tokenizers"},
    {"mingpt.checkpoint", "mingpt.data", "mingpt.metrics"},
    {"mingpt.interop"},
    {"mingpt.training"},
    {"mingpt.launch"},  # the agent's program, above the workers' (mingpt.training)
    {"mingpt.cli"},
]
# The worker's modules that the launching side may import: its entry points (the app's configuration, data
# preparation), which import none of the trainer's machinery.
ENTRY_POINTS = {"mingpt.training.app", "mingpt.training.preparation"}


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


def test_the_launching_side_reaches_the_workers_only_through_their_entry_points():
    found = modules()
    reached = {f"{module} imports {target}" for module, tree in found.items() if module.startswith("mingpt.launch")
               for target in imported(tree, set(found)) if unit(target) == "mingpt.training"
               and target not in ENTRY_POINTS | {"mingpt.training"}}
    assert reached == set()


def test_the_job_is_read_from_the_environment_by_mingpt_jobenv_alone():
    """The job's variables (torchrun's and the agent's) are read in one module; others take a JobEnv."""
    job = re.compile(r"os\.environ(\.get)?[\[(]\s*\"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_WORLD_SIZE|"
                     r"MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|MINGPT_\w+)\"|\"TORCHELASTIC_RUN_ID\" in os\.environ")
    readers = sorted(module for module, path in ((module_name(p), p) for p in PACKAGE.rglob("*.py"))
                     if module != "mingpt.jobenv" and job.search(path.read_text()))
    assert readers == []
    # Read once per worker, as it starts, and carried on its World from there.
    once = sorted(module for module, path in ((module_name(p), p) for p in PACKAGE.rglob("*.py"))
                  if "JobEnv.from_environ(" in path.read_text())
    assert once == ["mingpt.training.trainer"]


def test_only_cli_modules_define_a_command_main():
    outside = [module for module, tree in modules().items() if not module.startswith("mingpt.cli.")
               and any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)]
    assert outside == []


def test_the_launcher_and_the_snapshot_commands_leave_the_sharding_machinery_unimported():
    """FSDP, DCP and DTensor cost about 0.7 s of CPU to import: every torchrun agent, and every command
    that reads a snapshot, would pay it for nothing unless the model or the snapshot is sharded."""
    heavy = ("torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor")
    code = ("import sys, mingpt.cli.torchrun, mingpt.cli.sample, mingpt.cli.export, mingpt.cli.snapshot, "
            "mingpt.cli.eval; from mingpt.launch import agent; agent.install(); "  # as mingpt-torchrun's agent starts
            f"print(sorted(m for m in sys.modules if m.startswith({heavy!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# -- docs/ARCHITECTURE.md is true to the code -------------------------------------------------------------------

REPO = PACKAGE.parent
ARCHITECTURE = (REPO / "docs" / "ARCHITECTURE.md").read_text()
CITED = sorted(set(re.findall(r"`([^`\n]+)`", ARCHITECTURE)))
RUN_FILE = re.compile(r"\.(json|jsonl|pt|yaml)$")  # manifest.json, metrics.jsonl: files of a run folder, not code


def defined_names() -> dict[str, set[str]]:
    """Each module's names: its top-level definitions and assignments, and ClassName.member for its classes."""
    found = {}
    for module, tree in modules().items():
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(f"{node.name}.{member.name}")
                    elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                        names.add(f"{node.name}.{member.target.id}")
            elif isinstance(node, ast.Assign):
                names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        found[module] = names
    return found


def resolves(reference: str, names: dict[str, set[str]]) -> bool:
    """Whether `reference` (module.name, package.module.name, Class.member, ...) names something in mingpt."""
    parts = reference.split(".")
    for split in range(len(parts), 0, -1):  # the longest module path first
        module, rest = ".".join(parts[:split]), ".".join(parts[split:])
        for known in names:
            if known == f"mingpt.{module}" or known.endswith(f".{module}"):
                if not rest or rest in names[known]:
                    return True
    return any(reference in found for found in names.values())  # Class.member, a name of any module


def a_setting(reference: str) -> bool:
    from mingpt.training.config import Config

    node = Config()
    for part in reference.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


def test_the_architecture_names_every_module():
    unnamed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        relative = path.relative_to(REPO).as_posix()
        dotted = module_name(path).removeprefix("mingpt.")
        named = {path.stem, path.name, relative, dotted, relative.removeprefix("mingpt/")}
        if not any(token in named or token.startswith((f"{path.stem}.", f"{dotted}.")) for token in CITED):
            unnamed.append(relative)
    assert unnamed == []


def test_every_file_and_name_the_architecture_cites_exists():
    names = defined_names()
    missing = []
    for token in CITED:
        reference = token.removesuffix("()")
        if reference.startswith(("mingpt/", "train/", "tests/", "bench/", "docs/")):
            if not (REPO / reference).exists():
                missing.append(token)
        elif reference.endswith(".py"):
            if not list(PACKAGE.rglob(reference)):
                missing.append(token)
        elif re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", reference) and not RUN_FILE.search(reference):
            if not (resolves(reference, names) or a_setting(reference)):
                missing.append(token)
    assert missing == []


def test_every_module_that_a_docstring_comment_or_page_names_exists():
    """`mingpt.x.y` in the code's docstrings and comments, the docs and the README names a module of the package (or
    a name in one): a module that moved or went leaves no reference behind."""
    names = defined_names()
    texts = {path: path.read_text() for path in [*PACKAGE.rglob("*.py"), *(REPO / "docs").glob("*.md"),
                                                 REPO / "README.md"]}
    missing = sorted({f"{path.relative_to(REPO)}: {reference}" for path, text in texts.items()
                      for reference in re.findall(r"\bmingpt(?:\.[A-Za-z_]\w*)+", text)
                      if not resolves(reference.removeprefix("mingpt."), names)})
    assert missing == []


def test_torchs_private_names_are_used_in_torch_internals_alone():
    """Every private name of torch's (`torch.x._y`, `from torch.x import _y`) is in mingpt.torch_internals, where each
    is checked at start. The warm-worker server's list of modules to import names torch._dynamo, and uses none of it."""
    private = re.compile(r"torch(\.[A-Za-z]\w*)*\._[A-Za-z]|from torch\S* import [^\n]*\b_[a-z]")
    found = sorted(f"{module}: {match.group(0)}" for module, path in ((module_name(p), p) for p in PACKAGE.rglob("*.py"))
                   if module != "mingpt.torch_internals" for match in private.finditer(path.read_text()))
    assert found == ["mingpt.launch.forkserver: torch._d"]
