"""This project against nanoGPT on nanoGPT's Shakespeare-char CPU recipe, in the same run.

    python bench/bench_vs_nanogpt.py --nanogpt /tmp/nanogpt              # 2000 steps, 2 rounds (~10 min)
    python bench/bench_vs_nanogpt.py --nanogpt /tmp/nanogpt --steps 200 --rounds 1   # a quick look

The recipe (nanoGPT's README for CPUs): 4 layers, 4 heads, width 128, block 64, batch 12,
lr 1e-3 with 100 warm-up steps and cosine decay to 1e-4 at the last step, AdamW beta2 0.99, weight
decay 0.1, gradient clipping at 1.0, dropout 0, no bias. nanoGPT runs it in fp32 without
torch.compile, as its README says for CPUs; the project with its defaults for that model size
(trainer.precision and trainer.compile left at auto: on a CPU with native bf16, bf16 autocast and
no compile). Each project round prints the precision it chose.

nanoGPT runs from its own checkout (--nanogpt, never copied into this project): its
data/shakespeare_char/prepare.py runs in a scratch folder, on an input.txt written there from
--corpus, so nothing is downloaded; `train.py config/train_shakespeare_char.py` then trains with
the recipe's overrides, evaluating (eval_iters batches per split) and saving ckpt.pt only at the
first and last iteration. This project runs `train/main.py` with the same recipe, evaluation at the
end only and its default snapshots, on the same corpus prepared once beforehand.
The jobs run one at a time, interleaved (nanoGPT, project, nanoGPT, ...; --rounds of each), so a
change in the machine's load falls on both alike. On the 2-core development machine the same job's
step time varied by about +-5% from one process to the next, so ratios within that are a tie;
more --rounds narrow it.

A third side, `modern` (leave it out with --no-modern), trains today's recipe (model.arch=modern,
trainer.optimizer=muon) at the same sizes and steps with the project's defaults for everything else (learning
rates, warm-up, clipping): what a user sets is the model's size, the batch and the steps. It keeps a snapshot every
--every steps; each is scored with the estimator below, and the job's time to nanoGPT's final val loss of its round is
the seconds from the job's start to the first snapshot's step at or below it (the time of that step's progress
record). Issue 49's goal: at most a third of nanoGPT's wall.

Measured for each job:
- tokens/s: the median over windows of 10 steps of batch * block * steps / seconds, skipping the
  first steps (warm-up) and the last (evaluation, saving). nanoGPT logs the time of every
  iteration (log_interval 1), summed here over the same windows the project's metrics.jsonl has.
- wall: seconds from starting the process to its exit (start-up, training, evaluation, saving).
  nanoGPT's includes its two evaluations of 2 x eval_iters batches; the project's one of 128 examples.
- val loss: one estimator for both. The final weights of each side (the project's last snapshot,
  nanoGPT's ckpt.pt, loaded with weights_only=True into each project's own model class) are scored
  on every non-overlapping 64-character window of the text both held out (the tail of the corpus
  after the later of the two train/val split points), each side encoding the text with its own
  character vocabulary; mean cross-entropy per predicted character.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = "/work/shared/data/tinyshakespeare.txt"
N_LAYER, N_HEAD, N_EMBD, BLOCK, BATCH = 4, 4, 128, 64, 12
LR, MIN_LR, WARMUP, BETA2, WEIGHT_DECAY, GRAD_CLIP = 1e-3, 1e-4, 100, 0.99, 0.1, 1.0
WINDOW = 10  # steps per rate sample: the project logs every 10 steps (trainer.log_every)


MODERN = ["model.arch=modern", "trainer.optimizer=muon"]  # the project's defaults for the rest


@dataclass
class Job:
    side: str  # "nanoGPT", "project" (GPT-2's recipe, nanoGPT's hyperparameters) or "modern"
    round: int
    tokens_per_s: float
    wall_s: float
    val_loss: float = float("nan")
    to_target_s: float = float("nan")  # modern: seconds from its start to nanoGPT's final val loss of the round


def prepare_nanogpt(checkout: Path, corpus: Path, workdir: Path) -> Path:
    """nanoGPT's own prepare.py, run on a copy in scratch with input.txt already there (no download)."""
    data_dir = workdir / "nanogpt-data" / "shakespeare_char"
    data_dir.mkdir(parents=True)
    shutil.copy(checkout / "data" / "shakespeare_char" / "prepare.py", data_dir / "prepare.py")
    shutil.copy(corpus, data_dir / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=data_dir, check=True, stdout=subprocess.DEVNULL)
    return data_dir


