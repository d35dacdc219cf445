"""Many-node launches on one machine (CPU, gloo): two torchrun "nodes" of two ranks each meeting
at a localhost c10d rendezvous train exactly as the local launcher does; four processes with a
faked srun environment (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, a node list, a job id) too;
a rank failing on one node ends every rank with its message; a node killed (its torchrun's
process group, SIGKILL) ends the other node's ranks within seconds, saying so. Every process
runs under a deadline, and whatever a test started is killed at its end.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mimo.core.errors import ConfigError
from mimo.training.cluster import ClusterRank, detect, first_host, one_line
from mimo.training.train import FAULT_ENV, TORCHRUN_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find a node's processes")

STEPS = 3


@pytest.fixture(scope="module")
def config(tmp_path_factory, write_demo_config) -> str:
    """The demo's 4 ranks (vision dp 4, LLM tp 2 x dp 2 with sequence parallelism), short steps."""
    def edit(cfg):
        cfg["data"]["tokens_per_microbatch"] = 512
        cfg["train"].update(steps=STEPS, micro_batches=1, checkpoint={"dir": cfg["train"]["checkpoint"]["dir"], "every": None})
        cfg.pop("eval")

    return write_demo_config(tmp_path_factory.mktemp("multinode"), 3, edit)


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, *TORCHRUN_ENV) and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _free_port(low: int = 0, high: int = 0) -> int:
    """A port nothing listens on now (any, or one in [low, high))."""
    for _ in range(200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", random.randrange(low, high) if high else 0))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


def _train_command(config: str, run: Path, *args: str) -> list[str]:
    return ["-m", "mimo", "train", config, f"train.checkpoint.dir={run / 'ckpt'}", *args]


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in map(int, f.read().split()):
                    out += [child, *_descendants(child)]
    except OSError:
        pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Nodes:
    """Processes standing for nodes, each in a session of its own (stdout / stderr in files);
    ``finish`` waits for them under a deadline and kills what is left of them either way."""

    def __init__(self, root: Path):
        self.root, self.procs, self.seen = root, [], set()

    def start(self, argv: list[str], env: dict) -> subprocess.Popen:
        n = len(self.procs)
        with open(self.root / f"node{n}.out", "w") as out, open(self.root / f"node{n}.err", "w") as err:
            proc = subprocess.Popen([sys.executable, *argv], stdout=out, stderr=err, env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def note_children(self) -> None:
        for p in self.procs:
            self.seen.update(_descendants(p.pid))

    def finish(self, timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        try:
            for p in self.procs:
                while p.poll() is None:
                    self.note_children()
                    if time.monotonic() > deadline:
                        pytest.fail(f"node {self.procs.index(p)} did not end within {timeout_s:g} s: {self.output()}")
                    time.sleep(0.2)
            return [p.returncode for p in self.procs]
        finally:
            self.kill()

    def kill(self) -> None:
        self.note_children()
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for pid in self.seen:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    def output(self, n: int | None = None, stream: str = "out") -> str:
        nodes = range(len(self.procs)) if n is None else [n]
        return "\n".join((self.root / f"node{i}.{stream}").read_text() for i in nodes)

    def results(self, n: int | None = None) -> list[dict]:
        """The JSON object every rank printed last (each rank's stdout goes to its node's)."""
        return [json.loads(line) for line in self.output(n).splitlines() if line.startswith("{")]


def _two_torchrun_nodes(root: Path, config: str, run: Path, *args: str, env: dict, tries: int = 2) -> Nodes:
    """``torchrun --nnodes 2 --node-rank 0/1 --nproc-per-node 2`` at a localhost c10d rendezvous,
    node 0 first, returned once the ranks are up; a fresh port and another try when the rendezvous
    itself failed (its port taken between picking and binding)."""
    for attempt in range(tries):
        nodes = Nodes(root / f"try{attempt}")
        nodes.root.mkdir(parents=True)
        port = _free_port()
        for n in (0, 1):
            nodes.start(["-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "2",
                         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--max-restarts", "0",
                         *_train_command(config, run, *args)], env)
            time.sleep(0.3)
        deadline = time.monotonic() + 90
        while True:
            ended = all(p.poll() is not None for p in nodes.procs)
            if "ranks up" in nodes.output(stream="err"):  # rank 0's first line after the process group started
                return nodes
            if ended or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        nodes.kill()
    pytest.fail(f"the rendezvous failed {tries} times: {nodes.output(stream='err')[-3000:]}")


def _losses(run: Path) -> list[tuple[float, float]]:
    with open(run / "metrics.jsonl") as f:
        return [(m["loss"], m["grad_norm"]) for m in map(json.loads, f)]


@pytest.fixture(scope="module")
def single(config, tmp_path_factory) -> Path:
    """The local launcher's run (one `mimo train` starting the 4 ranks itself): the reference."""
    run = tmp_path_factory.mktemp("single")
    proc = subprocess.run([sys.executable, *_train_command(config, run)], capture_output=True, text=True, timeout=180, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_losses(run)) == STEPS
    return run


def test_two_torchrun_nodes_train_as_the_local_launcher(config, single, tmp_path):
    run = tmp_path / "run"
    nodes = _two_torchrun_nodes(tmp_path, config, run, env=_env())
    codes = nodes.finish(timeout_s=150)
    assert codes == [0, 0], nodes.output(stream="err")[-3000:]
    results = nodes.results()
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert {r["final_loss"] for r in results} == {_losses(single)[-1][0]}
    assert _losses(run) == _losses(single)  # every step's loss and grad norm, exactly


def test_srun_environment_trains_as_the_local_launcher(config, single, tmp_path):
    """Four tasks as `srun -N 2 --ntasks-per-node 2 mimo train ...` starts them: no MASTER_* set,
    the address from the step's node list, the port from the job id."""
    run = tmp_path / "run"
    port = _free_port(15000, 35000)
    nodes = Nodes(tmp_path)
    for task in range(4):
        nodes.start(_train_command(config, run), _env(SLURM_PROCID=str(task), SLURM_NTASKS="4", SLURM_LOCALID=str(task % 2),
                                                      SLURM_NODEID=str(task // 2), SLURM_STEP_NODELIST="127.0.0.[1-2]",
                                                      SLURM_JOB_ID=str(20000 + port - 15000)))
    codes = nodes.finish(timeout_s=150)
    assert codes == [0] * 4, nodes.output(stream="err")[-3000:]
    assert sorted(r["rank"] for r in nodes.results()) == [0, 1, 2, 3]
    assert _losses(run) == _losses(single)


def test_a_failing_rank_ends_every_rank_of_both_nodes_with_its_message(config, tmp_path):
    t0 = time.monotonic()
    nodes = _two_torchrun_nodes(tmp_path, config, tmp_path / "run", env=_env(**{FAULT_ENV: "raise:3:2"}))
    codes = nodes.finish(timeout_s=150)
    assert all(code != 0 for code in codes)
    results = nodes.results()
    assert len(results) == 4 and not any(r["ok"] for r in results), nodes.output(stream="err")[-3000:]
    messages = {m for r in results for m in r["errors"]}
    (message,) = messages  # every rank, on both nodes, ends with the failing rank's message
    assert message.startswith("rank 3 on ") and "RuntimeError: injected failure" in message and "at step 2" in message
    assert "rank3.log" in message
    assert time.monotonic() - t0 < 150


def test_a_killed_node_ends_the_other_nodes_ranks_with_the_cause(config, tmp_path):
    """Rank 3 stops responding at step 2 (so the kill lands mid-step), then the node holding it
    is killed: its torchrun's process group with SIGKILL. Its ranks end with their agent; the
    other node's end within seconds (not at the 60 s collective timeout), naming the cause."""
    run = tmp_path / "run"
    nodes = _two_torchrun_nodes(tmp_path, config, run, "--timeout", "60", env=_env(**{FAULT_ENV: "hang:3:2"}))
    log = run / "logs" / "rank3.log"
    deadline = time.monotonic() + 120
    while not (log.exists() and "not responding" in log.read_text()):
        if time.monotonic() > deadline or any(p.poll() is not None for p in nodes.procs):
            nodes.kill()
            break
        time.sleep(0.2)
    assert log.exists() and "not responding" in log.read_text(), nodes.output(stream="err")[-3000:]
    # c10d's rendezvous numbers the ranks in joining order: find the node that holds rank 3
    victim = next(n for n, p in enumerate(nodes.procs) if any(_rank_of(pid) == 3 for pid in _descendants(p.pid)))
    workers = _descendants(nodes.procs[victim].pid)
    nodes.note_children()
    os.killpg(nodes.procs[victim].pid, signal.SIGKILL)
    t0 = time.monotonic()
    survivor = nodes.procs[1 - victim]
    while survivor.poll() is None and time.monotonic() - t0 < 45:
        time.sleep(0.2)
    ended_s = time.monotonic() - t0
    leftover = [pid for pid in workers if _alive(pid)]
    codes = nodes.finish(timeout_s=10)
    assert ended_s < 45, f"the surviving node did not end within 45 s of the kill: {nodes.output(1 - victim, 'err')[-3000:]}"
    assert not leftover, "the killed node's ranks outlived their torchrun"
    assert codes[1 - victim] != 0
    results = nodes.results(1 - victim)
    assert len(results) == 2 and not any(r["ok"] for r in results), nodes.output(1 - victim, "err")[-3000:]
    for r in results:
        (message,) = r["errors"]
        # a peer that vanished, or (when that node held the rendezvous store) the store that did
        assert "another rank ended without a message" in message or "stopped answering" in message, message
        assert "node" in message


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return int(env[b"RANK"]) if b"RANK" in env else None
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- without processes


def test_torchrun_and_srun_environments_map_to_ranks():
    assert detect({}) is None
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert detect(torchrun) == ClusterRank("torchrun", 5, 8, 1, "node0", 29500)
    srun = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_JOB_NODELIST": "gpu[007-008],gpu12",
            "SLURM_JOB_ID": "123456"}
    assert detect(srun) == ClusterRank("srun", 6, 8, 2, "gpu007", 15000 + 123456 % 20000)
    # the step's node list before the job's; MASTER_ADDR / MASTER_PORT before both
    assert detect({**srun, "SLURM_STEP_NODELIST": "gpu[011-012]"}).master_addr == "gpu011"
    place = detect({**srun, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000"})
    assert (place.master_addr, place.master_port) == ("10.0.0.1", 4000)
    # torchrun inside an allocation wins over SLURM's variables
    assert detect({**srun, **torchrun}).launcher == "torchrun"
    # one task (a batch script, `srun -n 1`): mimo train starts the config's ranks itself
    assert detect({**srun, "SLURM_NTASKS": "1"}) is None
    env = {}
    place.export(env)
    assert env == {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000"}


@pytest.mark.parametrize("env, says", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, "not MASTER_PORT"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK='x': expected an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "not a TCP port"),
    ({"SLURM_PROCID": "0"}, "SLURM_NTASKS is not"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "SLURM_NODELIST": "n1"}, "SLURM_LOCALID"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7"}, "MASTER_ADDR (or SLURM_STEP_NODELIST"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODELIST": "n1"}, "MASTER_PORT (or SLURM_JOB_ID)"),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "MASTER_ADDR": "h", "MASTER_PORT": "9"}, "SLURM_PROCID=3 is not below"),
])
def test_a_half_set_launch_environment_is_a_clear_error(env, says):
    with pytest.raises(ConfigError) as e:
        detect(env)
    assert says in str(e.value)


def test_slurm_host_lists_and_backend_messages():
    assert first_host("node[007-012,20],login1") == "node007"
    assert first_host("rack[1-2]-gpu[3-4]") == "rack1-gpu3"
    assert first_host("login1,node[1-4]") == "login1"
    assert first_host("n[3]") == "n3"
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                        "[127.0.0.1]:9962. This is typically caused by a remote worker crashing. GLHF!")
    assert one_line(gloo) == "RuntimeError: Connection closed by peer [127.0.0.1]:9962"


