"""The live mode (mingpt-torchrun --live, on torchft): nodes die, leave and join while the others keep their
processes. Real mingpt-torchrun nodes around a real mingpt-rendezvous (store and Lighthouse) on 127.0.0.1;
unit tests of the healing transport over real HTTP."""

import json
import re
import shutil
import signal
import subprocess
import threading
import urllib.request
from datetime import timedelta

import numpy as np
import pytest
import torch
from launch import (BIN, ENDLESS_STEPS, HEAVIER, KEEP_ALL, MAIN, SMALL, assert_equal_weights, env, free_port,
                    kill_node, latest_step, ledger, metrics, output, overrides, rendezvous, standalone, stop, torchrun,
                    wait_for, weights, worker)

from mingpt.checkpoint.memory import MemoryTier
from mingpt.checkpoint.packing import pack
from mingpt.errors import PeerLeft
from mingpt.jobenv import LIGHTHOUSE_KEY, PEER_LOST, JobEnv, LiveEndpoints
from mingpt.training.distributed import World
from mingpt.training.healing import HealingError, VerifiedTransport, decode, encode
from mingpt.training.parallel import Topology
from mingpt.training.live import COLLECTIVE_TIMEOUT_S, NEVER, SINCE, LiveAgreement, credentials, eldest, misfit


def test_a_group_is_of_the_job_where_its_job_data_layout_and_optimizer_are_those_of_the_group_longest_in_it():
    """Every step's table carries each group's credentials, and so does the state a peer sends a healing group:
    a group whose credentials differ from those of the group longest in the job is refused, naming both."""
    job = credentials("live", "a" * 64, 2, "hsdp")
    assert misfit(job, job, "live") is None
    assert str(misfit(credentials("live", "b" * 64, 2, "hsdp"), job, "live")) == (
        "this node's prepared data (fingerprint bbbbbbbbbbbb) is not that of live job live (fingerprint aaaaaaaaaaaa, "
        "as the node longest in the job prepared it): start every node of a job with the same data settings and "
        "corpus; to train on other data, start another job (another --rdzv-id)")
    assert str(misfit(credentials("live", "a" * 64, 1, "ddp"), job, "live")) == (
        "this node runs ddp, adamw, where live job live runs 2 worker(s) per node, hsdp, adamw (as the node longest in "
        "the job does): start every node of a job with the same trainer.parallelism and trainer.optimizer, and under "
        "hsdp the same --nproc-per-node")
    assert "this node runs 1 worker(s) per node, hsdp" in str(misfit(credentials("live", "a" * 64, 1, "hsdp"), job,
                                                                     "live"))  # hsdp: nodes shard alike
    muon = credentials("live", "a" * 64, 1, "ddp", "muon")  # same gradients, other weights after the step
    assert misfit(muon, muon, "live") is None
    assert "this node runs ddp, muon, where live job live runs ddp, adamw" in \
        str(misfit(muon, credentials("live", "a" * 64, 1, "ddp"), "live"))
    assert str(misfit(credentials("other", "a" * 64, 2, "hsdp"), job, "live")).startswith(
        "another live job trains on the Lighthouse this node met, not job live")


def test_the_job_is_the_group_longest_in_it_whatever_its_position_and_else_one_with_the_runs_data():
    """A group that joined after a restart of mingpt-rendezvous may sort first in the quorum: it never takes the
    writing over from a group that has committed steps longer. Where no group of the quorum has committed yet
    (the one that had is not in it), the job's credentials are those of a group whose data is the run's."""
    row = lambda since, keeps_the_run=True, node=0: [0.0] * SINCE + [float(since), float(keeps_the_run), 0.0,
                                                                     float(node)]
    assert eldest([row(40), row(3), row(3), row(12)]) == 1
    assert eldest([row(0), row(0)]) == 0
    assert eldest([row(NEVER, keeps_the_run=False), row(NEVER), row(NEVER)]) == 1
    assert eldest([row(NEVER), row(7, keeps_the_run=False)]) == 1  # (it committed with the job: the run's data changed)
    assert eldest([row(3, node=9), row(3, node=2), row(3, node=9)]) == 1  # ties: one node, wherever its groups sort


