"""Many-node launches: where this process sits in the run, and the run-wide failure notice.

Where. ``mimo train`` is one rank of a run started by another launcher when

- torchrun's variables are set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``; ``torchrun --nnodes N --nproc-per-node P`` sets them all), or
- it is one of several tasks of a SLURM job step (``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS`` > 1,
  ``SLURM_LOCALID``), mapped to RANK, WORLD_SIZE and LOCAL_RANK; ``MASTER_ADDR`` defaults to the
  first host of the step's node list (``SLURM_STEP_NODELIST``, ``SLURM_JOB_NODELIST`` or
  ``SLURM_NODELIST``: where task 0 runs) and ``MASTER_PORT`` to ``15000 + SLURM_JOB_ID % 20000``
  (one port per job; set either variable to choose).

A single SLURM task (``srun -n 1``, a batch script) is not a many-rank launch: ``mimo train``
starts the config's ranks itself, as on a workstation. A variable that is half there (RANK set
without MASTER_PORT, SLURM_PROCID without SLURM_NTASKS, ...) is a ``ConfigError`` naming it.

The failure notice. Under another launcher no parent sees every rank, so the first rank that
fails posts its message under one key of the rendezvous store (``FailureNotice.post``: the
first post wins) before its process ends. A rank whose collective then fails (the failed rank's
connections closed) or times out reads the notice and ends with that message; when nobody
posted one within a few seconds, the peer vanished without a word (its node died or was killed)
and the rank says so. A watchdog thread ends a rank that a posted failure did not reach through
its own collectives (stuck in NCCL, say) after a grace period, and a rank whose rendezvous store
stopped answering (the node holding it is gone). A torchrun worker ends with its agent
(``end_with_launcher``): killing a node's torchrun kills its ranks, as a node failing would.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping

from mimo.core.errors import ConfigError, DistributedError

log = logging.getLogger("mimo.training.cluster")

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
FAILURE_KEY = "mimo/failure"  # + "/<attempt>": torchrun's store outlives a restart (--max-restarts), the failure does not


@dataclass(frozen=True)
class ClusterRank:
    """This process's place in a run started by torchrun or srun."""

    launcher: str  # "torchrun" | "srun"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    def export(self, environ: dict | None = None) -> None:
        """torch's ``env://`` variables, so the process group (and anything reading LOCAL_RANK)
        sees one kind of launch."""
        environ = os.environ if environ is None else environ
        environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
                       MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} (local rank {self.local_rank}; {self.launcher}, rendezvous {self.master_addr}:{self.master_port})"


def detect(environ: Mapping[str, str] | None = None) -> ClusterRank | None:
    """This process's place when torchrun or a multi-task srun started it; None for a local launch."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        missing = [k for k in TORCHRUN_ENV if not env.get(k)]
        if missing:
            raise ConfigError(f"{' and '.join(k for k in ('RANK', 'WORLD_SIZE') if k in env)} set (a torchrun launch) but not "
                              f"{', '.join(missing)}: launch with torchrun (it sets them all), or unset RANK and WORLD_SIZE "
                              f"to let `mimo train` start the ranks itself")
        rank, world, local = (_int(env, k, 0) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        return _checked(ClusterRank("torchrun", rank, world, local, env["MASTER_ADDR"], _int(env, "MASTER_PORT", 1)), "RANK", "WORLD_SIZE")
    if "SLURM_PROCID" not in env:
        return None
    if not env.get("SLURM_NTASKS"):
        raise ConfigError("SLURM_PROCID is set but SLURM_NTASKS is not: start `mimo train` with srun (one task per rank), "
                          "or unset SLURM_PROCID")
    world = _int(env, "SLURM_NTASKS", 1)
    if world == 1:
        return None  # one task: mimo train starts the config's ranks itself
    missing = [k for k in ("SLURM_LOCALID",) if not env.get(k)]
    addr = env.get("MASTER_ADDR") or next((first_host(env[k]) for k in SLURM_NODELISTS if env.get(k)), None)
    if addr is None:
        missing.append(f"MASTER_ADDR (or {' / '.join(SLURM_NODELISTS)})")
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT", 1)
    elif env.get("SLURM_JOB_ID"):
        port = 15000 + _int(env, "SLURM_JOB_ID", 0) % 20000
    else:
        port = None
        missing.append("MASTER_PORT (or SLURM_JOB_ID)")
    if missing:
        raise ConfigError(f"srun started {world} tasks (SLURM_NTASKS) but {', '.join(missing)} is not set: "
                          f"set it in the job script (e.g. `export MASTER_PORT=29500`)")
    return _checked(ClusterRank("srun", _int(env, "SLURM_PROCID", 0), world, _int(env, "SLURM_LOCALID", 0), addr, port),
                    "SLURM_PROCID", "SLURM_NTASKS")


def _int(env: Mapping[str, str], key: str, least: int) -> int:
    try:
        value = int(env[key])
    except ValueError:
        raise ConfigError(f"{key}={env[key]!r}: expected an integer") from None
    if value < least:
        raise ConfigError(f"{key}={value}: must be at least {least}")
    return value


def _checked(place: ClusterRank, rank_key: str, world_key: str) -> ClusterRank:
    if place.rank >= place.world_size:
        raise ConfigError(f"{rank_key}={place.rank} is not below {world_key}={place.world_size}")
    if not 0 < place.master_port < 65536:
        raise ConfigError(f"MASTER_PORT={place.master_port}: not a TCP port (1..65535)")
    return place


def end_with_launcher(place: ClusterRank) -> None:
    """torchrun starts each worker in a session of its own, so a node's processes killed by
    process group would leave its workers running, unmanaged: a torchrun worker ends the moment
    its agent does (as a local launch's ranks do). srun's tasks end with their step already."""
    if place.launcher != "torchrun":
        return
    from mimo.training.launch import kill_with_parent

    agent = os.getppid()
    kill_with_parent()
    if os.getppid() != agent:  # the agent died before the kernel was told
        os._exit(1)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``node[007-012,20],login1`` -> ``node007``,
    ``rack[1-2]-gpu[3-4]`` -> ``rack1-gpu3`` (zero padding kept as written)."""
    head = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())
    if head is None:
        raise ConfigError(f"SLURM node list {nodelist!r}: no host in it")
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", head.group(0))


