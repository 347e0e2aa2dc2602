"""Launching as users type it: mingpt-torchrun, plain torchrun's store sharing, mingpt-rendezvous.

The elastic scenarios under mingpt-torchrun (nodes dying and joining, with and without
mingpt-rendezvous) are in test_trainer.py.
"""

import contextlib
import json
import logging
import os
import re
import signal
import socket
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from launch import (BIN, HEAVIER, RDZV_CONF, REPO, SMALL, free_port, free_port_and_next, latest_step, manifests, output,
                    plain_torchrun, port_listens, rendezvous, run, slow_corpus, torchrun, wait_for)

from mingpt import jobenv
from mingpt.data.prepare import PrepareConfig, prepare
from mingpt.errors import ConfigError
from mingpt.jobenv import JobEnv
from mingpt.launch import node as launch_node
from mingpt.launch.node import QUICK_RENDEZVOUS, merge_rendezvous_conf
from mingpt.training import distributed

ADVICE = "launch with mingpt-torchrun (same arguments), or export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def test_quick_rendezvous_settings_fill_in_under_the_users_own():
    merged = dict(item.split("=") for item in merge_rendezvous_conf(" last_call_timeout=1, is_host=false").split(","))
    assert merged == {**QUICK_RENDEZVOUS, "last_call_timeout": "1", "is_host": "false"}
    assert merge_rendezvous_conf("") == ",".join(f"{k}={v}" for k, v in QUICK_RENDEZVOUS.items())


def test_nccls_watch_is_set_under_torchs_current_names_and_the_users_own_values_win_under_either_name():
    environ = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "60"}
    launch_node.watch_nccl(environ)
    assert environ["TORCH_FR_BUFFER_SIZE"] == "2000" and environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "60"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in environ  # the former name, at which torch warns in every process
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "10"}
    launch_node.watch_nccl(environ)
    assert "TORCH_FR_BUFFER_SIZE" not in environ  # it would override the user's 10


