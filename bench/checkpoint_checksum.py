"""What a checkpoint's checksums cost its save (issue 53): the same files written with and without them, in one run.

The files are the ones a world-1 save of a config's model writes (default configs/llava-1.3b.yaml:
CLIP ViT-L/14 and a 16-layer, 2048-wide LLM, weights in the config's precision: 2.5 GB in bf16;
``mimo.training.checkpoint._rank_files``, the save path's own grouping into files), the model
built on the meta device and every tensor filled with random values of its shape and dtype on
``--device`` (no optimizer state: its files are more bytes of the same kind, fp32, and cost per
byte the same). Each round saves them into a fresh folder as a synchronous save does (each
file's tensors copied to the host, ``_host_copy``, one file's copy at a time, written; all
fsynced at the end), two ways, each of them first and second in turn:

* ``save_file``: safetensors' ``save_file`` per file, what ``_write_files`` did before checksums;
* ``crc``: ``_write_files`` as a save runs it: ``save_file``, the crc32 of every tensor's bytes
  computed from memory on helper threads beside it, each file's header and size read back.

Also ``crc_alone``: the crc32 of every file's bytes in host memory on one thread, nothing written
nor copied (what the checksum would cost a save with no core free for it). Medians over
``--repeats`` rounds after a warm-up one. Reports ``checksum_cost`` = crc / save_file - 1 (the
target: under 0.03) of the medians, and ``paired_cost``: the median over rounds of each round's
crc / save_file - 1 (the two written one after the other: the disk's drift between rounds, often
10% and more, cancels). The folder (``--dir``, default a temporary one under /tmp; /dev/shm: no
disk, the checksum's worst case) must have room for one copy of the files. Prints one JSON line.

    python bench/checkpoint_checksum.py [--config configs/llava-1.3b.yaml] [--device cpu|cuda] [--repeats 6] [--dir DIR]
        [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def checkpoint_files(config_path: str, overrides: list[str], device: str) -> list:
    """The files (name, tensors, metadata) a world-1 save of the config's model writes, random values on ``device``."""
    from mimo.compose.config import load_config
    from mimo.compose.model import MimoModel
    from mimo.training.checkpoint import _rank_files
    from mimo.training.precision import PrecisionPolicy

    config = load_config(config_path, ["world_size=1", "train.compile=false", "train.cuda_graphs=false", *overrides])
    with torch.device("meta"):  # shapes only: nothing initialised
        model = MimoModel(config, 0, device="meta", dtype=PrecisionPolicy.named(config.train.precision).params)
    g = torch.Generator().manual_seed(0)

    def filled(t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point:
            return torch.randn(t.shape, generator=g).to(device=device, dtype=t.dtype)
        return torch.randint(0, 100, t.shape, generator=g).to(device=device, dtype=t.dtype)

    return list(_rank_files(model, {}, 1, copy=filled))


def _copied(files: list):
    """``files`` with each one's tensors copied to the host when it comes up, as ``_rank_files`` copies them."""
    from mimo.training.checkpoint import _host_copy

    for name, tensors, metadata in files:
        yield name, {k: _host_copy(t) for k, t in tensors.items()}, metadata


def _save_file(files, folder: str) -> None:
    """What ``_write_files`` did before checksums: safetensors' ``save_file`` per file, then fsync."""
    from safetensors.torch import save_file

    from mimo.training.checkpoint import _fsync

    names = []
    for name, tensors, metadata in files:
        save_file(tensors, os.path.join(folder, name), metadata=metadata)
        names.append(name)
    for name in names:
        _fsync(os.path.join(folder, name))


def _crc_alone(files: list) -> float:
    """Seconds the crc32 of every file's bytes takes, from host copies (the copies not timed)."""
    from mimo.training.checkpoint import _safetensors_layout

    spent = 0.0
    for _, tensors, metadata in _copied(files):
        header, views = _safetensors_layout(tensors, metadata)
        t0 = time.perf_counter()
        crc = zlib.crc32(header)
        for v in views:
            crc = zlib.crc32(v, crc)
        spent += time.perf_counter() - t0
    return spent


def measure(files: list, root: str, repeats: int) -> dict[str, list[float]]:
    import mimo.training.checkpoint as ckpt

    times: dict[str, list[float]] = {k: [] for k in ("save_file", "crc", "crc_alone")}

    def timed(key, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        times[key].append(time.perf_counter() - t0)
        return out

    variants = [("save_file", lambda f, d: timed("save_file", _save_file, f, d)),
                ("crc", lambda f, d: timed("crc", ckpt._write_files, f, d))]
    for r in range(-1, repeats):  # -1: a warm-up round, not counted
        order = variants[r % 2:] + variants[:r % 2]  # each variant first and second alike
        for name, run in order:
            folder = os.path.join(root, f"{name}-{r}")
            os.makedirs(folder)
            run(_copied(files), folder)
            shutil.rmtree(folder)  # one copy on disk at a time
        times["crc_alone"].append(_crc_alone(files))
        if r < 0:
            for v in times.values():
                v.clear()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "llava-1.3b.yaml"))
    ap.add_argument("--device", default="cpu", help="where the tensors are before the save copies them to the host")
    ap.add_argument("--repeats", type=int, default=6, help="rounds after a warm-up one (even: each variant in each place alike)")
    ap.add_argument("--dir", default=None, help="where the files are written (default: a temporary folder under /tmp)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    files = checkpoint_files(args.config, args.overrides, args.device)
    built_s = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for _, tensors, _ in files for t in tensors.values())
    root = tempfile.mkdtemp(prefix="checkpoint_checksum-", dir=args.dir)
    try:
        times = measure(files, root, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "bench": "checkpoint_checksum", "config": os.path.relpath(args.config, ROOT), "device": args.device, "files": len(files),
        "bytes": nbytes, "repeats": args.repeats, "median_s": {k: round(v, 3) for k, v in med.items()},
        "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "write_gb_per_s": round(nbytes / med["crc"] / 1e9, 3),
        "checksum_cost": round(med["crc"] / med["save_file"] - 1, 4),
        "paired_cost": round(statistics.median(c / f - 1 for c, f in zip(times["crc"], times["save_file"])), 4),
        "built_s": round(built_s, 1), "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs"
        + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
        "torch": torch.__version__, "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }))


if __name__ == "__main__":
    main()