def test_a_vote_that_never_ends_loses_a_peer_and_waits_longer_than_a_collective():
    """The group's processes may reach the vote a collective's timeout apart (one learns of a dead group at once,
    another when its collective times out); a process of the group that never votes ends the generation."""
    asked = []

    class SilentGroup:
        def should_commit(self, timeout):
            asked.append(timeout)
            raise TimeoutError("Timeout expired")

    endpoints = LiveEndpoints(lighthouse="http://127.0.0.1:1", rendezvous="127.0.0.1:1", host="127.0.0.1", min_nodes=1)
    world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), job=JobEnv(live=endpoints))
    group = LiveAgreement(Topology(world, "ddp"), replica=None, checkpointer=None, global_batch_size=8,
                          state=dict, load=print)  # built, not started: it reaches nothing
    group.manager = SilentGroup()
    with pytest.raises(PeerLeft) as ended:
        group._vote()
    assert ended.value.exit_code == PEER_LOST and "TimeoutError: Timeout expired" in str(ended.value)
    assert asked[0] > timedelta(seconds=COLLECTIVE_TIMEOUT_S)


# -- the transport a joining node heals through ----------------------------------------------------------------


def a_state():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "tied": None,
             "train": {"step": 7, "samples_seen": 56}}
    state["tied"] = state["model"]["weight"]  # one tensor under two names, as tied embeddings are
    return state