# ---------------------------------------------------------------- the failure notice


class FailureNotice:
    """The first failure of the run, posted in the rendezvous store (its own client connection,
    so a collective's store traffic never holds it up), and a watchdog that ends this rank when
    another rank's failure did not (see the module doc)."""

    def __init__(self, place: ClusterRank, on_abort: Callable[[str], None], poll_s: float = 1.0,
                 grace_s: float = 10.0, timeout_s: float = 60.0):
        from torch.distributed import TCPStore

        self.place = place
        self.on_abort = on_abort  # ends the process with the message; called from the watchdog thread
        self.poll_s, self.grace_s = poll_s, grace_s
        self.store = TCPStore(place.master_addr, place.master_port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
        self.key = f"{FAILURE_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.mine = False  # this rank's post is the one in force
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mimo-failure-watch", daemon=True)

    def start(self) -> "FailureNotice":
        self._thread.start()
        return self

    def close(self) -> None:
        """The rank is past its last collective (or ending by itself): the watchdog stops."""
        self._stop.set()

    def post(self, message: str) -> str:
        """Posts ``message`` unless a failure is posted already; the message in force (this
        one when the store is gone)."""
        try:
            now = self.store.compare_set(self.key, "", message).decode()
        except Exception:  # the store's node is gone: nobody else can read it either
            return message
        self.mine = now == message
        return now

    def posted(self, wait_s: float = 0.0) -> str | None:
        """The failure some rank posted, waiting up to ``wait_s`` for one; None: none (or no store)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self.store.check([self.key]):
                    return self.store.get(self.key).decode()
            except Exception:
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(0.2, self.poll_s))

    def _watch(self) -> None:
        unreachable = 0
        while not self._stop.wait(self.poll_s):
            try:
                found = self.store.check([self.key])
                unreachable = 0
            except Exception as e:
                unreachable += 1
                if unreachable < 3:
                    continue
                message = (f"rank {self.place.rank}: the rendezvous store at {self.place.master_addr}:{self.place.master_port} "
                           f"stopped answering ({one_line(e)}): the node "
                           f"holding it ({'the torchrun rendezvous host' if self.place.launcher == 'torchrun' else 'rank 0'}) "
                           f"failed or was killed")
            else:
                if not found or self.mine:
                    continue
                try:
                    message = self.store.get(self.key).decode()
                except Exception:
                    continue
            # this rank's own collectives usually end it with the message first; give them the grace period
            if self._stop.wait(self.grace_s):
                return
            self.on_abort(message)
            return


def one_line(error: BaseException) -> str:
    """An error in one line, without a backend's source location and advice:
    ``RuntimeError: Connection closed by peer [10.0.0.2]:4321``."""
    text = str(error).strip()
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else "").split(". This is typically")[0]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# the text of a failed collective: the peer's process ended (its connections closed), or it timed out
_COMMUNICATION = re.compile(r"connection|closed by peer|broken pipe|gloo|nccl|timed out|timeout|socket", re.I)


def is_communication_failure(error: BaseException) -> bool:
    """A collective (or the store) failed: the cause is on another rank."""
    import torch.distributed as dist

    if isinstance(error, DistributedError):  # a named timeout (mimo.training.train._name_timeouts)
        return True
    return isinstance(error, (dist.DistError, RuntimeError)) and bool(_COMMUNICATION.search(str(error)))
