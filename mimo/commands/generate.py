"""``mimo generate``: a checkpoint's answer to one prompt (with images), and optionally its logits.

The work is ``mimo.training.generation`` (resolving the config and checkpoint, the prompt as
the config's template renders a user turn, the evaluator's generation loop at the config's
layout); this module is the command line around it: arguments, the printed answer, the logits
file and the result line (``mimo.commands.cli``'s contract).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from mimo.core.errors import MimoError

LOGITS_SUFFIXES = (".pt", ".npy")


class GenerateUsageError(MimoError):
    """A ``mimo generate`` argument that cannot work (checked before any process starts)."""


def generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="CONFIG|CKPT", help="a config YAML, or a checkpoint (a step-N folder, a folder of "
                        "them: its newest, or a run directory) whose recorded config is used")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="dotted overrides, e.g. a layout: "
                        "world_size=1 modules.vision.parallel.dp=1 ...")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the user's message (formatted with the config's chat "
                        "template; without a placeholder, one per image goes in front)")
    parser.add_argument("--image", action="append", default=[], metavar="PATH", help="an image file (repeat for several), "
                        "preprocessed as training images are")
    parser.add_argument("--checkpoint", metavar="DIR", help="with CONFIG: a step-N checkpoint or a folder of them "
                        "(default: the newest usable one in train.checkpoint.dir)")
    parser.add_argument("--max-new-tokens", type=int, metavar="N", help="stop after N new tokens (default: eval.max_new_tokens)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default): greedy; else sampled")
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--logits", metavar="FILE", help="write each step's logits, float32 [new tokens, vocab] "
                        "(row 0: the prompt's last position), as .pt or .npy")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a hung rank fails the run")
    # as cli's run_device_argument (mimo train, mimo eval); cli imports this module, not the other way
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cuda: one GPU per rank (NCCL); auto (default): cuda when there is a GPU for every rank, else cpu")


def check_logits_path(path: str | None) -> None:
    """A clear error before any process starts for a logits file that could not be written."""
    if path is None:
        return
    if not path.endswith(LOGITS_SUFFIXES):
        raise GenerateUsageError(f"--logits {path}: name a .pt or .npy file")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise GenerateUsageError(f"--logits {path}: no folder {folder}")


def write_logits(path: str, logits) -> None:
    """``logits`` (float32 [steps, vocab]) as ``torch.save``'s .pt or NumPy's .npy."""
    try:
        if path.endswith(".npy"):
            import numpy as np

            np.save(path, logits.numpy())
        else:
            import torch

            torch.save(logits, path)
    except OSError as e:
        raise GenerateUsageError(f"--logits {path}: cannot write it ({e.strerror or e})") from None


def run_generate(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.training.generation import Generator

    check_logits_path(args.logits)
    with Generator(args.source, args.overrides, args.checkpoint, args.device, args.timeout) as generator:
        out = generator.generate(args.prompt, args.image, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, seed=args.seed, logits=args.logits is not None)
    if args.logits is not None:
        write_logits(args.logits, out.logits)
    print(out.text, flush=True)
    return {
        "ok": True, "command": "generate", "text": out.text, "tokens": out.tokens, "finished": out.finished,
        "prompt_tokens": out.prompt_tokens, "checkpoint": generator.checkpoint, "checkpoint_step": generator.checkpoint_step,
        "max_new_tokens": generator.config.eval.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens, "temperature": args.temperature,
        "top_k": args.top_k, "seed": args.seed, "logits": args.logits,
    }
