"""README.md and docs/*.md, kept true: the README stays short, every relative link leads somewhere,
every ```python block runs, and every command line of a ```bash block uses flags its command has and
settings the training app has.

A code block preceded by `<!-- not run: REASON -->` (it needs a GPU, several nodes, the network) is
not run; its command lines are still checked. Flags are read from each command's `--help`, called
in this process as `main(["--help"])` (once per command); settings are checked as `train/main.py`
checks them before Hydra starts (`mingpt.training.app.check_overrides`).
"""

import contextlib
import importlib
import io
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from launch import env
from mingpt.errors import ConfigError
from mingpt.training.app import check_overrides

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, REPO / "data" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CONF = REPO / "train" / "conf"
README_LIMIT = 12_000  # bytes: a README a newcomer reads in ten minutes

# The two commands at the top of the README; .ci/run runs the second one verbatim.
INSTALL_AND_TRAIN = "pip install torch==2.13.0 && pip install -e . && python train/main.py"
TEST_COMMAND = 'pip install torch==2.13.0 uv && uv pip install -p python --compile-bytecode -e ".[test]" && python -m pytest -q'

NOT_RUN = re.compile(r"<!--\s*not run:\s*\S.*-->")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)\s*$")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
PROMPT = re.compile(r"^[\w.-]+\$\s+")  # `login$ mingpt-rendezvous ...`: a command typed on the machine named
TRAIN_APP = "train/main.py"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, from 1
    lang: str
    text: str
    not_run: bool

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def parse(page: Path) -> tuple[list[Block], list[str]]:
    """The fenced code blocks of `page`, and its prose lines (code blocks left out)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, prose, i = [], [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i].strip())
        if not opening:
            prose.append(lines[i])
            i += 1
            continue
        fence, lang, start = opening[1], opening[2], i
        before = next((line for line in reversed(lines[:i]) if line.strip()), "")
        body = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and not lines[i].strip().strip(fence[0])):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{page.relative_to(REPO)}:{start + 1}: a code block that is never closed"
        blocks.append(Block(page, start + 1, lang, "\n".join(body) + "\n", bool(NOT_RUN.search(before))))
        i += 1
    return blocks, prose


def all_blocks(lang: str) -> list[Block]:
    return [block for page in PAGES for block in parse(page)[0] if block.lang == lang]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of the headings of `page`, with -1, -2, ... after a repeated one."""
    seen: dict[str, int] = {}
    for line in parse(page)[1]:
        heading = HEADING.match(line)
        if not heading:
            continue
        slug_ = slug(heading[2])
        count = seen.get(slug_, 0)
        seen[slug_] = count + 1
        if count:
            seen[f"{slug_}-{count}"] = 1
    return set(seen)


def links(page: Path) -> list[str]:
    """The link targets in `page`'s prose, inline code left out."""
    return [target for line in parse(page)[1] for target in LINK.findall(re.sub(r"`[^`]*`", "", line))]


# -- the README's size and its top -------------------------------------------------------------


def test_the_readme_is_short():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move a section to docs/"


def test_the_readme_starts_with_the_two_commands_and_ci_runs_the_test_command():
    first = next(block for block in parse(README)[0])
    commands = [line.split("  #")[0].strip() for line in first.text.splitlines()]
    assert commands == [INSTALL_AND_TRAIN, TEST_COMMAND], first.text
    second = parse(README)[0][1]
    assert second.text.startswith("mingpt-sample snapshots/run "), second.text
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND in ci, ".ci/run must run the README's test command verbatim"


def test_every_command_has_a_row_in_the_exit_status_table():
    text = README.read_text()
    table = text[text.index("## Exit status"):].split("\n\n")[1]
    first_cells = " ".join(row.split("|")[1] for row in table.splitlines()[2:])
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    # mingpt-train is `python train/main.py` installed: that row stands for it.
    missing = [name for name in scripts if name != "mingpt-train" and f"`{name}" not in first_cells]
    assert not missing, f"no row for {missing} in the README's exit status table"
    assert "`python train/main.py`" in first_cells