def test_srun_tasks_other_than_the_config_asks_is_an_error_before_anything_starts(config, monkeypatch, capsys):
    from mimo.commands.cli import main

    for key in (*TORCHRUN_ENV, FAULT_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODELIST": "n1",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    assert main(["train", config]) == 2
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["errors"] == ["world_size: the config asks for 4 ranks, srun started (SLURM_NTASKS) 2"]
    monkeypatch.delenv("SLURM_LOCALID")
    assert main(["train", config]) == 2
    assert "SLURM_LOCALID" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["errors"][0]


def test_failure_notice_first_post_wins_and_the_watchdog_ends_a_rank_it_did_not_reach():
    from datetime import timedelta

    from torch.distributed import TCPStore

    from mimo.training.cluster import FailureNotice

    port = _free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    place = ClusterRank("srun", 1, 4, 1, "127.0.0.1", port)
    ended: list[str] = []
    notices = [FailureNotice(place, ended.append, poll_s=0.05, grace_s=0.3, timeout_s=5) for _ in range(3)]
    watched, closed, failing = notices
    watched.start()
    closed.start()
    assert failing.posted() is None
    assert failing.post("rank 3 failed: boom") == "rank 3 failed: boom" and failing.mine
    assert watched.post("rank 1: lost a peer") == "rank 3 failed: boom" and not watched.mine  # the first post wins
    closed.close()  # this rank ended by itself within the grace period
    deadline = time.monotonic() + 10
    while not ended and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended == ["rank 3 failed: boom"]  # once, by the watchdog of the rank that ended on nothing of its own

    ended.clear()
    lost = FailureNotice(ClusterRank("srun", 2, 4, 0, "127.0.0.1", port), ended.append, poll_s=0.05, grace_s=0.1, timeout_s=5)
    lost.store.delete_key(lost.key)
    lost.start()
    del server  # the node holding the store is gone
    deadline = time.monotonic() + 10
    while not ended and time.monotonic() < deadline:
        time.sleep(0.05)
    for n in (*notices, lost):
        n.close()
    assert len(ended) == 1 and "stopped answering" in ended[0] and "rank 0" in ended[0], ended