def prepare_project(corpus: Path, workdir: Path) -> Path:
    from mingpt.data.prepare import PrepareConfig, prepare

    return Path(prepare(PrepareConfig(corpus=str(corpus), prepared_dir=str(workdir / "project-data"))))


def run_logged(cmd: list[str], cwd: Path, log: Path) -> float:
    """Run `cmd` with its output in `log`; wall seconds. Exits with the log's tail if the job fails."""
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed ({rc}); the end of {log}:\n{tail}")
    return wall


def run_nanogpt(checkout: Path, data_dir: Path, out_dir: Path, steps: int, eval_iters: int) -> tuple[float, Path]:
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
           "--dtype=float32", f"--eval_iters={eval_iters}", f"--eval_interval={steps}", "--log_interval=1",
           f"--block_size={BLOCK}", f"--batch_size={BATCH}", f"--n_layer={N_LAYER}", f"--n_head={N_HEAD}",
           f"--n_embd={N_EMBD}", f"--max_iters={steps}", f"--lr_decay_iters={steps}", "--dropout=0.0",
           f"--dataset={data_dir}", f"--out_dir={out_dir}", "--wandb_log=False"]
    log = out_dir.parent / f"{out_dir.name}.log"
    return run_logged(cmd, checkout, log), log


def run_project(prepared: Path, snap_dir: Path, corpus: Path, steps: int, recipe: list[str]) -> float:
    cmd = [sys.executable, str(REPO / "train" / "main.py"), f"model.n_layer={N_LAYER}", f"model.n_head={N_HEAD}",
           f"model.n_embd={N_EMBD}", "model.dropout=0", f"data.corpus={corpus}", f"data.block_size={BLOCK}",
           f"data.prepared_dir={prepared}", f"trainer.global_batch_size={BATCH}", f"trainer.micro_batch_size={BATCH}",
           f"trainer.max_steps={steps}", "trainer.eval_every=0", f"trainer.log_every={WINDOW}",
           f"snapshot.dir={snap_dir}", *recipe]
    return run_logged(cmd, snap_dir.parent, snap_dir.parent / f"{snap_dir.name}.log")


def gpt2_recipe() -> list[str]:
    """nanoGPT's: GPT-2's model and AdamW, with its learning rates, schedule and clipping."""
    return ["model.arch=gpt2", "trainer.optimizer=adamw", f"trainer.lr={LR}", f"trainer.min_lr_ratio={MIN_LR / LR}",
            f"trainer.warmup_steps={WARMUP}", f"trainer.beta2={BETA2}", f"trainer.weight_decay={WEIGHT_DECAY}",
            f"trainer.grad_clip={GRAD_CLIP}"]