# -- links -------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    found, broken = links(page), []
    for target in found:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(REPO) if file.is_relative_to(REPO) else file}")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_readme_links_every_docs_page():
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README)}
    unlinked = [page.name for page in sorted((REPO / "docs").glob("*.md")) if page.resolve() not in linked]
    assert not unlinked, f"README.md links no {unlinked}"


def test_anchors_are_made_as_github_makes_them():
    assert slug("Sharding: models larger than one device") == "sharding-models-larger-than-one-device"
    assert slug("GPT-2 on FineWeb-Edu") == "gpt-2-on-fineweb-edu"
    assert slug("Prepared once (`--out s3://...`, `data.prepared_dir`)") == "prepared-once---out-s3-dataprepared_dir"
    assert "gpt-2-on-fineweb-edu" in anchors(REPO / "docs" / "data.md")


# -- python blocks -----------------------------------------------------------------------------

PYTHON_BLOCKS = all_blocks("python")


def test_there_are_python_examples_to_run():
    assert [block for block in PYTHON_BLOCKS if block.page == README and not block.not_run]
    assert [block for block in PYTHON_BLOCKS if block.page.parent.name == "docs" and not block.not_run]


@pytest.mark.parametrize("block", [block for block in PYTHON_BLOCKS if not block.not_run], ids=str)
def test_python_block_runs(block, tmp_path, procs):
    (tmp_path / "example.py").write_text(block.text)
    result = procs.run([sys.executable, str(tmp_path / "example.py")], "example", timeout=60)
    assert result.returncode == 0, f"{block} failed:\n{result.stdout}\n{result.stderr}"


# -- command lines of bash blocks --------------------------------------------------------------


def command_lines(text: str) -> list[str]:
    """The commands of a shell snippet: backslash continuations joined, a quote left open (python -c
    "...") carried over to the lines it spans, a `host$ ` prompt dropped."""
    commands, current = [], ""
    for line in text.splitlines():
        current = f"{current}\n{line}" if current else line
        if current.rstrip().endswith("\\"):
            current = current.rstrip()[:-1]
            continue
        try:
            shlex.split(current, comments=True)
        except ValueError:  # No closing quotation: the command goes on
            continue
        if current.strip():
            commands.append(PROMPT.sub("", current.strip()))
        current = ""
    assert not current, f"unterminated command: {current!r}"
    return commands


@cache
def help_text(command: str) -> str:
    """`command --help`, called in this process through the entry point that pyproject.toml installs."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert command in scripts, f"{command} is no command of this project ({', '.join(scripts)})"
    module, _, function = scripts[command].partition(":")
    main = getattr(importlib.import_module(module), function)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0, f"{command} --help exited {exited.value.code}"
    return out.getvalue()


def flags(tokens: list[str]) -> list[str]:
    """The options in `tokens`, as in `--flag=value`, `--flag value` or a synopsis' `[--flag VALUE]`."""
    found = []
    for token in tokens:
        token = token.lstrip("[")
        if re.match(r"^--?[A-Za-z][\w-]*", token):
            found.append(token.split("=")[0].rstrip("]"))
    return found


def has_flag(help_: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_) is not None


def script_at(tokens: list[str]) -> int:
    """Where torchrun's options end: the training script (or len(tokens) where none is given)."""
    return next((i for i, token in enumerate(tokens) if not token.startswith("-") and token.endswith(".py")), len(tokens))


def overrides(args: list[str]) -> list[str]:
    return [arg for arg in args if not arg.startswith("-") and ("=" in arg or arg.startswith("~"))]


@dataclass
class Checked:
    """What check_command looked at, by kind: the lines, for a test that the checks are not vacuous."""

    flags: int = 0
    settings: int = 0


