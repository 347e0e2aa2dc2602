"""Hung and slow workers: found by the agent's watchdog (mingpt.launch.watchdog) and the step-time
comparison (mingpt.training.stragglers), with real torchrun processes frozen by SIGSTOP; and their rules
in this process."""

import logging
import os
import re
import signal
import threading
import time

import pytest
import torch
from launch import SMALL, config, metrics, output, standalone, wait_for, worker

from mingpt import jobenv
from mingpt.errors import ConfigError
from mingpt.jobenv import read_mark
from mingpt.launch import watchdog
from mingpt.model import GPT, GPTConfig
from mingpt.training import progress
from mingpt.training.distributed import World
from mingpt.training.stragglers import WINDOW, StepTimes

HEAVIER = ["model=gpt-micro", "data.block_size=64", "trainer.global_batch_size=16", "trainer.micro_batch_size=8"]


def reached(snap) -> int:
    steps = [m["step"] for m in metrics(snap) if "train_loss" in m]
    return max(steps, default=0)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_frozen_worker_then_a_frozen_leader_are_named_with_their_stacks_and_the_job_goes_on(tmp_path, procs):
    """Two workers under mingpt-torchrun --max-restarts=0, a memory tier copied every step. A worker, then the
    leader, is stopped with SIGSTOP: each time the log names its pid and shows its Python stack, and the job
    trains past the step it had reached, having trained at most one step again. Then a worker stopped a
    half of its time (SIGSTOP/SIGCONT) is named as a slow process."""
    snap = tmp_path / "snap"
    job = procs.start(standalone(2) + [
        *SMALL, *HEAVIER, "trainer.max_steps=100000000", "trainer.log_every=1", "trainer.hang_timeout_s=5",
        f"snapshot.dir={snap}", f"data.prepared_dir={tmp_path / 'prepared'}", "snapshot.every=1000",
        "snapshot.memory=on", "snapshot.memory_every=1", f"snapshot.memory_dir={tmp_path}"], "job")
    target = 20
    for local_rank, name in ((1, "a worker"), (0, "the leader")):
        wait_for(lambda: reached(snap) >= target, 120, "training", [job])
        frozen = worker(job.pid, local_rank)
        os.kill(frozen, signal.SIGSTOP)
        frozen_at = reached(snap)
        wait_for(lambda: reached(snap) > frozen_at + 1, 120, f"training past the step {name} was frozen at", [job])
        # The watchdog's restart, not torch's own dist timeout (300 s), got it going again: the log says so.
        text = output(job)
        assert re.search(rf"worker {frozen} on \S+ made no progress for \d+ s \(step \d+, computing; stopped\)", text)
        assert re.search(r'File "[^"]+trainer\.py", line \d+, in ', text)  # its stack, as Python writes one
        assert "restart: hung: " in text
        target = reached(snap) + 10
    lost = [m["steps_lost"] for m in metrics(snap) if "steps_lost" in m]
    assert len(lost) == 2 and max(lost) <= 1, lost

    slowed = worker(job.pid, local_rank=1)
    stop = threading.Event()

    def duty_cycle():  # stopped half the time: slower than its peers by far more than their noise on a busy machine
        while not stop.is_set():
            os.kill(slowed, signal.SIGSTOP)
            time.sleep(0.1)
            os.kill(slowed, signal.SIGCONT)
            time.sleep(0.1)

    cycling = threading.Thread(target=duty_cycle)
    cycling.start()
    try:
        wait_for(lambda: f"pid {slowed} takes" in output(job), 90,
                 "the slow process named", [job])
    finally:
        stop.set()
        cycling.join()
        os.kill(slowed, signal.SIGCONT)
    after = output(job).split(f"pid {slowed} takes")[-1]
    assert "made no progress" not in after  # slow is not hung
    wait_for(lambda: "| slow: " in output(job).split(f"pid {slowed} takes")[-1], 30, "the progress line", [job])
    assert any("process_times" in m for m in metrics(snap))


def fake_kill(monkeypatch, ended: list) -> None:
    """os.kill records the made-up pids (101, 102) instead of signalling them; it is one function for the whole test
    process, where other tests' threads may signal their own processes meanwhile."""
    real = os.kill
    monkeypatch.setattr(watchdog.os, "kill", lambda pid, sig: ended.append(pid) if pid in (101, 102) else real(pid, sig))


def marks(tmp_path, records: dict, hang_timeout_s: float = 0.0, first: int = 0) -> list[int]:
    """Progress files as workers write them: pid -> (step, phase, seconds since), each having started computing
    at step `first`, its first step allowed 300 s (trainer.dist_timeout_s)."""
    for pid, (step, phase, age) in records.items():
        (tmp_path / str(pid)).write_bytes(jobenv.RECORD.pack(step, jobenv.PHASES.index(phase),
                                                               time.monotonic() - age, hang_timeout_s, first, 300.0))
    return list(records)


