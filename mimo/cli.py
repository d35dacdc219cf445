"""The ``mimo`` command line (DESIGN §4).

Each subcommand is a ``Command``: its arguments and a ``run(args) -> dict`` that prints what
a person reads and returns the result, which ``main`` prints as the last line (one JSON
object) and exits 0 (1 when the result says ``"ok": false``, e.g. a failed verification). A ``MimoError`` anywhere (including bad usage) prints its message, one
problem per line on stderr, then ``{"ok": false, "errors": [...]}`` and exits 2; never a
traceback. Commands import heavy modules (torch) inside ``run``, so that ``check-config``
starts fast and never touches torch.

Adding a command: write ``def run_x(args) -> dict`` and ``def x_arguments(parser)``, and list
``Command("x", "help", x_arguments, run_x)`` in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from mimo.config import load_config
from mimo.errors import ConfigError, MimoError


class UsageError(MimoError):
    """Bad command-line usage (unknown command, missing argument)."""


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], dict[str, Any]]


# ---------------------------------------------------------------- shared arguments


def config_arguments(parser: argparse.ArgumentParser) -> None:
    """CONFIG plus dotted overrides, taken by every command that reads a config."""
    parser.add_argument("config", metavar="CONFIG", help="YAML config file")
    parser.add_argument(
        "overrides", nargs="*", default=[], metavar="key=value", help="dotted overrides, e.g. train.steps=5 modules.vision.parallel.tp=2"
    )


# ---------------------------------------------------------------- check-config


def format_layout(rows: list[dict[str, Any]]) -> str:
    """The resolved layout as an aligned text table."""
    header = ["module", "kind", "ranks", "tp", "cp", "dp", "pp", "colocated with"]
    cells = [
        [r["module"], r["kind"], r["ranks"], *(str(r[k]) for k in ("tp", "cp", "dp", "pp")), ", ".join(r["colocated_with"]) or "-"]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *cells])


def run_check_config(args: argparse.Namespace) -> dict[str, Any]:
    config = load_config(args.config, args.overrides)
    rows = config.layout_rows()
    print(f"{args.config}: valid; world_size={config.world_size}")
    print(format_layout(rows))
    return {"ok": True, "command": "check-config", "world_size": config.world_size, "modules": rows}


# ---------------------------------------------------------------- verify-bridge


def verify_bridge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, required=True, help="local processes to start (gloo)")
    parser.add_argument("--src", required=True, metavar="LAYOUT", help="e.g. tp=2,dp=2 (plus cp=, shard=hidden|seq, ranks=a:b)")
    parser.add_argument("--dst", required=True, metavar="LAYOUT", help="the destination (an LLM's first stage)")
    side = parser.add_mutually_exclusive_group()
    side.add_argument("--colocated", dest="colocated", action="store_const", const=True, help="both ends on the same ranks")
    side.add_argument("--non-colocated", dest="colocated", action="store_const", const=False, help="disjoint ranks: source first")
    parser.add_argument("--rows", choices=("ragged", "uniform"), default="ragged", help="rows per sample")
    parser.add_argument("--hidden", type=int, default=12)
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a hung rank fails the run")


def run_verify_bridge(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.bridges.verify import bridge_case, parse_layout, resolve, summarise
    from mimo.launch import WorkerPool

    if args.world < 1 or args.hidden < 1 or args.microbatches < 1:
        raise UsageError("--world, --hidden and --microbatches must be >= 1")
    src, dst = parse_layout(args.src), parse_layout(args.dst)
    resolve(src, dst, args.world, args.colocated)  # impossible layouts fail here, before any process starts
    with WorkerPool(args.world, timeout_s=args.timeout) as pool:
        results = pool.run(bridge_case, args.src, args.dst, args.colocated, args.hidden, args.microbatches, args.rows == "ragged", args.seed)
    report = summarise(results)
    print(f"verify-bridge {args.src} -> {args.dst} on {args.world} ranks: " + ("ok" if report["ok"] else "MISMATCH"))
    return {"command": "verify-bridge", **report}


COMMANDS: tuple[Command, ...] = (
    Command("check-config", "validate a config (and overrides) without starting anything", config_arguments, run_check_config),
    Command("verify-bridge", "check a bridge between two layouts against the one-process reference", verify_bridge_arguments, run_verify_bridge),
)


# ---------------------------------------------------------------- entry point


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit; keep our contract
        raise UsageError(f"{self.prog}: {message}")


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = _Parser(prog="mimo", description="Multimodal training with a parallel layout per module.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in commands:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    command = None
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        result = args.run(args)
    except MimoError as e:
        problems = e.problems if isinstance(e, ConfigError) else [str(e)]
        sys.stdout.flush()
        for problem in problems:
            print(problem, file=sys.stderr)
        sys.stderr.flush()
        print(json.dumps({"ok": False, "command": command, "errors": problems}), flush=True)
        return 2
    print(json.dumps(result), flush=True)
    return 0 if result.get("ok", True) else 1