def check_command(command: str, checked: Checked) -> list[str]:
    """What is wrong with one command line of the docs, in words; [] when nothing is."""
    tokens = shlex.split(command, comments=True)
    while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):  # VAR=value before the command
        tokens.pop(0)
    if not tokens:
        return []
    program, args = tokens[0], tokens[1:]
    problems: list[str] = []

    def settings(given: list[str]) -> None:
        checked.settings += 1
        try:
            check_overrides(CONF, overrides(given))
        except ConfigError as e:
            problems.append(str(e))

    def options(name: str, given: list[str]) -> None:
        checked.flags += 1
        problems.extend(f"{name} has no {flag}" for flag in flags(given) if not has_flag(help_text(name), flag))

    if program in ("python", "python3") and args:
        if args[0] == TRAIN_APP:
            settings(args[1:])
        elif args[0].startswith("bench/"):  # a benchmark: the script exists and has the flags given
            script = REPO / args[0]
            if not script.is_file():
                problems.append(f"no {args[0]}")
            else:
                source = script.read_text()
                problems.extend(f"{args[0]} has no {flag}" for flag in flags(args[1:]) if f'"{flag}"' not in source)
        elif not args[0].startswith("-"):
            problems.append(f"a python line that runs neither {TRAIN_APP} nor a bench: {command}")
    elif program == "mingpt-train":
        settings(args)
    elif program in ("mingpt-torchrun", "torchrun"):
        at = script_at(args)
        options("mingpt-torchrun", args[:at])  # the same options as torchrun's, and --help shows them
        if at < len(args) and args[at] == TRAIN_APP:
            settings(args[at + 1:])
        elif at < len(args):
            problems.append(f"{program} runs {args[at]}, not {TRAIN_APP}")
    elif program.startswith("mingpt-"):
        options(program, args)
    elif program == "sbatch" and args:
        if not (REPO / args[0]).is_file():
            problems.append(f"no {args[0]}")
        settings(args[1:])  # train/slurm.sbatch hands its arguments to train/main.py
    elif program == "bash" and args and not args[0].startswith("-"):
        if not (REPO / args[0]).is_file():
            problems.append(f"no {args[0]}")
    return problems


def test_command_lines_use_flags_and_settings_that_exist():
    checked, problems = Checked(), []
    for block in all_blocks("bash"):
        for command in command_lines(block.text):
            problems.extend(f"{block}: {problem}" for problem in check_command(command, checked))
    assert not problems, "\n".join(problems)
    # The checks saw the commands the pages give (a parser that found none would pass anything).
    assert checked.flags >= 20 and checked.settings >= 15, checked


def test_the_checks_catch_a_wrong_flag_a_wrong_setting_and_a_missing_bench():
    checked = Checked()
    assert check_command("mingpt-prepare --corpus a.txt --no-such-flag", checked) == ["mingpt-prepare has no --no-such-flag"]
    assert check_command("mingpt-torchrun --nnodes=1:4 --nodes=2 train/main.py", checked) == [
        "mingpt-torchrun has no --nodes"]
    [problem] = check_command("python train/main.py trainer.max_step=5", checked)
    assert "trainer.max_step" in problem and "trainer.max_steps" in problem
    [problem] = check_command("torchrun --standalone train/main.py model=gpt3", checked)
    assert "model=gpt3" in problem
    assert check_command("python bench/bench_nothing.py", checked) == ["no bench/bench_nothing.py"]
    assert check_command("python bench/bench_model.py --no-such-flag", checked) == [
        "bench/bench_model.py has no --no-such-flag"]
    # What the pages write: placeholders, prompts, continuations, a synopsis, quoted lists.
    assert command_lines('login$ mingpt-rendezvous --port 29500   # note\nmingpt-torchrun --nnodes=1:4 \\\n'
                         '    --rdzv-id=x train/main.py "data.corpus=[a/,b/]"\npython -c "\nprint(1)"\n') == [
        "mingpt-rendezvous --port 29500   # note", 'mingpt-torchrun --nnodes=1:4 \n    --rdzv-id=x train/main.py '
        '"data.corpus=[a/,b/]"', 'python -c "\nprint(1)"']
    assert check_command("mingpt-sample SNAPSHOT [--prompt TEXT] [--top-p P] [--device cpu|cuda]", checked) == []
    assert check_command("sbatch train/slurm.sbatch model=gpt2 snapshot.dir=s3://BUCKET/run", checked) == []


def test_the_installed_command_prints_the_help_the_checks_read():
    """One command as users type it: the console script that pip installed, not this process's import."""
    result = subprocess.run([str(Path(sys.executable).parent / "mingpt-prepare"), "--help"], capture_output=True,
                            text=True, timeout=60, env=env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == help_text("mingpt-prepare").split()  # the same words, wrapped to any width
