"""The ``mimo`` command line (docs/design.md §4).

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
import io
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from mimo.compose.config import load_config
from mimo.data.demo import HELDOUT_SAMPLES, TRAIN_SAMPLES
from mimo.commands.demo import DEMO_DATA_DIR  # configs/demo.yaml points here
from mimo.commands.generate import generate_arguments, run_generate
from mimo.core import strict_json
from mimo.core.console import ClosableStdout, to_devnull
from mimo.core.errors import ConfigError, MimoError


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
        "overrides", nargs="*", default=[], metavar="key=value", help="dotted overrides, anywhere on the line, e.g. train.steps=5 modules.vision.parallel.tp=2"
    )


# ---------------------------------------------------------------- check-config


def format_layout(rows: list[dict[str, Any]]) -> str:
    """The resolved layout as an aligned text table (with the experts' etp x ep x edp where a
    module folds its MoE experts)."""
    header = ["module", "kind", "ranks", "tp", "cp", "dp", "pp", "colocated with"]
    cells = [
        [r["module"], r["kind"], r["ranks"], *(str(r[k]) for k in ("tp", "cp", "dp", "pp")), ", ".join(r["colocated_with"]) or "-"]
        for r in rows
    ]
    if any(r.get("gtp") for r in rows):
        header.insert(4, "gtp")
        for line, r in zip(cells, rows):
            line.insert(4, str(r.get("gtp", 1)))
    if any(r.get("experts") for r in rows):
        header.append("experts etp x ep x edp")
        for line, r in zip(cells, rows):
            e = r.get("experts")
            line.append(f"{e['etp']} x {e['ep']} x {e['edp']}" if e else "-")
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *cells])


def run_check_config(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.compose.preflight import check_inputs

    config = load_config(args.config, args.overrides)
    rows = config.layout_rows()
    print(f"{args.config}: valid; world_size={config.world_size}")
    print(format_layout(rows))
    # what the config loads (init.hf checkpoints, tokenizer, a sample of the shards): a line per
    # check, then ConfigError listing every problem (exit 2), before anything starts
    inputs = check_inputs(config, echo=print)
    return {"ok": True, "command": "check-config", "world_size": config.world_size, "modules": rows,
            "inputs": inputs.as_dict()}


# ---------------------------------------------------------------- verify-bridge


def verify_bridge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, required=True, help="local processes to start")
    parser.add_argument("--src", required=True, metavar="LAYOUT", help="e.g. tp=2,dp=2 (plus cp=, shard=hidden|seq, ranks=a:b)")
    parser.add_argument("--dst", required=True, metavar="LAYOUT", help="the destination (an LLM's first stage)")
    side = parser.add_mutually_exclusive_group()
    side.add_argument("--colocated", dest="colocated", action="store_const", const=True, help="both ends on the same ranks")
    side.add_argument("--non-colocated", dest="colocated", action="store_const", const=False, help="disjoint ranks: source first")
    parser.add_argument("--rows", choices=("ragged", "uniform", "native"), default="ragged",
                        help="rows per sample; native: images of random grids (rows h*w/4 each), the bridge built as training builds it")
    parser.add_argument("--hidden", type=int, default=12, help="row width of the random activations (default 12; native: the tower's hidden)")
    parser.add_argument("--levels", type=int, default=None,
                        help="with --rows native: deepstack levels travelling beside each row (row width hidden*(1+levels); default 1)")
    parser.add_argument("--microbatches", type=int, default=3, help="microbatches sent through the bridge (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs and weights (default 0)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="what the bridge moves (exactly, either way)")
    device_argument(parser)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a hung rank fails the run")


def device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo; cuda: one process per GPU, NCCL for GPU tensors (TF32 off)")


def run_verify_bridge(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.bridges.verify import bridge_case, check_native, parse_layout, resolve, summarise
    from mimo.training.launch import WorkerPool

    if args.world < 1 or args.hidden < 1 or args.microbatches < 1:
        raise UsageError("--world, --hidden and --microbatches must be >= 1")
    native = args.rows == "native"
    if args.levels is not None and not native:
        raise UsageError("--levels goes with --rows native (deepstack features of a native tower)")
    levels = (1 if args.levels is None else args.levels) if native else 0
    if levels < 0:
        raise UsageError("--levels must be >= 0")
    src, dst = parse_layout(args.src), parse_layout(args.dst)
    resolve(src, dst, args.world, args.colocated)  # impossible layouts fail here, before any process starts
    if native:
        check_native(src, dst)
    rows = args.rows if native else args.rows == "ragged"
    with WorkerPool(args.world, timeout_s=args.timeout, device=args.device) as pool:
        results = pool.run(bridge_case, args.src, args.dst, args.colocated, args.hidden, args.microbatches, rows, args.seed,
                           args.device, args.dtype, levels)
    report = summarise(results, itemsize=2 if args.dtype == "bf16" else 4)
    what = f" ({args.rows} rows, {levels} deepstack levels: width {report['width']})" if native else ""
    print(f"verify-bridge {args.src} -> {args.dst} on {args.world} ranks ({args.device}, {args.dtype}){what}: "
          + ("ok" if report["ok"] else "MISMATCH"))
    for problem in report.get("placement_problems", []):
        print(f"  {problem}")
    return {"command": "verify-bridge", "device": args.device, "dtype": args.dtype, **({"rows": "native", "levels": levels} if native else {}),
            **report}


# ---------------------------------------------------------------- verify-llm


def verify_llm_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-config", metavar="DIR", help="a Hugging Face model directory with config.json (random init)")
    src.add_argument("--hf-checkpoint", metavar="DIR",
                     help="a Hugging Face checkpoint directory (config.json + safetensors; LLaVA: its language model)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1); tp x pp local processes")
    parser.add_argument("--sequence-parallel", action="store_true", help="sequence parallel (with tp > 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE): ep data-parallel ranks, the experts "
                        "split over them (default 1); tp x pp x ep local processes")
    parser.add_argument("--samples", type=int, default=6, help="random samples in the pack")
    parser.add_argument("--max-len", type=int, default=20, help="longest sample (lengths are random in 1..max)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs and weights (default 0)")
    parser.add_argument("--tol", type=float, default=1e-5, help="largest allowed ||ours-hf||/||hf|| (fp32)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung rank fails the run")


def run_verify_llm(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.training.launch import WorkerPool
    from mimo.llm.verify import check_layout, verify_llm

    if args.tp < 1 or args.pp < 1 or args.ep < 1 or args.samples < 1 or args.max_len < 1:
        raise UsageError("--tp, --pp, --ep, --samples and --max-len must be >= 1")
    path = args.hf_checkpoint or args.hf_config
    # before any process starts
    check_layout(path, args.tp, args.pp, args.sequence_parallel, args.hf_checkpoint is not None, args.ep)
    with WorkerPool(args.tp * args.pp * args.ep, timeout_s=args.timeout) as pool:
        report = verify_llm(path, pool, from_checkpoint=args.hf_checkpoint is not None, tp=args.tp, pp=args.pp,
                            sequence_parallel=args.sequence_parallel, ep=args.ep, samples=args.samples,
                            max_len=args.max_len, seed=args.seed, tol=args.tol)
    print(f"verify-llm {report['model_type']} tp={args.tp} pp={args.pp} ep={args.ep}: max_rel_err={report['max_rel_err']:.2e} "
          f"loss_rel_err={report['loss_rel_err']:.2e} (vs fp64 {report['max_rel_err_vs_fp64']:.2e}, HF fp32 vs fp64 "
          f"{report['hf_fp32_rel_err_vs_fp64']:.2e}) export_exact={report['export_exact']} -> "
          + ("ok" if report["ok"] else "MISMATCH"))
    return report


# ---------------------------------------------------------------- verify-hf


def verify_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="a Hugging Face Qwen3-VL(-MoE) / Qwen3.5(-MoE) / Kimi-K2.5 directory: config.json, and "
                        "safetensors weights (random weights without them); or a causal LM's (DeepSeek-V3 / V3.2, ...: "
                        "verify-llm's check, its default samples)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the LLM and the tower (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE; the ep ranks are data parallel for "
                        "the dense layers and the tower); tp x ep local processes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random samples and weights (default 0)")
    parser.add_argument("--tol", type=float, default=1e-5, help="the yardstick's floor: ||ours-hf64||/||hf64|| <= max(tol, 4 e1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung rank fails the run")


def _causal_lm_weights(path: str) -> bool | None:
    """Whether the causal LM at ``path`` (a family ``mimo.llm.hf`` maps: verify-llm's kind) has
    safetensors weights; None where ``path`` holds no such model (verify-hf's own check names
    what it holds)."""
    from mimo.llm.hf import HF_FAMILIES, read_config_json

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return None
    config = read_config_json(config_file)
    if not isinstance(config, dict) or config.get("model_type") not in HF_FAMILIES:
        return None
    return any(n.endswith(".safetensors") for n in os.listdir(path))


def run_verify_hf(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.commands.verify_hf import check_layout, verify_hf
    from mimo.training.launch import WorkerPool

    weights = _causal_lm_weights(args.dir)
    if weights is not None:  # a causal LM: verify-llm's check at tp x ep (its weights where the directory has them)
        llm_args = argparse.Namespace(hf_checkpoint=args.dir if weights else None, hf_config=None if weights else args.dir,
                                      tp=args.tp, pp=1, sequence_parallel=False, ep=args.ep, samples=6, max_len=20,
                                      seed=args.seed, tol=args.tol, timeout=args.timeout)
        return {**run_verify_llm(llm_args), "command": "verify-hf"}
    check_layout(args.dir, args.tp, args.ep)  # before any process starts
    with WorkerPool(args.tp * args.ep, timeout_s=args.timeout) as pool:
        report = verify_hf(args.dir, pool, tp=args.tp, ep=args.ep, seed=args.seed, tol=args.tol)
    print(f"verify-hf {report['model_type']} tp={args.tp} ep={args.ep}: logits {report['max_logits_rel_err']:.2e}, loss "
          f"{report['loss_rel_err']:.2e}, grads {report['max_grad_rel_err']:.2e} ({report['worst_grad']}) (vs fp64 "
          f"{report['max_err_vs_fp64']:.2e}, HF fp32 vs fp64 {report['hf_fp32_rel_err_vs_fp64']:.2e}) -> "
          + ("ok" if report["ok"] else "MISMATCH"))
    return report


# ---------------------------------------------------------------- data


def make_demo_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", nargs="?", default=DEMO_DATA_DIR, help=f"output folder (default: {DEMO_DATA_DIR})")
    parser.add_argument("--train-samples", type=int, default=TRAIN_SAMPLES, help=f"samples in the train split (default {TRAIN_SAMPLES})")
    parser.add_argument("--heldout-samples", type=int, default=HELDOUT_SAMPLES, help=f"samples in the held-out split (default {HELDOUT_SAMPLES})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated images and texts (default 0)")


def run_make_demo_data(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.data.demo import make_demo_data

    if args.train_samples < 1 or args.heldout_samples < 1:
        raise UsageError("--train-samples and --heldout-samples must be >= 1")
    made = make_demo_data(args.dir, args.train_samples, args.heldout_samples, seed=args.seed)
    print(f"demo data in {args.dir}: train {made['train']}, held-out {made['heldout']}, tokenizer {made['tokenizer']}")
    return {"ok": True, "command": "make-demo-data", **made}


def prepare_data_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser)
    parser.add_argument("--rebuild", action="store_true", help="rebuild the index even if it is current")


def run_prepare_data(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.compose.inputs import data_plan, ensure_index, index_location
    from mimo.data.skipped import SkipReport

    config = load_config(args.config, args.overrides)
    config.require_trainable()  # (a native-resolution encoder has no data path yet)
    if config.data.source != "webdataset":
        raise UsageError(f"prepare-data: data.source is {config.data.source!r}; there are no shards to index")
    index, status = ensure_index(config, rebuild=args.rebuild)
    plan = data_plan(config, index)
    where = index_location(config)
    bad = [e for e in index.entries if e.bad]
    too_long = [index.entries[i] for i in plan.too_long]
    print(f"index {where}: {status}; {len(index.entries)} samples in {len(index.shards)} shards, {len(plan.valid)} usable")
    for e in bad[:20]:
        print(f"  bad: {index.shards[e.shard]}:{e.key}: {e.bad}")
    if len(bad) > 20:
        print(f"  ... and {len(bad) - 20} more bad samples")
    for e in too_long[:20]:
        print(f"  too long: {index.shards[e.shard]}:{e.key}: {e.tokens} tokens > data.max_sample_tokens={config.data.max_sample_tokens}")
    if len(too_long) > 20:
        print(f"  ... and {len(too_long) - 20} more too long samples")
    report = SkipReport.of(plan, config.data.max_sample_tokens)
    for line in report.shard_lines():  # the samples are listed above
        print(f"  {line}")
    print(f"  {100 * report.fraction:.2f}% of the samples dropped (data.max_skipped_fraction="
          f"{config.data.max_skipped_fraction:g}: `mimo train` stops above it)")
    return {
        "ok": True, "command": "prepare-data", "index": where, "status": status,
        "samples": len(index.entries), "usable": len(plan.valid), "skipped": plan.skipped_counts(),
        "dropped_fraction": report.fraction, "shard_lost": index.shard_lost,
        "too_long": [{"shard": index.shards[e.shard], "key": e.key, "tokens": e.tokens} for e in too_long[:20]],
        "shard_errors": index.shard_errors,
    }


def inspect_data_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser)
    parser.add_argument("--batches", type=int, default=8, help="global microbatches to read")


def run_inspect_data(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.compose.inputs import inspect

    if args.batches < 1:
        raise UsageError("--batches must be >= 1")
    config = load_config(args.config, args.overrides)
    config.require_trainable()  # (a native-resolution encoder has no data path yet)
    report = inspect(config, args.batches)
    sample = report["sample"]
    if sample is not None:
        where = f" {sample['shard']}:{sample['key']}" if "shard" in sample else ""
        images = "; ".join(f"{p} at {', '.join(f'{a}..{b - 1}' for a, b in spans)}" for p, spans in sample["image_positions"].items() if spans)
        print(f"first sample{where} ({sample['tokens']} tokens; {sample['legend']}):")
        print("  " + sample["text"].replace("\n", "\n  "))
        print(f"  label tokens: {sample['label_tokens']} at " + (", ".join(f"{a}..{b - 1}" for a, b in sample["labels_at"]) or "-"))
        print(f"  image positions: {images or '-'}")
    print(
        f"read {report['samples_read']} samples in {report['microbatches']} microbatches; padding "
        f"{100 * report['padding_fraction']:.2f}% (mean {report['mean_tokens_per_dp_rank']:.1f} of "
        f"{report['capacity_per_dp_rank']:g} tokens per LLM DP rank; SP/CP pack padding {100 * report['pack_padding_fraction']:.2f}%), "
        f"max/mean tokens per LLM DP rank {report['max_over_mean_tokens_per_dp_rank']:.3f}; skipped {report['skipped']}, "
        f"failed at read {report['read_failures']}"
    )
    for name, b in report.get("bridges", {}).items():
        mib = lambda values: f"{sum(values) / len(values) / 2**20:.3f}"  # noqa: E731
        print(f"bridge {name}: {mib(b['forward_bytes_per_microbatch'])} MiB forward, {mib(b['backward_bytes_per_microbatch'])} "
              f"MiB backward per microbatch on average (between its {b['ranks']} ranks)")
    return {"ok": True, "command": "inspect-data", **report}


# ---------------------------------------------------------------- verify-encoder


def verify_encoder_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--timm", metavar="NAME", help="a timm ViT / CLIP / SigLIP model name (random init unless --weights)")
    source.add_argument("--hf-config", metavar="DIR", help="a Hugging Face CLIP / SigLIP vision config directory (random init)")
    source.add_argument("--hf-checkpoint", metavar="DIR",
                        help="a Hugging Face checkpoint directory (config.json + safetensors; LLaVA: its vision tower)")
    parser.add_argument("--timm-kwargs", metavar="K=V,...", help="timm.create_model overrides, e.g. depth=2,embed_dim=48,num_heads=6")
    parser.add_argument("--weights", metavar="FILE", help="with --timm: a local weights file (safetensors or torch)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= local processes)")
    parser.add_argument("--feature-layer", default="-2", metavar="L", help="hidden_states index, or post_norm (default -2)")
    parser.add_argument("--image-size", type=int, metavar="S", help="run at this resolution (position embeddings resampled)")
    parser.add_argument("--images", type=int, default=2, help="random images per check")
    parser.add_argument("--grads", action="store_true", help="also compare weight gradients")
    parser.add_argument("--sequence-parallel", action="store_true", help="sequence parallel between the TP ranks (with --tp > 1)")
    parser.add_argument("--keep-class-token", action="store_true", help="keep the [CLS] row in the features")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs and weights (default 0)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung rank fails the run")


def run_verify_encoder(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.encoders.verify import EncoderSource, check_request, describe_source, parse_feature_layer, parse_kwargs, preflight, summarise, verify_case
    from mimo.training.launch import WorkerPool

    if args.timm is not None:
        source = EncoderSource("timm", args.timm, parse_kwargs(args.timm_kwargs), args.weights)
    else:
        if args.timm_kwargs or args.weights:
            raise UsageError("--timm-kwargs and --weights go with --timm")
        source = EncoderSource("hf", args.hf_config or args.hf_checkpoint, hf_weights=args.hf_checkpoint is not None)
    if args.images < 1:
        raise UsageError("--images must be >= 1")
    feature_layer = parse_feature_layer(args.feature_layer)
    arch, _ = describe_source(source)  # bad names, missing files, impossible sizes fail here, before any process starts
    arch = check_request(arch, args.tp, feature_layer, args.image_size)
    preflight(source, arch)
    with WorkerPool(args.tp, timeout_s=args.timeout) as pool:
        results = pool.run(verify_case, source, args.tp, [feature_layer], args.image_size, args.seed, args.images,
                           args.grads, args.sequence_parallel, not args.keep_class_token)
    report = summarise(results)
    print(f"verify-encoder {source.label()} tp={args.tp} feature_layer={feature_layer} image_size={arch.image_size}: "
          f"max_rel_err={report['max_rel_err']:.3e} ({report['worst']}; vs fp64 {report['max_rel_err_vs_fp64']:.2e}, "
          f"original fp32 vs fp64 {report['reference_rel_err_vs_fp64']:.2e}) " + ("ok" if report["ok"] else "MISMATCH"))
    return {"command": "verify-encoder", "source": source.label(), "tp": args.tp, "feature_layer": feature_layer,
            "image_size": arch.image_size, **report}


# ---------------------------------------------------------------- verify-train


def verify_train_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser)
    parser.add_argument("--steps", type=int, default=3, help="training steps to run and compare (default 3)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="the layout run's precision (bf16: GPU fast paths); the reference runs fp32 and fp64")
    parser.add_argument("--tol", type=float, help=f"largest allowed ||a-b||/||b|| (default {VERIFY_TRAIN_TOL['fp32']:g} fp32, "
                        f"{VERIFY_TRAIN_TOL['bf16']:g} bf16)")
    device_argument(parser)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a hung rank fails the run")


# bf16: weights, activations and Adam state rounded to 8 bits of mantissa, against fp32 (docs/design.md §3);
# gradients and parameters then compared per module (see mimo.commands.verify_train.compare)
VERIFY_TRAIN_TOL = {"fp32": 1e-5, "bf16": 5e-2}


def run_verify_train(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.compose.inputs import ensure_index
    from mimo.commands.verify_train import report_lines, verify_train

    if args.steps < 1:
        raise UsageError("--steps must be >= 1")
    config = load_config(args.config, args.overrides)
    config.require_trainable()  # (a native-resolution encoder has no data path yet)
    if config.train.fp8 is not None:
        raise UsageError("train.fp8 is set: FP8 products round every operand to 3 mantissa bits, so a layout and the "
                         "one-process reference part by whole FP8 steps wherever a rounding flips (the fp32 and fp64 "
                         "references alone differ by about 1e-4 in gradients), which no tolerance tells from a layout "
                         "error. Verify the layout without it (train.fp8=null); mimo's tests check each FP8 product's "
                         "TP layout against one process (tests/test_fp8.py)")
    ensure_index(config)  # once, here, before any rank reads it
    tol = VERIFY_TRAIN_TOL[args.precision] if args.tol is None else args.tol
    # the reference: one process, fp32 and fp64, the same device kind
    report = verify_train(args.config, args.overrides, args.steps, args.device, args.precision, tol, args.timeout)
    print(f"verify-train {args.config} {' '.join(args.overrides)} ({args.device}, {args.precision}, tol {tol:g}): "
          + ("ok" if report["ok"] else "MISMATCH"))
    print(format_layout(config.layout_rows()))
    print("\n".join(report_lines(report)))
    return {"command": "verify-train", "device": args.device, "precision": args.precision, "tol": tol, **report}


# ---------------------------------------------------------------- train


def train_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser)
    run_dir_argument(parser, "metrics.jsonl, logs/, the resolved config.yaml and (unless train.checkpoint.dir is set) checkpoints/")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a collective may wait before the run is aborted")
    parser.add_argument("--stop-at", type=int, metavar="STEP", help="stop cleanly after this step (checkpointed); `mimo train` again resumes")
    parser.add_argument("--log-every", type=int, default=1, metavar="K", help="a progress line every K steps when stdout is not a terminal")
    parser.add_argument("--resume-from", metavar="DIR", help="continue from this step-N checkpoint (default: the newest usable one "
                        "in train.checkpoint.dir); new checkpoints still go to train.checkpoint.dir")
    run_device_argument(parser)


def run_dir_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--run-dir", metavar="DIR", help=f"the run directory: {what} (default: runs/<config file name>/, or "
                        "the parent of train.checkpoint.dir where the config sets it)")


def run_device_argument(parser: argparse.ArgumentParser) -> None:
    """``mimo train`` and ``mimo eval``: where the ranks run, picked by default."""
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cuda: one GPU per rank (NCCL); auto (default): cuda when there is a GPU for every rank, else cpu")


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.training.train import TrainOptions, train

    result = train(args.config, args.overrides, TrainOptions(args.run_dir, args.timeout, args.stop_at, args.log_every, args.device,
                                                             resume_from=args.resume_from))
    print(train_summary(result), flush=True)
    return result


def train_summary(result: dict[str, Any]) -> str:
    """The line a person reads at the end of ``mimo train`` (the JSON follows it)."""
    step, loss = result["steps"], result["final_loss"]
    if result["steps_run"] == 0:
        return f"train: already finished at step {step}: {result['checkpoint']}; nothing to do (run directory {result['run_dir']})"
    resumed = f", resumed from step {result['resumed_from']}" if result["resumed_from"] else ""
    loss_text = "-" if loss is None else f"{loss:.4f}"
    if result["stopped"]:
        return (f"train: stopped after step {step} ({result['steps_run']} steps run{resumed}), loss {loss_text}; "
                f"`mimo train` again resumes from {result['checkpoint']}")
    return (f"train: finished at step {step} ({result['steps_run']} steps run{resumed}), final loss {loss_text}; "
            f"run directory {result['run_dir']}, checkpoint {result['checkpoint']}")


# ---------------------------------------------------------------- import-hf (import-hf-llava: its LLaVA-only alias)


def _import_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("checkpoint", metavar="DIR", help=f"a Hugging Face {what} directory")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="dotted overrides of --config")
    parser.add_argument("--yaml", metavar="FILE", help="without --config: write the modules section there (default: print it)")
    parser.add_argument("--config", metavar="CONFIG", help="convert to a mimo checkpoint at this config's layout (train.init_from)")
    parser.add_argument("--out", metavar="DIR", help="with --config: the checkpoint directory to write")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds the conversion may take")


def import_hf_llava_arguments(parser: argparse.ArgumentParser) -> None:
    _import_arguments(parser, "LlavaForConditionalGeneration")


def import_hf_arguments(parser: argparse.ArgumentParser) -> None:
    _import_arguments(parser, "LLaVA, Qwen3-VL(-MoE), Qwen3.5(-MoE), Kimi-K2.5 or a Qwen3-Next / Qwen3.5 causal LM")


def _run_import(args: argparse.Namespace, command: str, describe, convert) -> dict[str, Any]:
    """Without --config: ``describe(DIR, --yaml)`` (the modules section); with it: ``convert`` to a checkpoint."""
    if args.config is None:
        if args.out:  # the modules section goes to --yaml; --out is the converted checkpoint of --config
            raise UsageError(f"{command}: --out is the mimo checkpoint directory written with --config CONFIG; to write the "
                             f"modules: section to a file, use --yaml {args.out}")
        if args.overrides:
            raise UsageError(f"{command}: key=value overrides apply to --config CONFIG; there is none")
        return describe(args.checkpoint, args.yaml)
    if args.out is None:
        raise UsageError(f"{command}: --config needs --out DIR (where the mimo checkpoint goes)")
    return convert(args.checkpoint, args.config, args.overrides, args.out, args.timeout)


def run_import_hf_llava(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.commands.hf_llava import describe_llava, import_to_checkpoint

    def describe(path: str, out: str | None) -> dict[str, Any]:
        result = describe_llava(path, out)
        if out is None:  # the YAML above; then what it says
            print(f"# import-hf-llava {path}: {result['tensors']} tensors fit the config ({result['naming']} key names)")
        return result

    return _run_import(args, "import-hf-llava", describe, import_to_checkpoint)


def run_import_hf(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.commands.import_hf import describe, import_to_checkpoint

    return _run_import(args, "import-hf", describe, import_to_checkpoint)


# ---------------------------------------------------------------- export-hf


def export_hf_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="a step-N checkpoint, or a checkpoint folder / run directory: its latest")
    parser.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face model directory to write (new or empty)")
    parser.add_argument("--llm-only", action="store_true", help="only the language model, as its *ForCausalLM, and the tokenizer")
    parser.add_argument("--max-shard-gib", type=float, default=5.0, metavar="G", help="safetensors shard size (default 5)")
    lora = parser.add_mutually_exclusive_group()
    lora.add_argument("--adapter", metavar="DIR", help="a LoRA run: the base model to --out, its adapters as a PEFT adapter "
                                                       "directory to DIR (new or empty)")
    lora.add_argument("--merge", action="store_true", help="a LoRA run: the adapters merged into the base weights, to --out")


def run_export_hf(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.commands.export_hf import export_hf

    if args.max_shard_gib <= 0:
        raise UsageError("--max-shard-gib must be > 0")
    return export_hf(args.checkpoint, args.out, args.llm_only, int(args.max_shard_gib * 2**30), adapter=args.adapter,
                     merge=args.merge)


# ---------------------------------------------------------------- convert-checkpoint


def convert_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="a step-N checkpoint, or a folder of them: its latest")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="dotted overrides of --config")
    parser.add_argument("--config", required=True, metavar="CONFIG", help="the config whose layout to write it at")
    parser.add_argument("--out", required=True, metavar="DIR", help="the checkpoint folder to write (step-N inside)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds the conversion may take")


def run_convert_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.commands.convert_checkpoint import convert_checkpoint

    return convert_checkpoint(args.checkpoint, args.config, args.overrides, args.out, args.timeout)


# ---------------------------------------------------------------- eval, demo


def eval_arguments(parser: argparse.ArgumentParser) -> None:
    config_arguments(parser)
    parser.add_argument("--checkpoint", metavar="DIR", help="a step-N checkpoint, or a folder of them: its latest (default: the "
                        "run directory's checkpoints, train.checkpoint.dir)")
    run_dir_argument(parser, "the `mimo train` run whose latest checkpoint to evaluate")
    parser.add_argument("--shards", metavar="PATTERN", help="held-out WebDataset shards (default: eval.shards)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a hung rank fails the run")
    run_device_argument(parser)


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.commands.eval import evaluate

    checkpoint = args.checkpoint
    if checkpoint is None and args.run_dir is not None:  # --run-dir R: the checkpoints `mimo train --run-dir R` wrote
        checkpoint = load_config(args.config, args.overrides, run_dir=args.run_dir).train.checkpoint.dir
    result = evaluate(args.config, args.overrides, checkpoint, args.shards, args.timeout, args.device)
    em = result["exact_match"]
    print(f"eval {result['checkpoint']} on {result['shards']}: {result['samples']} samples, loss {result['loss']:.4f}, exact match "
          + (f"{em:.4f} ({result['matched']}/{result['scored']})" if em is not None else "- (no question)")
          + f"; captions {result['captions']}, read failures {result['read_failures']}")
    return result


def demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="dotted overrides of the demo config")
    parser.add_argument("--config", metavar="PATH", help="default: configs/demo.yaml")
    parser.add_argument("--fresh", action="store_true", help="delete the run directory first (default: resume it)")
    parser.add_argument("--log-every", type=int, default=10, metavar="K", help="a loss line every K steps")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a collective may wait before the run is aborted")


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    from mimo.commands.demo import demo

    return demo(args.config, args.overrides, args.fresh, args.log_every, args.timeout)


COMMANDS: tuple[Command, ...] = (
    Command("demo", "make demo data, train the demo config on 4 local processes, evaluate it", demo_arguments, run_demo),
    Command("check-config", "validate a config (and overrides) without starting anything", config_arguments, run_check_config),
    Command("train", "train a config: launch its ranks, log, checkpoint, resume", train_arguments, run_train),
    Command("eval", "held-out loss and exact match of greedy answers (a checkpoint at any layout)", eval_arguments, run_eval),
    Command("generate", "a checkpoint's answer to a prompt and images (greedy or sampled; any layout)", generate_arguments, run_generate),
    Command("make-demo-data", "write learnable demo shards and a local tokenizer", make_demo_data_arguments, run_make_demo_data),
    Command("prepare-data", "index the shards of a config (once; train prepares a missing index itself)", prepare_data_arguments, run_prepare_data),
    Command("inspect-data", "read packed microbatches through the real pipeline and report counts", inspect_data_arguments, run_inspect_data),
    Command("verify-train", "train a config's layout beside the one-process reference and compare", verify_train_arguments, run_verify_train),
    Command("verify-bridge", "check a bridge between two layouts against the one-process reference", verify_bridge_arguments, run_verify_bridge),
    Command("verify-encoder", "check an imported timm / Hugging Face vision tower against the original", verify_encoder_arguments, run_verify_encoder),
    Command("verify-llm", "check the LLM at a TP/PP layout against the Hugging Face model", verify_llm_arguments, run_verify_llm),
    Command("verify-hf", "check a whole Qwen3-VL(-MoE), Qwen3.5(-MoE) or Kimi-K2.5 at a TP/EP layout against the Hugging Face model", verify_hf_arguments,
            run_verify_hf),
    Command("import-hf", "check a Hugging Face LLaVA / Qwen3-VL / Qwen3.5 / Kimi-K2.5 / Qwen3-Next checkpoint; give the mimo modules that load it, or convert it",
            import_hf_arguments, run_import_hf),
    Command("import-hf-llava", "check a Hugging Face LLaVA checkpoint and give the mimo modules that load it", import_hf_llava_arguments,
            run_import_hf_llava),
    Command("export-hf", "write a checkpoint as a Hugging Face LLaVA / Qwen3-VL / Qwen3.5 / Kimi-K2.5 (or, --llm-only, causal LM) directory", export_hf_arguments,
            run_export_hf),
    Command("convert-checkpoint", "rewrite a checkpoint at another config's layout (offline resharding)",
            convert_checkpoint_arguments, run_convert_checkpoint),
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


_OVERRIDE = re.compile(r"^[A-Za-z_][\w.-]*=")


def parse_command_line(argv: Sequence[str] | None) -> argparse.Namespace:
    """argparse, with ``key=value`` overrides anywhere on the line: argparse gives a positional
    ``nargs="*"`` only the words before the first option, so later ones come back unparsed and
    join the overrides here, in command-line order; any other unknown word is still an error."""
    args, extra = build_parser().parse_known_args(argv)
    overrides = [a for a in extra if _OVERRIDE.match(a)]
    unknown = [a for a in extra if not _OVERRIDE.match(a)]
    if overrides and not hasattr(args, "overrides"):
        raise UsageError(f"mimo {args.command}: unrecognized arguments: {' '.join(overrides)} (this command takes no key=value overrides)")
    if unknown:
        raise UsageError(f"mimo {args.command}: unrecognized arguments: {' '.join(unknown)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    stdout, sys.stdout = sys.stdout, ClosableStdout(sys.stdout)
    try:
        return _main(argv)
    finally:
        sys.stdout = stdout


def _main(argv: Sequence[str] | None) -> int:
    command = None
    try:
        args = parse_command_line(argv)
        command = args.command
        result = args.run(args)
    except MimoError as e:
        problems = e.problems if isinstance(e, ConfigError) else [str(e)]
        sys.stdout.flush()
        for problem in problems:
            print(problem, file=sys.stderr)
        sys.stderr.flush()
        _print_line(strict_json.dumps({"ok": False, "command": command, "errors": problems}))
        return 2
    _print_line(strict_json.dumps(result))  # a NaN as null: the last line is JSON to every reader
    return 0 if result.get("ok", True) else 1


def _print_line(line: str) -> None:
    """``line`` and its newline in one write: the ranks of a node may share one stdout file, and
    a print unbuffered (``python -u``) writes the two apart, so two ranks' lines could merge."""
    try:
        sys.stdout.flush()
        try:
            fd = sys.stdout.fileno()
        except (AttributeError, OSError, io.UnsupportedOperation):  # a captured stream (tests)
            print(line, flush=True)
            return
        os.write(fd, (line + "\n").encode())
    except OSError:  # stdout closed (`| head`, a closed terminal): the result goes nowhere, quietly
        to_devnull(sys.stdout)