def skipped(steps: int) -> int:
    """Warm-up steps left out of the rates."""
    return min(20, steps // 5)


def nanogpt_rate(log: Path, steps: int) -> float:
    """Median tokens/s over windows of WINDOW iterations, from nanoGPT's `iter N: ..., time X ms` lines.
    Iteration 0 and the last evaluate (and the last saves), so they are left out with the warm-up."""
    times = {int(m[1]): float(m[2]) / 1000 for m in re.finditer(r"^iter (\d+): loss \S+, time ([\d.]+)ms",
                                                                   log.read_text(), re.M)}
    first, end = skipped(steps) + 1, steps  # iterations [first, end) are clean
    windows = [sum(times[i] for i in range(s, s + WINDOW)) for s in range(first, end - WINDOW + 1, WINDOW)]
    return statistics.median(BATCH * BLOCK * WINDOW / w for w in windows)


def project_rate(snap_dir: Path, steps: int) -> float:
    """Median tokens_per_s of the metrics.jsonl progress records (each a window of WINDOW steps),
    leaving out windows that overlap the warm-up and the last one (evaluation, final snapshot)."""
    records = [json.loads(line) for line in (snap_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records
             if "tokens_per_s" in r and r["step"] - WINDOW >= skipped(steps) and r["step"] < steps]
    return statistics.median(rates)


def held_out_text(corpus: Path, prepared: Path) -> str:
    """The text neither side trained on: after nanoGPT's split (90% of characters) and the project's
    (its train tokens; one document, so one token per character from the start)."""
    from mingpt.data.prepared import read_meta

    text = corpus.read_text()
    return text[max(int(0.9 * len(text)), read_meta(prepared)["train_tokens"]):]


@torch.no_grad()
def windowed_loss(model: torch.nn.Module, ids: torch.Tensor, batch: int = 64) -> float:
    """Mean cross-entropy over every non-overlapping window of BLOCK inputs (targets shifted by one)."""
    n = (len(ids) - 1) // BLOCK
    x, y = ids[: n * BLOCK].view(n, BLOCK), ids[1 : n * BLOCK + 1].view(n, BLOCK)
    total = 0.0
    for i in range(0, n, batch):
        logits, _ = model(x[i : i + batch], y[i : i + batch])
        total += F.cross_entropy(logits.flatten(0, 1).float(), y[i : i + batch].flatten(), reduction="sum").item()
    return total / (n * BLOCK)


def project_val_loss(snap_dir: Path, text: str) -> float:
    """The estimator's loss of the snapshot `snap_dir` (a snapshot folder, or a run's: its latest)."""
    from mingpt.checkpoint.load import open_model

    _, model, tokenizer = open_model(str(snap_dir), torch.device("cpu"))
    return windowed_loss(model, torch.tensor(tokenizer.encode(text)))


def seconds_to(target: float, snap_dir: Path, start: float, text: str) -> tuple[int, float] | None:
    """(step, seconds from the job's start) of the first of its snapshots whose loss is at or below `target`."""
    times = {r["step"]: r["time"] for r in map(json.loads, (snap_dir / "metrics.jsonl").read_text().splitlines())
             if "tokens_per_s" in r}
    for folder in sorted(snap_dir.glob("step-*")):
        step = int(folder.name.removeprefix("step-"))
        if step in times and project_val_loss(folder, text) <= target:
            return step, times[step] - start
    return None


def load_nanogpt_model_module(checkout: Path) -> ModuleType:
    """nanoGPT's model.py from the checkout, under a name of its own."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", checkout / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nanogpt_val_loss(nanogpt: ModuleType, out_dir: Path, corpus_text: str, text: str) -> float:
    ckpt = torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=True)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter count
        model = nanogpt.GPT(nanogpt.GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    stoi = {c: i for i, c in enumerate(sorted(set(corpus_text)))}  # its prepare.py's vocabulary
    assert len(stoi) == ckpt["model_args"]["vocab_size"], "nanoGPT's vocabulary is not the corpus's characters"
    return windowed_loss(model.eval(), torch.tensor([stoi[c] for c in text]))


def print_table(jobs: list[Job]) -> None:
    print(f"\n{'side':8} {'round':>5} {'tokens/s':>10} {'wall s':>8} {'val loss':>9}")
    for j in jobs:
        print(f"{j.side:8} {j.round:>5} {j.tokens_per_s:>10,.0f} {j.wall_s:>8.1f} {j.val_loss:>9.4f}")
    summary = {}
    for side in ("nanoGPT", "project", "modern"):
        if not any(j.side == side for j in jobs):
            continue
        mine = [j for j in jobs if j.side == side]
        summary[side] = (statistics.median(j.tokens_per_s for j in mine), statistics.median(j.wall_s for j in mine),
                         statistics.mean(j.val_loss for j in mine))
        rate, wall, loss = summary[side]
        print(f"{side:8} {'all':>5} {rate:>10,.0f} {wall:>8.1f} {loss:>9.4f}   (median, median, mean)")
    (n_rate, n_wall, n_loss), (p_rate, p_wall, p_loss) = summary["nanoGPT"], summary["project"]
    print(f"\nproject / nanoGPT: tokens/s {p_rate / n_rate:.3f}x, wall {p_wall / n_wall:.3f}x; "
          f"val loss project - nanoGPT {p_loss - n_loss:+.4f}")
    if "modern" in summary:
        m_rate, m_wall, m_loss = summary["modern"]
        walls = {j.round: j.wall_s for j in jobs if j.side == "nanoGPT"}
        shares = [j.to_target_s / walls[j.round] for j in jobs if j.side == "modern"]  # nan where never reached
        print(f"modern / nanoGPT: tokens/s {m_rate / n_rate:.3f}x, wall {m_wall / n_wall:.3f}x; val loss modern - "
              f"nanoGPT {m_loss - n_loss:+.4f}; to nanoGPT's final val loss in "
              f"{', '.join(f'{x:.3f}' for x in shares)} of nanoGPT's wall (the goal: at most 0.333)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout (git work tree)")
    parser.add_argument("--corpus", type=Path, default=Path(DEFAULT_CORPUS))
    parser.add_argument("--steps", "--max_iters", "--max-iters", dest="steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2, help="jobs per side, interleaved")
    parser.add_argument("--eval-iters", type=int, default=200, help="nanoGPT's eval_iters (its own estimate)")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--no-modern", dest="modern", action="store_false", help="leave out the modern side")
    parser.add_argument("--every", type=int, default=100, help="modern: steps between its snapshots")
    args = parser.parse_args()
    checkout, corpus = args.nanogpt.resolve(), args.corpus.resolve()
    if not (checkout / "train.py").is_file() or not (checkout / "data" / "shakespeare_char" / "prepare.py").is_file():
        parser.error(f"--nanogpt {checkout} is not a nanoGPT checkout (no train.py or data/shakespeare_char)")
    if args.steps < WARMUP + 5 * WINDOW:  # nanoGPT divides by lr_decay_iters - warmup_iters
        parser.error(f"--steps must be at least {WARMUP + 5 * WINDOW} (the warm-up is {WARMUP} steps)")
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="bench-vs-nanogpt-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.steps} steps x {args.rounds} rounds; "
          f"nanoGPT {checkout} ({_git_head(checkout)}); scratch {workdir}")

    nano_data, prepared = prepare_nanogpt(checkout, corpus, workdir), prepare_project(corpus, workdir)
    text = held_out_text(corpus, prepared)
    nanogpt = load_nanogpt_model_module(checkout)
    jobs = []
    for r in range(1, args.rounds + 1):
        out_dir = workdir / f"nanogpt-{r}"
        wall, log = run_nanogpt(checkout, nano_data, out_dir, args.steps, args.eval_iters)
        jobs.append(Job("nanoGPT", r, nanogpt_rate(log, args.steps), wall,
                        nanogpt_val_loss(nanogpt, out_dir, corpus.read_text(), text)))
        print(f"nanoGPT round {r}: {jobs[-1].tokens_per_s:,.0f} tokens/s, {wall:.1f} s; its own estimate: "
              f"{_nanogpt_own_val(log)}", flush=True)
        target = jobs[-1].val_loss
        snap_dir = workdir / f"project-{r}"
        wall = run_project(prepared, snap_dir, corpus, args.steps, gpt2_recipe())
        jobs.append(Job("project", r, project_rate(snap_dir, args.steps), wall, project_val_loss(snap_dir, text)))
        chosen = re.search(r"process\(es\), (\w+ \([^)]*\))", (workdir / f"project-{r}.log").read_text())
        print(f"project round {r}: {jobs[-1].tokens_per_s:,.0f} tokens/s, {wall:.1f} s, "
              f"{chosen[1] if chosen else 'precision not logged'}", flush=True)
        if args.modern:
            jobs.append(run_modern(r, target, args, prepared, corpus, text, workdir))
    print(f"val loss: {len(text):,} held-out characters, {(len(text) - 1) // BLOCK:,} windows of {BLOCK}")
    print_table(jobs)


def run_modern(r: int, target: float, args: argparse.Namespace, prepared: Path, corpus: Path, text: str,
               workdir: Path) -> Job:
    snap_dir, start = workdir / f"modern-{r}", time.time()
    wall = run_project(prepared, snap_dir, corpus, args.steps,
                       [*MODERN, f"snapshot.every={args.every}", f"snapshot.keep={args.steps}"])
    job = Job("modern", r, project_rate(snap_dir, args.steps), wall, project_val_loss(snap_dir, text))
    found = seconds_to(target, snap_dir, start, text)
    if found:
        job.to_target_s = found[1]
    print(f"modern round {r}: {job.tokens_per_s:,.0f} tokens/s, {wall:.1f} s; nanoGPT's val loss {target:.4f} "
          + (f"at step {found[0]}, {found[1]:.1f} s from its start" if found else "never reached"), flush=True)
    return job


def _nanogpt_own_val(log: Path) -> str:
    found = re.findall(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)", log.read_text(), re.M)
    return f"val loss {found[-1][2]} at step {found[-1][0]}" if found else "none logged"


def _git_head(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "not a git work tree"


if __name__ == "__main__":
    main()