def test_auto_hang_timeout_waits_for_step_times_then_takes_20_median_steps_at_least_20_s(tmp_path, monkeypatch):
    dog = watchdog.Watchdog()
    own, dog.folder = dog.folder, tmp_path
    try:
        pids = marks(tmp_path, {101: (0, "starting", 0), 102: (0, "starting", 0)})
        assert dog.check(pids) == [] and dog.timeout({}) is None  # nothing timed yet: never acts
        for step in range(1, 12):  # 0.1 s steps (the first SKIPPED left out)
            marks(tmp_path, {101: (step, "computing", 1.1 - 0.1 * step), 102: (step, "computing", 1.1 - 0.1 * step)})
            dog.check(pids)
        assert dog.timeout({}) == pytest.approx(watchdog.HANG_FLOOR_S)
        dog._times.extend([2.0] * 50)  # 2 s steps: 20 of them
        assert dog.timeout({}) == pytest.approx(40.0)
        # A worker marked 50 s ago, the other 45 s ago, neither stopped: the older one, once past 1.5 x 40 s.
        ended = []
        monkeypatch.setattr(watchdog, "stack", lambda pid: "  (a stack)")
        fake_kill(monkeypatch, ended)
        marks(tmp_path, {101: (20, "computing", 50), 102: (20, "computing", 45)})
        assert dog.check(pids) == []
        marks(tmp_path, {101: (20, "computing", 61), 102: (20, "saving", 100)})  # saving: left to the store
        assert dog.check(pids) == [101] and ended == [101]
        assert "hung: " in dog.finding and "pid 101" in dog.finding
    finally:
        dog.folder = own
        dog.close()


@pytest.mark.parametrize("step, phase", [(40, "computing"), (47, "compiling")])
def test_a_first_step_or_a_compile_is_allowed_the_collective_timeout_not_the_hang_timeout(tmp_path, monkeypatch,
                                                                                          step, phase):
    """A first step that warms up, or a compile at any later step (evaluation, a last batch of another shape),
    for minutes is not a hang (trainer.hang_timeout_s=5); past trainer.dist_timeout_s it is; and the step
    after it has the hang timeout again."""
    ended = []
    monkeypatch.setattr(watchdog, "stack", lambda pid: "  (a stack)")
    fake_kill(monkeypatch, ended)
    dog = watchdog.Watchdog()
    own, dog.folder = dog.folder, tmp_path
    try:
        pids = marks(tmp_path, {101: (step, phase, 240), 102: (step, phase, 240)}, 5.0, first=40)
        assert dog.check(pids) == [] and ended == []  # 4 minutes into it, the workers having restarted at step 40
        marks(tmp_path, {101: (step, phase, 460), 102: (step, phase, 240)}, 5.0, first=40)
        assert dog.check(pids) == [101]  # past 1.5 x 300 s
        assert f"at step {step}, {phase}, for 460 s; a first step or a compile, allowed trainer.dist_timeout_s " \
               "300 s" in dog.finding
        marks(tmp_path, {101: (step + 1, "computing", 8), 102: (step + 1, "computing", 6)}, 5.0, first=40)
        assert dog.check(pids) == [101] and ended == [101, 101]  # the next step: 1.5 x 5 s
    finally:
        dog.folder = own
        dog.close()


def test_every_compile_of_a_worker_is_marked_compiling_while_it_lasts(tmp_path, monkeypatch):
    """A real torch.compile of a GPT: its first compile, the recompile that evaluation makes (model.eval() fails
    a guard) and the one a batch of another shape makes each mark the step as compiling while they last, in
    whatever phase they come; after each, the phase the worker was in is back, marked afresh. (The backend reads
    the mark as torch compiles and then runs the graph as it is: Inductor would take half a minute here.)"""
    folder = tmp_path / "progress"
    folder.mkdir(mode=0o700)
    path = folder / str(os.getpid())
    seen = []  # the mark as each compile found it

    def backend(graph, example_inputs):
        seen.append(read_mark(path)[:2])
        return graph.forward

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=17, block_size=16, n_layer=1, n_head=2, n_embd=16))
    model.compile(backend=backend, dynamic=False)
    batch = torch.randint(0, 17, (2, 16))
    torch.compiler.reset()  # what other tests of this process compiled counts towards no recompile limit
    worker = progress.Progress(str(folder), hang_timeout_s=5.0, warmup_s=300.0)
    try:
        worker.watch_compiles()
        for step, phase, run, compiles in [
            (0, "computing", lambda: model(batch, batch)[1].backward(), True),
            (1, "computing", lambda: model(batch, batch)[1].backward(), False),  # compiled already
            (7, "computing", lambda: model.eval()(batch, batch), True),  # evaluation after step 7
            (7, "evaluating", lambda: model(batch[:1], batch[:1]), True),  # a batch of another shape
        ]:
            worker.mark(step, phase)
            before, compiled = read_mark(path).when, len(seen)
            run()
            assert (len(seen) > compiled) == compiles and set(seen[compiled:]) <= {(step, "compiling")}, seen
            after = read_mark(path)
            assert after[:2] == (step, phase) and (after.when > before) == compiles, (step, phase)
        worker.close()
        unwatched, compiled = read_mark(path), len(seen)
        model(batch[:1, :8], batch[:1, :8])  # compiles once more, no longer watched
        assert len(seen) > compiled and read_mark(path) == unwatched
    finally:
        worker.close()
        torch.compiler.reset()