@pytest.fixture
def shared_store(monkeypatch):
    """The environment torchrun gives workers while its agents share their store."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("PET_NNODES", raising=False)
    return monkeypatch


def test_store_sharing_over_several_agents_is_refused(shared_store):
    shared_store.setenv("GROUP_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="mingpt-torchrun"):
        distributed.check_store_sharing(JobEnv.from_environ())


def test_store_sharing_is_refused_where_more_nodes_may_join(shared_store):
    shared_store.setenv("GROUP_WORLD_SIZE", "1")
    shared_store.setenv("PET_NNODES", "1:4")  # torchrun's --nnodes, given as a variable
    with pytest.raises(ConfigError, match="up to 4"):
        distributed.check_store_sharing(JobEnv.from_environ())


def test_the_agents_node_count_is_read_as_torchruns_argparse_reads_it():
    agent = ["python3", "/venv/bin/torchrun"]
    assert jobenv.max_nodes([*agent, "--nnodes=1:2", "train/main.py"]) == 2
    assert jobenv.max_nodes([*agent, "--nnode=1:3", "train/main.py"]) == 3  # an abbreviation it accepts
    assert jobenv.max_nodes([*agent, "--nn", "4", "train/main.py"]) == 4
    assert jobenv.max_nodes([*agent, "--node-rank=5", "train/main.py"]) == 1  # not --nnodes
    assert jobenv.max_nodes([*agent, "train/main.py"], nnodes="1:4") == 4  # PET_NNODES
    assert jobenv.max_nodes([*agent, "--nnodes=a:b", "train/main.py"]) == 1


def test_store_sharing_on_one_agent_is_a_warning(shared_store, caplog):
    shared_store.setenv("GROUP_WORLD_SIZE", "1")
    with caplog.at_level(logging.WARNING):
        distributed.check_store_sharing(JobEnv.from_environ())
    assert ADVICE in caplog.text
    caplog.clear()
    shared_store.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what mingpt-torchrun's agents say
    distributed.check_store_sharing(JobEnv.from_environ())
    assert caplog.text == ""


def _job(tmp_path, steps):
    return [*SMALL, f"trainer.max_steps={steps}", f"snapshot.dir={tmp_path / 'snap'}",
            f"data.prepared_dir={tmp_path / 'prepared'}"]


def test_plain_torchrun_on_two_agents_stops_at_once_with_one_line(tmp_path, procs):
    port = free_port()
    agent = plain_torchrun(tmp_path / "logs", "--nnodes=1:4", "--nproc-per-node=1", "--max-restarts=0",
                           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=shared-store",
                           f"--rdzv-conf={RDZV_CONF}")
    nodes = [procs.start(agent + _job(tmp_path, 1000), f"node-{i}") for i in range(2)]
    advice = []
    for node in nodes:
        assert node.wait(timeout=120) != 0
        lines = [line for line in output(node).splitlines() if ADVICE in line]
        assert len(lines) <= 1 and all("ERROR" in line for line in lines), output(node)[-3000:]
        advice += lines
    # The node whose agent hosts the store says it once; the other says it too, unless that agent stopped
    # first and took the store with it before the other's worker started (seen under load).
    assert advice, [output(node)[-3000:] for node in nodes]
    assert not (tmp_path / "snap").exists()  # stopped before claiming the run or any data work


def test_rendezvous_store_refuses_a_taken_port_serves_on_after_sigterm_and_stops_on_sigint(procs):
    """SIGTERM, which Slurm sends every process of a job at its end: the store serves on while the nodes save
    their step (train/slurm.sbatch stops it with SIGINT once they are done)."""
    port = free_port()
    store = rendezvous(procs, port)
    assert "--rdzv-endpoint=" in output(store)
    second = procs.start([*store.args[:1], f"--port={port}"], "second-store")
    assert second.wait(timeout=60) == 2
    assert output(second).strip().startswith(f"error: cannot listen on port {port}")
    assert len(output(second).strip().splitlines()) == 1
    store.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM: serving" in output(store), 30, "the store's answer to SIGTERM", [store])
    TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)).set("still", "serving")
    store.send_signal(signal.SIGINT)
    assert store.wait(timeout=30) == 0
    assert output(store).rstrip().endswith("stopped: agents still running lose their rendezvous")


@contextlib.contextmanager
def taken_port_after_a_free_one():
    """(port, below): a port this test holds, listening, and the port below it, held too (bound, not listening) until
    the test closes it for the store: a port that is merely not listening may be another connection's."""
    for _ in range(50):
        with socket.socket() as below, socket.socket() as taken:
            below.bind(("0.0.0.0", 0))
            port = below.getsockname()[1] + 1
            try:
                taken.bind(("0.0.0.0", port))
            except OSError:
                continue
            taken.listen()
            yield port, below
            return
    raise AssertionError("no two free ports in a row")


def test_a_taken_lighthouse_port_is_refused_where_it_was_asked_for_and_passed_over_where_it_was_not(procs):
    """The Lighthouse serves live jobs only: where its default port (--port + 1) is taken, the store is served
    alone, with a warning; a --lighthouse-port given and taken is one line and exit 2."""
    with taken_port_after_a_free_one() as (port, below):
        asked = procs.start([str(BIN / "mingpt-rendezvous"), f"--port={free_port()}", f"--lighthouse-port={port}"],
                            "asked")
        assert asked.wait(timeout=60) == 2
        assert output(asked).strip() == (f"error: cannot start the Lighthouse of live jobs on port {port} (Address "
                                         "already in use (os error 98)): choose another port with --lighthouse-port")
        below.close()  # for the store
        alone = procs.start([str(BIN / "mingpt-rendezvous"), f"--port={port - 1}"], "alone")
        wait_for(lambda: "listening" in output(alone), 60, "the store", [alone])
    assert "serving the store alone (mingpt-torchrun --live will refuse it)" in output(alone)
    alone.send_signal(signal.SIGTERM)
    assert alone.wait(timeout=30) == 0


