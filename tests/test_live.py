"""The live mode (mingpt-torchrun --live, on torchft): nodes die, leave and join while the others keep their
processes. Real mingpt-torchrun nodes around a real mingpt-rendezvous (store and Lighthouse) on 127.0.0.1;
unit tests of the healing transport over real HTTP."""

import shutil
import signal
import subprocess
import threading
import urllib.request
from datetime import timedelta

import pytest
import torch

from launch import (BIN, ENDLESS_STEPS, HEAVIER, KEEP_ALL, MAIN, assert_equal_weights, env, free_port, kill_node,
                    latest_step, metrics, output, overrides, rendezvous, torchrun, wait_for, weights, worker)
from mingpt.training.healing import HealingError, VerifiedTransport, decode, encode



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
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"{source.metadata()}3", timeout=10)
    finally:
        source.shutdown()
        healer.shutdown()


# -- whole jobs ------------------------------------------------------------------------------------------------


def live_node(procs, tmp_path, port, name, nnodes="2:4"):
    """A node of the live job `live` (one worker), with a memory tier of its own."""
    (tmp_path / name).mkdir(exist_ok=True)
    args = torchrun("--live", f"--nnodes={nnodes}", "--nproc-per-node=1", "--max-restarts=0", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=live")
    args += overrides(tmp_path, "live", ENDLESS_STEPS, extra=[*HEAVIER, *KEEP_ALL, "snapshot.memory_every=1",
                                                                f"snapshot.memory_dir={tmp_path / name}"])
    return procs.start(args, name)


def ledger(snap) -> dict[int, set[str]]:
    """step -> the digests of its samples, as metrics.jsonl records them."""
    found: dict[int, set[str]] = {}
    for record in metrics(snap):
        if "samples" in record:
            found.setdefault(record["step"], set()).add(record["samples"])
    return found


@pytest.mark.slow
def test_a_node_dies_another_joins_and_the_survivor_never_restarts(tmp_path, procs, reference):
    """Two live nodes, --nnodes=2:4, so that no step is committed by fewer than two. The writer's node is
    SIGKILLed between snapshots and its memory goes with it; the survivor's step in flight fails and is
    done again once a new node, which finds an older snapshot, has healed from it. The survivor's worker
    is the same process from start to end, it writes the snapshots from then on, every step's samples
    are in the ledger and are those of an uninterrupted run, and the weights are bitwise those of an
    uninterrupted two-process run."""
    port = free_port()
    rendezvous(procs, port)
    first = live_node(procs, tmp_path, port, "node-a")
    wait_for(lambda: "live mode" in output(first), 60, "the first node", [first])
    second = live_node(procs, tmp_path, port, "node-b")
    snap = tmp_path / "live"
    between_snapshots = lambda: max(ledger(snap), default=0) >= 20 and 3 <= max(ledger(snap)) % 10 <= 6
    wait_for(between_snapshots, 120, "a step between two snapshots", [first, second])
    writer, survivor = (first, second) if "this job holds" in output(first) else (second, first)
    survivor_worker = worker(survivor.pid, local_rank=0)

    kill_node(writer)
    writer.wait(timeout=30)
    shutil.rmtree(tmp_path / ("node-a" if writer is first else "node-b"))  # its memory goes with the machine
    killed_at = max(ledger(snap))
    newcomer = live_node(procs, tmp_path, port, "node-c")
    wait_for(lambda: "healed from a live peer" in output(newcomer), 120, "the newcomer's heal", [survivor, newcomer])
    compared = (killed_at // 10 + 3) * 10
    wait_for(lambda: latest_step(snap) >= compared, 120, f"the step-{compared} snapshot", [survivor, newcomer])
    assert worker(survivor.pid, local_rank=0) == survivor_worker  # the same process throughout
    for node in (survivor, newcomer):
        node.send_signal(signal.SIGTERM)
    for node in (survivor, newcomer):
        node.wait(timeout=90)
    assert "Traceback" not in output(survivor).split("stopped at step")[0], output(survivor)[-3000:]
    assert "this job holds" in output(survivor) and "live: steps are committed again, by 2 group(s)" in \
        output(survivor)

    uninterrupted = reference.at(compared)
    seen, expected = ledger(snap), ledger(uninterrupted)
    assert [step for step in range(1, compared + 1) if seen.get(step) != expected[step]] == []
    assert_equal_weights(weights(uninterrupted, compared), weights(snap, compared))
    processes = [m["world_size"] for m in metrics(snap) if "world_size" in m and m["step"] > killed_at + 1]
    assert processes and set(processes) == {2}  # no step committed by one node alone


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