def test_a_worker_marks_the_step_it_started_at_and_whether_it_completed_one(tmp_path, monkeypatch):
    folder = tmp_path / "progress"
    folder.mkdir(mode=0o700)
    worker = progress.Progress(str(folder), hang_timeout_s=5.0, warmup_s=300.0)
    path = folder / str(os.getpid())
    try:
        assert read_mark(path)[:2] == (0, "starting") and not read_mark(path).progressed
        worker.mark(40, "starting")  # resumed at step 40
        worker.mark(40, "computing")
        mark = read_mark(path)
        assert (mark.first, mark.warmup_timeout, mark.in_first_step, mark.progressed) == (40, 300.0, True, False)
        worker.mark(41, "saving")  # step 40 done
        assert read_mark(path).progressed and not read_mark(path).in_first_step
    finally:
        worker.close()


def test_a_straggler_is_named_once_per_episode_and_noise_is_not(caplog):
    caplog.set_level(logging.INFO, logger="mingpt")
    world = World(rank=0, world_size=1, local_rank=0, device=None)
    logged = []

    class Metrics:
        def log(self, step, record):
            logged.append(record)

    times = StepTimes(world, Metrics())
    times.names = ["a pid 1", "b pid 2", "c pid 3"]
    step_s = 0.1
    window = lambda slow, step: times._report(step, [[0.0, 0.02, 0.08], [0.0, 0.02, 0.08], [0.0, slow, 0.1 - slow]],
                                                step_s)
    window(0.023, WINDOW)  # 15% more: not 20%
    window(0.021 + 0.02, 2 * WINDOW)  # twice the others: once is not yet an episode
    assert "slow process" not in caplog.text
    for step in range(3, 8):
        window(0.041, step * WINDOW)
    assert caplog.text.count("slow process: c pid 3 takes 2.05x") == 1
    for step in range(8, 12):
        window(0.02, step * WINDOW)
    assert caplog.text.count("c pid 3 is back to the others' speed") == 1
    assert logged[0]["process_times"][2] == {"process": "c pid 3", "data_ms": 0.0, "compute_ms": 23.0, "sync_ms": 77.0}


@pytest.mark.parametrize("value", ["3", "400"])
def test_a_hang_timeout_that_contradicts_the_collective_timeout_is_one_line(value):
    with pytest.raises(ConfigError, match="trainer.hang_timeout_s must be 0 .chosen from the step time. or at least 5 s "
                                          "and below trainer.dist_timeout_s=300"):
        config(f"trainer.hang_timeout_s={value}")


def test_a_progress_folder_that_is_not_the_agents_own_is_ignored_with_one_warning(tmp_path, monkeypatch, caplog):
    """MINGPT_PROGRESS_DIR missing, a file, a link, a folder others can write holding a FIFO, a FIFO in place of
    the mark file: no traceback and no wait; the worker trains on, unwatched, having said so once."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # as /tmp: anyone may plant a FIFO by the worker's name
    os.mkfifo(shared / str(os.getpid()))
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    fifo_inside = tmp_path / "fifo-inside"
    fifo_inside.mkdir(mode=0o700)
    os.mkfifo(fifo_inside / str(os.getpid()))
    (tmp_path / "file").write_text("")
    (tmp_path / "link").symlink_to(private)
    for folder in ("missing", "file", "link", "shared", "fifo-inside"):
        caplog.clear()
        marks = progress.Progress(str(tmp_path / folder), hang_timeout_s=0.0, warmup_s=300.0)
        marks.mark(3, "computing")
        assert marks.fd is None, folder
        assert caplog.text.count("progress is not reported") == 1, folder
        assert read_mark(tmp_path / folder / str(os.getpid())) is None  # a FIFO is never waited on
    caplog.clear()
    marks = progress.Progress(str(private), hang_timeout_s=7.0, warmup_s=300.0)  # as the agent makes it
    try:
        marks.mark(3, "computing")
        assert read_mark(private / str(os.getpid()))[:2] == (3, "computing") and not caplog.text
    finally:
        marks.close()