def test_a_node_that_comes_after_the_job_finished_says_so_and_exits_0(tmp_path, procs):
    """The job's last node closes its rendezvous as it finishes; a node started afterwards (a scheduler's
    replacement, late) finds it closed: one line, exit 0, no worker started."""
    port = free_port()
    rendezvous(procs, port)
    node = torchrun("--no-live", "--nnodes=1:4", "--nproc-per-node=1", "--max-restarts=0", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=done-job", f"--rdzv-conf={RDZV_CONF},is_host=false")
    first = run(procs, node, _job(tmp_path, 4), "first")
    assert "done: step 4" in first and "--shutdown-timeout=110" in first  # mingpt-torchrun's window (torch: 30 s)
    late = run(procs, node, _job(tmp_path, 4), "late", timeout=120)
    assert "mingpt-torchrun: job done-job has finished (its rendezvous is closed)" in late
    assert "starting its workers" not in late and "Traceback" not in late


@pytest.mark.multiproc
@pytest.mark.slow
def test_workers_train_on_when_the_rendezvous_store_stops_and_the_agent_says_so_once(tmp_path, procs):
    """The store holds no training state: the running workers go on to the end without it (a restart or a
    change of membership would need it back), and the agent says once that it does not answer."""
    port = free_port()
    store = rendezvous(procs, port)
    node = torchrun("--no-live", "--nnodes=1:4", "--nproc-per-node=1", "--max-restarts=0", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=storeless", f"--rdzv-conf={RDZV_CONF},is_host=false")
    # Steps of tens of milliseconds: the store's stop (a second, on a busy machine) ends long before the job.
    job = procs.start(node + _job(tmp_path, 50) + [*HEAVIER, "snapshot.every=10"], "job")
    wait_for(lambda: latest_step(tmp_path / "snap") >= 10, 120, "the first snapshot", [job])
    store.send_signal(signal.SIGINT)
    store.wait(timeout=30)
    stopped_at = latest_step(tmp_path / "snap")
    assert job.wait(timeout=180) == 0, output(job)[-3000:]
    assert latest_step(tmp_path / "snap") == 50 > stopped_at  # snapshots committed after the store was gone
    assert output(job).count("the rendezvous store does not answer") == 1


def test_the_slurm_script_trains_on_two_nodes_around_its_own_store(tmp_path, procs):
    """train/slurm.sbatch as sbatch runs it, with stand-ins for SLURM's two commands: `scontrol`
    names this machine as the first node, `srun` starts the agent line once per node here. Its store is
    mingpt-rendezvous's, so the job runs in the live mode."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (shims / "srun").write_text('#!/bin/bash\nshift 2  # --kill-on-bad-exit=0 --no-kill\nfor node in $(seq "$SLURM_NNODES"); do '
                                '"$@" & done\nwait\n')
    for shim in shims.iterdir():
        shim.chmod(0o755)
    port = free_port_and_next()  # and its Lighthouse on the next
    job = procs.start(
        ["env", f"PATH={shims}:{BIN}:{os.environ['PATH']}", "SLURM_JOB_NODELIST=node[1-2]", "SLURM_NNODES=2",
         "SLURM_JOB_ID=4242", f"RDZV_PORT={port}", "NPROC_PER_NODE=1",
         "bash", str(REPO / "train" / "slurm.sbatch"), *_job(tmp_path, 6), "snapshot.every=3"],
        "sbatch", cwd=REPO)
    assert job.wait(timeout=240) == 0, output(job)[-4000:]
    assert manifests(tmp_path / "snap")[-1]["step"] == 6
    assert "rendezvous store listening on port" in output(job) and "--shutdown-timeout=110" in output(job)
    assert output(job).count(f"mingpt-torchrun: live mode (mingpt-rendezvous at 127.0.0.1:{port} serves") == 2
    assert not port_listens(port)  # the script stopped its store on the way out


def test_the_slurm_scripts_notice_is_its_signal_lines():
    """The notice the workers' window is cut from is the --signal line's: Slurm does not tell the job."""
    text = (REPO / "train" / "slurm.sbatch").read_text()
    signal_line = re.search(r"^#SBATCH --signal=TERM@(\d+)$", text, re.MULTILINE)
    assert signal_line and f"notice=${{STOP_NOTICE_S:-{signal_line[1]}}}" in text


@pytest.mark.slow
def test_plain_torchrun_standalone_warns_once_and_trains_and_waits_for_a_peer_still_preparing(tmp_path, procs):
    """Plain torchrun --standalone: its agent shares its store with the workers, which one of them warns
    about, once; the job trains to the end.

    Under plain torchrun each worker prepares its own data before the process group forms. Here rank 1
    has a folder of its own to prepare (a node with an empty disk) while rank 0's is ready, and
    trainer.dist_timeout_s is 2 s: rank 0 used to give up in init_process_group. Now rank 1 says it is
    preparing, rank 0 waits for it as long as that takes, and says whom it waits for."""
    corpus = slow_corpus(tmp_path / "records.jsonl.gz", megabytes=6)  # seconds of preparing on this class of machine
    for_rank = lambda rank: tmp_path / f"prepared-{rank}"
    prepare(PrepareConfig(corpus=str(corpus), prepared_dir=for_rank(0)))
    overrides = [*SMALL, f"data.corpus={corpus}", "data.num_workers=1", "trainer.dist_timeout_s=2",
                 "trainer.max_steps=4", f"snapshot.dir={tmp_path / 'snap'}",
                 f"data.prepared_dir={tmp_path}/prepared-${{oc.env:LOCAL_RANK}}"]  # a folder per rank
    job = procs.start(plain_torchrun(tmp_path / "logs", "--standalone", "--nproc-per-node=2") + overrides, "job")
    assert job.wait(timeout=180) == 0, output(job)[-3000:]
    text = output(job)
    assert text.count(ADVICE) == 1 and "done: step 4" in text and (for_rank(1) / "meta.json").exists()
    assert re.search(r"waiting for 1 process\(es\) to prepare their data: rank 1 on \S+", text), text[-3000:]


@pytest.mark.slow
def test_a_node_with_other_data_is_refused_and_the_job_trains_on_without_it(tmp_path, procs):
    """A node started with another corpus of the same characters (the same vocabulary, other tokens) comes
    to a running job: its workers are refused in one line naming both fingerprints, and the job goes on,
    on its own data only."""
    port = free_port()
    rendezvous(procs, port)
    node = torchrun("--no-live", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=0", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=other-data", f"--rdzv-conf={RDZV_CONF},is_host=false")
    corpora = {name: tmp_path / f"{name}.txt" for name in ("one", "two")}
    corpora["one"].write_text("abcdefgh " * 400)
    corpora["two"].write_text("hgfedcba " * 400)

    def data(name):
        return [f"data.corpus={corpora[name]}", f"data.prepared_dir={tmp_path / name}"]

    job = procs.start(node + _job(tmp_path, 100_000) + data("one") + ["snapshot.every=10"], "job")
    wait_for(lambda: latest_step(tmp_path / "snap") >= 10, 120, "the first snapshot", [job])
    other = procs.start(node + _job(tmp_path, 100_000) + data("two") + ["snapshot.every=10"], "other")
    assert other.wait(timeout=180) == 2
    refused = [line for line in output(other).splitlines() if "is not the job's" in line]
    ours = json.loads((tmp_path / "one" / "meta.json").read_text())["fingerprint"]
    theirs = json.loads((tmp_path / "two" / "meta.json").read_text())["fingerprint"]
    assert refused and f"fingerprint {theirs[:12]}" in refused[0] and f"fingerprint {ours[:12]}" in refused[0]
    assert "failed (exitcode: 2)" in output(other) and "Traceback" not in output(other)  # the worker's line,
    assert output(other).rstrip().endswith("(exit 2): their line above says what")  # then its agent's
    after = latest_step(tmp_path / "snap")
    wait_for(lambda: latest_step(tmp_path / "snap") >= after + 10, 120, "snapshots after the refusal", [job])
    job.send_signal(signal.SIGTERM)
    job.wait(timeout=90)
    assert "train on other data" in output(job)
    assert {m["data_fingerprint"] for m in manifests(tmp_path / "snap")} == {ours}
    assert {m["world_size"] for m in manifests(tmp_path / "snap")} == {1}