def test_a_state_travels_whole_and_refuses_a_flipped_bit_or_a_cut():
    state = a_state()
    data = encode(state)
    back = decode(data)
    assert back["train"] == {"step": 7, "samples_seen": 56}
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)  # tuples stay tuples
    for key, value in state["model"].items():
        assert torch.equal(back["model"][key], value)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert back["tied"] is back["model"]["weight"]

    flipped = bytearray(data)
    flipped[-3] ^= 0x01  # a bit of the last tensor's bytes, as a bad link would flip it
    with pytest.raises(HealingError, match="do not match the sha256 their sender computed"):
        decode(bytes(flipped))
    with pytest.raises(HealingError, match="not a state"):
        decode(data[: len(data) // 2])


def test_a_pickle_is_not_a_state():
    import pickle

    with pytest.raises(HealingError, match="not a state"):
        decode(pickle.dumps({"weights": torch.ones(2)}))


def test_a_healer_gets_the_step_the_source_serves_once_it_serves_it():
    """The healer may ask before the source's quorum staged the state: it waits; a step the source does not
    serve is refused; once the source's step is over, nothing is served."""
    source = VerifiedTransport("127.0.0.1", timedelta(seconds=5))
    healer = VerifiedTransport("127.0.0.1", timedelta(seconds=5))
    try:
        got = []
        asking = threading.Thread(target=lambda: got.append(healer.recv_checkpoint(0, source.metadata(), 3,
                                                                                    timedelta(seconds=5))))
        asking.start()
        source.send_checkpoint([1], 3, a_state(), timedelta(seconds=5))
        asking.join(10)
        assert got and got[0]["train"]["step"] == 7
        source.disallow_checkpoint()
        source.timeout = timedelta(seconds=0.1)  # how long a request for a step not served waits for it
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"{source.metadata()}3", timeout=10)
    finally:
        source.shutdown()
        healer.shutdown()


def test_a_healer_refuses_a_damaged_state_and_gets_it_from_another_group():
    """The source torchft chose sends a state whose bytes changed after its sender hashed them: the healer
    refuses it and asks the other groups, one of which serves the step's state while its step lasts."""
    source, other = (VerifiedTransport("127.0.0.1", timedelta(seconds=5)) for _ in range(2))
    healer = VerifiedTransport("127.0.0.1", timedelta(seconds=5), lambda: [source.metadata(), other.metadata()])
    try:
        source.send_checkpoint([1], 3, a_state(), timedelta(seconds=5))
        step, payload = source._served
        source._served = (step, payload[:-3] + bytes([payload[-3] ^ 1]) + payload[-2:])  # a bit flipped on the way
        other.offer(3, a_state)
        got = healer.recv_checkpoint(0, source.metadata(), 3, timedelta(seconds=5))
        assert got["train"] == {"step": 7, "samples_seen": 56}
        other.disallow_checkpoint()  # its step is over: nobody sends a sound state of step 3 now
        other.timeout = timedelta(seconds=0.1)
        with pytest.raises(HealingError, match="do not match"):
            healer.recv_checkpoint(0, source.metadata(), 3, timedelta(seconds=5))
    finally:
        for transport in (source, other, healer):
            transport.shutdown()


# -- whole jobs ------------------------------------------------------------------------------------------------


def live_node(procs, tmp_path, port, name, machine, workers=1, extra=(), every=10, min_nodes=2):
    """A node of the live job `live` (`workers` of them), logging to NAME.log, on `machine`: the memory it keeps
    its memory tier in."""
    (tmp_path / machine).mkdir(exist_ok=True)
    args = torchrun("--live", f"--nnodes={min_nodes}:4", f"--nproc-per-node={workers}", "--max-restarts=0",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=live")
    args += overrides(tmp_path, "live", ENDLESS_STEPS, every, [*HEAVIER, *KEEP_ALL, "snapshot.memory_every=1",
                                                               f"snapshot.memory_dir={tmp_path / machine}", *extra])
    return procs.start(args, name)


@pytest.mark.slow
def test_nodes_die_and_join_the_lighthouse_restarts_everything_dies_and_nothing_is_lost(tmp_path, procs, reference):
    """Two live nodes, one worker each, --nnodes=2:4: no step is committed by fewer than two, so the run is
    that of two processes throughout.
    1. The writer's node is SIGKILLed between snapshots, its memory gone: the survivor's step in flight
       fails, and is done again once a new node, which finds an older snapshot, has healed from it; the
       survivor writes from then on.
    2. mingpt-rendezvous (the Lighthouse) stops and starts again on the same ports: training goes on.
    Through both, the survivors' workers are the processes they were.
    3. mingpt-rendezvous keeps nothing across its restart, yet, the newcomer gone, a node with other data that
       comes then is refused, and a node that joins then never takes the writing over from the survivor.
    4. Both nodes die, memories kept: two new nodes resume from the memory tiers.
    At the end every step's samples are in the ledger, as in an uninterrupted run, and the weights are
    bitwise those of an uninterrupted two-process run."""
    port, lighthouse = free_port(), free_port()
    store = rendezvous(procs, port, lighthouse)
    first = live_node(procs, tmp_path, port, "first", "machine-a")
    second = live_node(procs, tmp_path, port, "second", "machine-b")
    snap = tmp_path / "live"
    between_snapshots = lambda: max(ledger(snap), default=0) >= 10 and 3 <= max(ledger(snap)) % 10 <= 6
    wait_for(between_snapshots, 120, "a step between two snapshots", [first, second])
    writer, survivor = (first, second) if "this job holds" in output(first) else (second, first)
    survivor_worker = worker(survivor.pid, local_rank=0)

    kill_node(writer)  # 1.
    writer.wait(timeout=30)
    machine = "machine-a" if writer is first else "machine-b"
    shutil.rmtree(tmp_path / machine)  # its memory goes with it
    newcomer = live_node(procs, tmp_path, port, "newcomer", machine)
    wait_for(lambda: "healed from a live peer" in output(newcomer), 120, "the newcomer's heal", [survivor, newcomer])
    wait_for(lambda: "this job holds" in output(survivor), 60, "the survivor's claim", [survivor, newcomer])
    newcomer_worker = worker(newcomer.pid, local_rank=0)

    store.send_signal(signal.SIGINT)  # 2.
    store.wait(timeout=30)
    wait_for(lambda: "does not answer" in output(survivor), 60, "the lost Lighthouse", [survivor, newcomer])
    restarted_at = max(ledger(snap))
    rendezvous(procs, port, lighthouse)
    wait_for(lambda: max(ledger(snap)) > restarted_at + 5, 120, "training after the restart", [survivor, newcomer])
    assert worker(survivor.pid, local_rank=0) == survivor_worker and worker(newcomer.pid, local_rank=0) == \
        newcomer_worker  # the same processes throughout
    assert "live: met the Lighthouse again" in output(newcomer)

    kill_node(newcomer)  # 3. (two groups at most at any step: the weights are compared with two processes')
    newcomer.wait(timeout=30)
    stranger = live_node(procs, tmp_path, port, "stranger", "machine-d",  # the same text, split otherwise
                         extra=["data.val_fraction=0.2", f"data.prepared_dir={tmp_path / 'other-prepared'}"])
    latecomer = live_node(procs, tmp_path, port, "latecomer", machine)  # on the newcomer's machine, its memory kept
    assert stranger.wait(timeout=120) == 2, output(stranger)
    assert "this node's prepared data (fingerprint" in output(stranger) and "saving step" not in output(stranger)
    wait_for(lambda: "live: this group takes part" in output(latecomer), 120, "the latecomer's first step",
             [survivor, latecomer])
    joined_at = max(ledger(snap))
    wait_for(lambda: max(ledger(snap)) > joined_at + 5, 120, "training with the latecomer", [survivor, latecomer])
    assert "this job holds" not in output(latecomer)
    assert worker(survivor.pid, local_rank=0) == survivor_worker  # the stranger changed nothing

    wait_for(between_snapshots, 120, "a step between two snapshots", [survivor, latecomer])
    for node in (survivor, latecomer):  # 4.
        kill_node(node)
        node.wait(timeout=30)
    died_at = max(ledger(snap))
    again = [live_node(procs, tmp_path, port, f"again-{machine}", machine) for machine in ("machine-a", "machine-b")]
    compared = (died_at // 10 + 2) * 10
    wait_for(lambda: latest_step(snap) >= compared, 120, f"the step-{compared} snapshot", again)
    for node in again:
        node.send_signal(signal.SIGTERM)
    for node in again:
        node.wait(timeout=90)
    assert all("resumed from the memory tier" in output(node) for node in again), "".join(map(output, again))[-6000:]
    logs = "".join(output(node) for node in (survivor, newcomer, stranger, latecomer))
    assert "Traceback" not in logs, logs[-3000:]

    uninterrupted = reference.at(compared)
    seen, expected = ledger(snap), ledger(uninterrupted)
    assert [step for step in range(1, compared + 1) if seen.get(step) != expected[step]] == []
    assert_equal_weights(weights(uninterrupted, compared), weights(snap, compared))


@pytest.mark.slow
def test_a_node_that_stops_has_the_writer_save_the_step_it_left_at(tmp_path, procs):
    """A live node stopped by SIGTERM leaves, and the writer saves the step it left at, whatever snapshot.every
    says, then goes on alone. At a job's end (a time limit) every node gets SIGTERM, but a node may see it a step
    after another: the save starts at the first, not once the writer's own notice has gone on a failed step."""
    port, lighthouse = free_port(), free_port()
    rendezvous(procs, port, lighthouse)
    nodes = [live_node(procs, tmp_path, port, name, f"machine-{name}", every=100_000, min_nodes=1)
             for name in ("a", "b")]
    snap = tmp_path / "live"
    wait_for(lambda: "2 group(s)" in output(nodes[0]) and max(ledger(snap), default=0) >= 5, 120, "steps of both",
             nodes)
    writer, leaver = nodes if "this job holds" in output(nodes[0]) else nodes[::-1]
    leaver.send_signal(signal.SIGTERM)
    leaver.wait(timeout=60)
    alone = lambda: re.search(r"live: 1 group\(s\) from step (\d+) \(were 2\)", output(writer))
    wait_for(lambda: alone() and latest_step(snap) > 0, 60, "the writer alone, and its snapshot", [writer])
    assert latest_step(snap) == int(alone().group(1)) - 1  # the step the leaver's stop was committed at
    left_at = max(ledger(snap))
    wait_for(lambda: max(ledger(snap)) > left_at + 3, 60, "the writer training on", [writer])


def tier_states(machine) -> dict[tuple[int, int], tuple[int, list[torch.Tensor]]]:
    """(step, shard) -> (examples seen, every tensor) of the copies a node's memory tier holds."""
    found = {}
    for description in machine.glob("mingpt-*/own-*.json"):
        header = json.loads(description.read_text())
        buffer = torch.from_numpy(np.fromfile(description.with_suffix(".bin"), dtype=np.uint8))
        tensors: list[torch.Tensor] = []
        pack(MemoryTier.unpack(buffer, header), tensors)
        found[(header["step"], header["shard"][0])] = (header["samples_seen"], tensors)
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)  # four workers and a joiner's two on two cores
def test_hsdp_nodes_shard_within_and_heal_shard_by_shard(tmp_path, procs, reference):
    """Two live nodes of two workers, the model sharded within each node (hsdp) and replicated across them.
    1. A third node joins, and each of its workers heals its shard from the worker of its place on a live
       node.
    2. The first node is SIGKILLed: the others go on, with the same processes, the writer's snapshots sharded.
    3. Both die, their memory kept: the shards the joiner's tier holds are bitwise those of the other node's,
       optimizer state included, at the same step. Every step's samples are those of an uninterrupted run."""
    hsdp = ["trainer.parallelism=hsdp"]
    port, lighthouse = free_port(), free_port()
    rendezvous(procs, port, lighthouse)
    first = live_node(procs, tmp_path, port, "first", "machine-a", workers=2, extra=hsdp)
    second = live_node(procs, tmp_path, port, "second", "machine-b", workers=2, extra=hsdp)
    snap = tmp_path / "live"
    wait_for(lambda: max(ledger(snap), default=0) >= 5, 120, "step 5", [first, second])

    third = live_node(procs, tmp_path, port, "third", "machine-c", workers=2, extra=hsdp)  # 1.
    wait_for(lambda: "healed from a live peer" in output(third), 120, "the heal", [first, second, third])
    survivors = {node: [worker(node.pid, rank) for rank in (0, 1)] for node in (second, third)}
    kill_node(first)  # 2.
    first.wait(timeout=30)
    killed_at = max(ledger(snap))
    compared = (killed_at // 10 + 2) * 10
    wait_for(lambda: latest_step(snap) >= compared, 180, f"the step-{compared} snapshot", [second, third])
    assert {node: [worker(node.pid, rank) for rank in (0, 1)] for node in (second, third)} == survivors
    assert {path.name for path in (snap / f"step-{compared:09d}" / "state").iterdir()} == \
        {".metadata", "__0_0.distcp", "__1_0.distcp"}  # each of the writer's workers its shard
    for node in (second, third):  # 3.
        kill_node(node)
    for node in (second, third):
        node.wait(timeout=30)
    assert "Traceback" not in output(second) + output(third)

    joiner, other = tier_states(tmp_path / "machine-c"), tier_states(tmp_path / "machine-b")
    both = joiner.keys() & other.keys()
    step = max(step for step, shard in both if (step, 1 - shard) in both)  # a step of both shards on both nodes
    assert step >= compared
    for shard in (0, 1):
        (seen, ours), (theirs_seen, theirs) = joiner[step, shard], other[step, shard]
        assert seen == theirs_seen and len(ours) == len(theirs)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), f"shard {shard} of step {step} differs"
    uninterrupted = reference.at(compared)
    seen, expected = ledger(snap), ledger(uninterrupted)
    assert [step for step in range(1, compared + 1) if seen.get(step) != expected[step]] == []


@pytest.mark.slow
def test_a_node_of_two_workers_and_a_node_of_one_train_as_three_workers_do(tmp_path, procs):
    """mingpt-torchrun runs a job live wherever mingpt-rendezvous serves it, and says so first. Under ddp each
    process is a replica group of its own, so nodes of any size make one live job: every step's samples are split
    among its processes, whichever node they are on, and the run is that of three processes (to rounding: the groups
    average in another order than DDP). --nnodes's minimum counts nodes, not groups: the node of two commits nothing
    alone."""
    job = [*SMALL, "trainer.max_steps=20", "snapshot.every=10", f"data.prepared_dir={tmp_path / 'prepared'}"]
    three = procs.start(standalone(3) + job + [f"snapshot.dir={tmp_path / 'three'}"], "three")
    assert three.wait(timeout=180) == 0, output(three)[-3000:]

    port, lighthouse = free_port(), free_port()
    rendezvous(procs, port, lighthouse)
    nodes = []
    for name, workers in (("two", 2), ("one", 1)):
        (tmp_path / name).mkdir()
        node = torchrun("--nnodes=2:4", f"--nproc-per-node={workers}", "--max-restarts=0", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=uneven")  # no --live: the default
        memory = f"snapshot.memory_dir={tmp_path / name}"
        nodes.append(procs.start(node + job + [f"snapshot.dir={tmp_path / 'live'}", memory], name))
        if workers == 2:  # alone for a while: two groups, one node
            wait_for(lambda: "fewer than --nnodes's 2" in output(nodes[0]), 120, "a step of the node alone", nodes)
    for node in nodes:
        assert node.wait(timeout=180) == 0, output(node)[-3000:]
        assert f"mingpt-torchrun: live mode (mingpt-rendezvous at 127.0.0.1:{port} serves the job's Lighthouse; " \
               "--no-live for the restart mode)" in output(node)  # its first line: without --live, where it can
    assert "3 group(s)" in output(nodes[0]), output(nodes[0])[-3000:]  # a group of each process
    assert ledger(tmp_path / "live") == ledger(tmp_path / "three")
    val_loss = lambda snap: [record["val_loss"] for record in metrics(snap) if "val_loss" in record][-1]
    assert val_loss(tmp_path / "live") == pytest.approx(val_loss(tmp_path / "three"), abs=1e-3)


@pytest.mark.slow
def test_live_and_plain_nodes_of_one_job_never_share_its_run(tmp_path, procs):
    """A --live node and a plain one with the same --rdzv-id and endpoint never meet (the live one meets the
    Lighthouse, the plain one torch's rendezvous), so the second to come is refused in one line, exit 2, saying
    what to add or drop; the job that runs goes on with the same processes. Once it has ended, the other mode
    may go on with the run."""
    port = free_port()
    rendezvous(procs, port)
    job = ["--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=0", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=mixed"]
    snap = tmp_path / "mixed"
    node = lambda name, *live: procs.start(torchrun(*live, *job) + overrides(tmp_path, "mixed", ENDLESS_STEPS), name)
    for first, second in ((("--no-live",), ("--live",)), (("--live",), ("--no-live",))):
        before = max(ledger(snap), default=0)
        running = node("running", *first)
        wait_for(lambda: max(ledger(snap), default=0) >= before + 3, 120, "training", [running])
        trainer = worker(running.pid, local_rank=0)
        refused = node("refused", *second)
        assert refused.wait(timeout=120) == 2, output(refused)
        mode, start = ("live", "with --live") if first == ("--live",) else ("restart", "with --no-live")
        assert f"job mixed runs in the {mode} mode ({snap} is held by it on host" in output(refused)
        assert f"start this node {start}, or stop that job first" in output(refused)
        reached = max(ledger(snap))
        wait_for(lambda: max(ledger(snap)) > reached + 3, 120, "training on", [running])
        assert worker(running.pid, local_rank=0) == trainer
        stop(running)  # its snapshot written, its claim released: the other mode may go on with the run
    assert "Traceback" not in "".join(output(proc) for proc in procs.started if hasattr(proc, "log_path"))


def test_live_needs_mingpt_rendezvous_and_says_so(tmp_path):
    """A store that serves no Lighthouse (torchrun's own, or another job's agent): one line, exit 2, before
    any worker starts."""
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    result = subprocess.run([str(BIN / "mingpt-torchrun"), "--live", "--nnodes=1:2", "--nproc-per-node=1",
                             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=x", MAIN,
                             f"data.prepared_dir={tmp_path / 'prepared'}", f"snapshot.dir={tmp_path / 'snap'}"],
                            env=env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    del store
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: --live: the rendezvous store at 127.0.0.1:{port} serves no Lighthouse; start it with "
        f"mingpt-rendezvous --port {port}, which serves both")
    assert not (tmp_path / "snap").exists()


def test_a_node_that_cannot_reach_the_lighthouse_says_so_and_never_runs_another_mode(tmp_path, closed_port):
    """Without --live too: a store that publishes a Lighthouse makes the job live, so a node that cannot join it
    (here the Lighthouse does not answer) stops in one line, exit 2, rather than train in the restart mode."""
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    store.set(LIGHTHOUSE_KEY, str(closed_port))
    result = subprocess.run([str(BIN / "mingpt-torchrun"), "--nnodes=1:2", "--nproc-per-node=1",
                             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=x", MAIN,
                             f"data.prepared_dir={tmp_path / 'prepared'}", f"snapshot.dir={tmp_path / 'snap'}"],
                            env=env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    del store
    assert result.returncode == 2, result.stderr
    assert f"mingpt-torchrun: live mode (mingpt-rendezvous at 127.0.0.1:{port} serves" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: this node cannot join live job x: ") and "Connection refused" in last and \
        last.endswith("; fix it, or start every node of the job with --no-live (the restart mode)"), result.stderr
    assert not (tmp_path / "snap").exists()
