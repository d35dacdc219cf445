"""Native-resolution Qwen3-VL-MoE training step: mimo against transformers'
``Qwen3VLMoeForConditionalGeneration`` on the same samples at the same batch (issue 49, item 4).

One model, built once: transformers' ``Qwen3VLMoeConfig`` with random weights (transformers' own
init, ``--init hf``; or ``--init verify``: ``mimo verify-hf``'s ``randomize_vlm_``, at which every
path shows in the logits), saved with ``save_pretrained`` (safetensors) into a temporary
directory. transformers trains that model (its state dict, loaded into a fresh model per
configuration); mimo trains the same weights loaded through its import path
(``mimo.commands.hf_qwen3_vl.qwen3_vl_modules`` of the directory's ``config.json``, both modules'
``init.hf`` set to it: what ``mimo import-hf DIR`` writes).

Presets (``--small``: a CPU-sized model that runs in seconds):

* default: the tower of Qwen3-VL-2B (depth 24, hidden 1024, 16 heads, MLP 4096, out_hidden 2048,
  16-pixel patches, temporal patch 2, 2x2 merge, deepstack after blocks 5, 11, 17, 48x48
  positions) and a 16-layer Qwen3-VL-MoE text model (hidden 2048, 16 heads / 4 kv heads of
  head_dim 128, every layer 64 experts top 8 of ffn 768, M-RoPE [24, 20, 20] interleaved,
  theta 5e6, untied head), vocab 32000 (``--vocab 151936``, Qwen's: 0.49B parameters more and
  transformers' fp32 logits over its padded batch, which leave too little room in 78 GiB). 5.54B
  parameters, 1.31B active per token (LLM 0.90B: 0.77B without embedding and head; tower 0.41B).
* small: 4 tower blocks of width 32, 4 MoE layers of width 64 (4 experts, top 2), vocab 512.

Samples: a fixed seeded stream (``--seed``), ``--batch`` samples per step, the same samples in
the same order and steps to both sides. A sample is one in ten text only, else one image (or, one
in five, two smaller ones) of a random native size (area log-uniform in 224^2 .. 1024^2 pixels,
two-image samples 224^2 .. 724^2 each; aspect ratio log-uniform in 1/2.5 .. 2.5; random RGB
pixels) between text (128 .. 512 text tokens in all), laid out as Qwen3-VL's processor lays it
out (``<vision_start> <image_pad> x rows <vision_end>``, ``mimo.compose.native_vlm``); every
token but the image pads is a target.

mimo: ``MimoModel`` (the tower colocated with the LLM, world 1) in the ``train.precision``
policy (GPU: ``bf16-pure`` with ``grad_reduce: bf16``: bf16 weights, gradients and AdamW state,
as torch's AdamW on transformers' bf16 parameters; CPU: fp32), one AdamW per module
(``model_optimizers``), its ``DataPipeline`` over a plan of these samples (one microbatch of
``--batch`` samples per step, packed THD with M-RoPE positions; images routed as uint8 patch rows,
``patch_bytes``, normalised on the device by ``PatchNorm``: the processor's rows bit for bit),
``mimo.training.step.train_step``. ``--variants eager,compile`` run in turn on one model (compile:
``compile_blocks``, the LLM layers for dynamic lengths; the native tower stays eager).

transformers: the samples as its processor hands them over (``mimo.commands.verify_hf.hf_inputs``:
one right-padded row per sample, ``attention_mask``, ``mm_token_type_ids``, ``labels`` -100 at
image pads and padding, ``pixel_values`` = ``mimo.data.native_images.preprocess`` of each image,
equal to the Qwen2-VL image processor's, with ``image_grid_thw``), moved to the device inside the
step; ``model(**inputs).loss.backward()``, torch's AdamW (the same betas 0.9 / 0.95, eps 1e-8, no
weight decay, fused on CUDA), constant learning rate on both sides. Its configuration is searched:
each attention implementation of ``--hf-attn`` (default on CUDA: sdpa, flash_attention_2,
flex_attention) with the first experts implementation of ``--hf-experts`` (default grouped_mm,
eager), then the fastest attention with the other experts implementations; the fastest that ran
is the anchor (``hf``), every run's numbers or error are in ``hf_runs``. A transformers
configuration or a mimo variant that runs past ``--budget-s`` (CUDA default 150 s; transformers'
model build included) stops between steps and is reported as an error; no transformers
configuration starts once the search has taken ``--hf-budget-s`` (CUDA default 200 s), so that
one invocation stays within ten minutes.

Per side: median step time (and min / max / mean) over the timed steps after ``--warmup``, real
tokens/s (text and image rows of the samples; padding excluded) over the timed steps, samples,
padding fraction (transformers: the padded positions of its ``[B, Lmax]`` batches; mimo: those of
its packs), peak memory (GiB, from the model built to the last step), model TFLOP/s and MFU
against the rated dense peak (``mimo.training.flops``: the same count for both, ``model_flops``
over the timed samples; and against a measured 8192^3 bf16 matmul rate), first and last loss,
graphs torch.compile compiled during the timed steps. ``ratio`` = mimo's real tokens/s (its fastest
variant) over transformers' (its fastest configuration); ``ratios`` per mimo variant. Each side
runs after the other in this process (transformers first, every model freed before the next is
built). Prints one JSON line.

    python bench/native_vlm_step.py [--batch 4] [--steps 13] [--warmup 3] [--variants eager,compile]
    python bench/native_vlm_step.py --small --device cpu --steps 3 --warmup 1     # CPU smoke run, fp32
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import inspect
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llava_step  # noqa: E402  (compiled_graphs, matmul_rate, step_timer)

# nothing here comes from the Hub: an attention implementation that is not installed fails at once
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARCH = "Qwen3VLMoeForConditionalGeneration"
LR, BETAS, EPS = 1e-4, (0.9, 0.95), 1e-8  # mimo.training.bucket_optim.build_optimizers' AdamW
MEAN = STD = (0.5, 0.5, 0.5)  # Qwen3-VL's released processor

PRESETS = {
    "default": {
        "vision": dict(depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096, out_hidden_size=2048,
                       patch_size=16, temporal_patch_size=2, spatial_merge_size=2, deepstack_visual_indexes=[5, 11, 17],
                       num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh"),
        "text": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                     num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                     max_position_embeddings=8192, rms_norm_eps=1e-6),
        "mrope": [24, 20, 20], "rope_theta": 5e6, "vocab": 32000,
        # image sides (square root of the area) of one-image and of two-image samples; text tokens per sample
        "sides": (224, 1024), "two_sides": (224, 724), "text_tokens": (128, 512), "init": "hf",
    },
    "small": {
        "vision": dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=4,
                       temporal_patch_size=2, spatial_merge_size=2, deepstack_visual_indexes=[0, 1, 2],
                       num_position_embeddings=64, hidden_act="gelu_pytorch_tanh"),
        "text": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                     max_position_embeddings=1024, rms_norm_eps=1e-6),
        "mrope": [4, 2, 2], "rope_theta": 1e4, "vocab": 512,
        "sides": (16, 64), "two_sides": (16, 45), "text_tokens": (8, 48), "init": "verify",
    },
}
TEXT_ONLY, TWO_IMAGES, MAX_ASPECT = 0.1, 0.2, 2.5


def log(msg: str) -> None:
    print(f"[native_vlm_step] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the model


def token_ids(vocab: int) -> dict[str, int]:
    """Qwen's order at the top of the vocabulary: vision start / end, image pad, video pad."""
    return {"vision_start_token_id": vocab - 4, "vision_end_token_id": vocab - 3, "image_token_id": vocab - 2,
            "video_token_id": vocab - 1}


def hf_config(preset: dict, vocab: int):
    import transformers

    text = dict(preset["text"], vocab_size=vocab, tie_word_embeddings=False, mlp_only_layers=[], decoder_sparse_step=1,
                rope_parameters=dict(rope_type="default", rope_theta=preset["rope_theta"], mrope_section=list(preset["mrope"]),
                                     mrope_interleaved=True))
    return transformers.Qwen3VLMoeConfig(vision_config=dict(preset["vision"]), text_config=text, tie_word_embeddings=False,
                                         **token_ids(vocab))


def build_source(cfg, init: str, seed: int, device: torch.device, dtype: torch.dtype, out_dir: str) -> dict:
    """The model's weights: built with random weights (``init``), saved into ``out_dir`` by
    ``save_pretrained``; returns its state dict on the CPU (each transformers run loads it)."""
    import transformers

    from mimo.commands.verify_hf import _quiet, randomize_vlm_

    cls = getattr(transformers, ARCH)
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(copy.deepcopy(cfg), dtype=dtype)
    if init == "verify":  # (drawn on the CPU, copied to the model's device)
        randomize_vlm_(model, seed)
    with _quiet():
        model.save_pretrained(out_dir)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    del model
    _free(device)
    return state


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the samples


@dataclass
class Sample:
    tokens: list[int]
    images: list[np.ndarray] = field(default_factory=list)  # uint8 HWC, as drawn (native sizes)
    starts: list[int] = field(default_factory=list)  # each image's first pad position
    grids: list[tuple[int, int, int]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # LLM rows (pads) of each image

    def planned(self, i: int, key: str):
        from mimo.data.plan import PlannedSample

        return PlannedSample(i, len(self.tokens), len(self.images), {key: list(self.starts)},
                             {key: list(self.rows)}, {key: [list(g) for g in self.grids]})


def _side_pair(rng: np.random.Generator, lo: int, hi: int) -> tuple[int, int]:
    area = math.exp(rng.uniform(math.log(lo * lo), math.log(hi * hi)))
    aspect = math.exp(rng.uniform(-math.log(MAX_ASPECT), math.log(MAX_ASPECT)))  # width / height
    return max(1, round(math.sqrt(area / aspect))), max(1, round(math.sqrt(area * aspect)))


def make_samples(count: int, seed: int, preset: dict, spec, ids, vocab: int) -> list[Sample]:
    """The seeded stream (module doc)."""
    from mimo.compose.native_vlm import text_ids
    from mimo.data.native_images import image_grid

    rng = np.random.default_rng(seed)
    pool = text_ids(vocab, ids).numpy()
    lo_t, hi_t = preset["text_tokens"]
    out = []
    for _ in range(count):
        r = rng.random()
        n_img = 0 if r < TEXT_ONLY else 2 if r < TEXT_ONLY + TWO_IMAGES else 1
        lo, hi = preset["two_sides" if n_img == 2 else "sides"]
        images = [rng.integers(0, 256, (*_side_pair(rng, lo, hi), 3), dtype=np.uint8) for _ in range(n_img)]
        n_text = int(rng.integers(lo_t, hi_t + 1))
        cuts = sorted(int(c) for c in rng.integers(1, n_text, size=n_img))  # text before, between, after the images
        words = pool[rng.integers(0, len(pool), size=n_text)].tolist()
        segments = [words[a:b] for a, b in zip([0, *cuts], [*cuts, n_text])]
        s = Sample(list(segments[0]))
        for img, text in zip(images, segments[1:]):
            grid = image_grid(img.shape[0], img.shape[1], spec)
            rows = grid[0] * grid[1] * grid[2] // spec.merge**2
            s.tokens.append(ids.start)
            s.starts.append(len(s.tokens))
            s.tokens += [ids.image] * rows + [ids.end] + text
            s.images.append(img)
            s.grids.append(grid)
            s.rows.append(rows)
        out.append(s)
    return out


# ---------------------------------------------------------------- the clock (both sides)


class OverBudget(RuntimeError):
    """A run stopped between two steps: its time was spent (``--budget-s``, ``--hf-budget-s``)."""


def timed_run(step_fn, steps: int, warmup: int, device: torch.device, deadline: float | None = None) -> dict:
    """Steps 1..steps of ``step_fn(step)`` (its result: a loss tensor or a StepResult), timing
    those after ``warmup`` back to back (each loss read after the last step, as
    ``bench/llava_step.py`` does); graphs compiled during the timed steps counted. Past
    ``deadline`` (``time.perf_counter()``), ``OverBudget`` after the step that ran over."""
    cuda = device.type == "cuda"
    mark, seconds = llava_step.step_timer(device)

    def loss(r) -> float:
        return float(r.loss if hasattr(r, "loss") else r)

    results, marks, warm = [], [], []
    graphs = llava_step.compiled_graphs()
    for step in range(1, steps + 1):
        t = time.perf_counter()
        if step == warmup + 1:
            graphs = llava_step.compiled_graphs()
        if step > warmup:
            marks.append(mark())
        results.append(step_fn(step))
        if step <= warmup:
            loss(results[-1])  # waits for the step
            warm.append(time.perf_counter() - t)
        if deadline is not None and step < steps and time.perf_counter() > deadline:
            raise OverBudget(f"stopped over its time budget after step {step} of {steps} (warm-up steps "
                             f"{[round(w, 1) for w in warm]} s)")
    marks.append(mark())
    if cuda:
        torch.cuda.synchronize(device)
    return {"times": [seconds(a, b) for a, b in zip(marks[:-1], marks[1:])], "warmup_s": warm,
            "losses": [loss(r) for r in results], "graphs": llava_step.compiled_graphs() - graphs,
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}


def summary(run: dict, real: int, computed: int, flops: float, rated: float | None, rate: float | None) -> dict:
    times = run["times"]
    total = sum(times)
    tflops = flops / total / 1e12
    return {"timed_steps": len(times), "step_s_median": statistics.median(times), "step_s_min": min(times),
            "step_s_max": max(times), "step_s_mean": total / len(times), "warmup_step_s": run["warmup_s"],
            "real_tokens": real, "computed_tokens": computed, "padding_fraction": 1 - real / computed if computed else 0.0,
            "real_tokens_per_s": real / total, "model_tflops_per_s": tflops, "mfu": tflops / rated if rated else None,
            "mfu_measured_rate": tflops / rate if rate else None, "peak_mem_gib": run["peak_mem_gib"],
            "loss_first": run["losses"][0], "loss_last": run["losses"][-1], "losses": run["losses"],
            "graphs_compiled_in_timed_steps": run["graphs"]}


# ---------------------------------------------------------------- transformers


def hf_batches(samples: list[Sample], steps: int, batch: int, spec, ids, pad_id: int, dtype: torch.dtype, pin: bool):
    """Each step's inputs on the host, as the processor hands them over (module doc)."""
    from mimo.commands.verify_hf import hf_inputs
    from mimo.compose.native_vlm import Visual, VLMSample
    from mimo.data.native_images import preprocess

    out = []
    for k in range(steps):
        chunk = samples[k * batch:(k + 1) * batch]
        vlm = []
        for s in chunk:
            visuals = []
            for img, grid in zip(s.images, s.grids):
                pixels, got = preprocess(img, spec)
                assert got == tuple(grid), (got, grid)
                visuals.append(Visual("image", pixels, got))
            vlm.append(VLMSample(list(s.tokens), visuals))
        inputs = hf_inputs(vlm, ids, pad_id)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        if pin:
            inputs = {k: v.pin_memory() for k, v in inputs.items()}
        out.append(inputs)
    return out


def run_hf(cfg, state: dict, batches: list[dict], attn: str, experts: str, device: torch.device, dtype: torch.dtype,
           steps: int, warmup: int, deadline: float | None = None) -> dict:
    """One transformers configuration: a fresh model with ``state``, AdamW, the timed steps."""
    import transformers

    cls = getattr(transformers, ARCH)
    kwargs = {"attn_implementation": attn, "experts_implementation": experts}
    with torch.device(device):
        try:
            model = cls._from_config(copy.deepcopy(cfg), dtype=dtype, **kwargs)
        except TypeError:  # a transformers without experts_implementation in _from_config: set below
            kwargs.pop("experts_implementation")
            model = cls._from_config(copy.deepcopy(cfg), dtype=dtype, **kwargs)
    model.load_state_dict(state)
    experts_set = 0
    for m in model.modules():  # the experts' own config: what their forward dispatches on (as the anchors set it)
        if hasattr(m, "_apply_gate") and hasattr(m, "config"):
            m.config._experts_implementation = experts
            experts_set += 1
    model.train()
    effective = {part: getattr(getattr(model.config, f"{part}_config", None), "_attn_implementation", None)
                 for part in ("text", "vision")}
    taken = [k for k in inspect.signature(model.forward).parameters]
    extra = {"use_cache": False} if "use_cache" in taken else {}
    if "output_router_logits" in taken:
        extra["output_router_logits"] = False
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=cuda or None,
                            foreach=None if cuda else True)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    def step(s: int):
        inputs = {k: v.to(device, non_blocking=True) for k, v in batches[s - 1].items() if k in taken}
        out = model(**inputs, **extra)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    try:
        run = timed_run(step, steps, warmup, device, deadline)
    finally:
        del model, opt
        _free(device)
    run["implementations"] = {"attn": attn, "experts": experts, "experts_modules_set": experts_set,
                              "attn_effective": effective}
    return run


def search_hf(cfg, state, batches, attns: list[str], experts: list[str], device, dtype, steps, warmup,
              budget_s: float | None = None, total_s: float | None = None) -> dict:
    """Every attention implementation with the first experts implementation, then the fastest
    attention with the others (every pair where no attention ran); {name: run or error}. Each
    configuration stops between steps past ``budget_s`` of its own wall time (model build
    included); none starts once the search has taken ``total_s``."""
    runs: dict[str, dict] = {}
    end = time.perf_counter() + total_s if total_s else None

    def one(a: str, e: str) -> None:
        name = f"{a}+{e}"
        t0 = time.perf_counter()
        if end is not None and t0 >= end:
            runs[name] = {"error": f"skipped: the search's time (--hf-budget-s {total_s:g}) is spent"}
            log(f"transformers {name}: skipped")
            return
        limits = [x for x in (end, t0 + budget_s if budget_s else None) if x is not None]
        deadline = min(limits) if limits else None
        log(f"transformers {name} ...")
        try:
            runs[name] = run_hf(cfg, state, batches, a, e, device, dtype, steps, warmup, deadline)
            log(f"transformers {name}: median step {statistics.median(runs[name]['times']):.4f} s")
        except Exception as err:  # noqa: BLE001 - one configuration that fails (not installed, out of memory) is reported
            runs[name] = {"error": f"{type(err).__name__}: {err}"[:1500]}
            log(f"transformers {name}: {runs[name]['error'][:200]}")
        runs[name]["wall_s"] = time.perf_counter() - t0
        _free(device)

    for a in attns:
        one(a, experts[0])
    ran = [n for n, r in runs.items() if "times" in r]
    firsts = [fastest_attn(runs, ran)] if ran else attns
    for e in experts[1:]:
        for a in firsts:
            one(a, e)
    return runs


def fastest_attn(runs: dict, names: list[str]) -> str:
    return min(names, key=lambda n: sum(runs[n]["times"])).split("+")[0]


# ---------------------------------------------------------------- mimo


class BenchPlan:
    """The data plan of the bench's stream: step ``s`` is one global microbatch, its samples."""

    def __init__(self, steps: list[list]):
        self.steps = steps

    def microbatch(self, k: int) -> list:
        return self.steps[k % len(self.steps)]

    def step(self, step: int, micro_batches: int) -> list[list]:
        return [self.microbatch((step - 1) * micro_batches + i) for i in range(micro_batches)]


class BenchReader:
    """Reads the bench's samples as ``mimo.data.pipeline.SampleReader`` reads shards: the tokens
    and targets, each image's rows and grid, and its uint8 patch rows (``patch_bytes``)."""

    def __init__(self, samples: list[Sample], feed, ids, pad_id: int):
        self.samples, self.feed, self.ids, self.pad_id = samples, feed, ids, pad_id

    def read(self, s):
        from mimo.data.native_images import patch_bytes
        from mimo.data.pack import PackItem
        from mimo.data.pipeline import ReadSample

        b, f = self.samples[s.id], self.feed
        target = [t != self.ids.image and t != self.ids.video for t in b.tokens]
        item = PackItem(s.id, list(b.tokens), target, {f.placeholder: list(b.starts)}, image_rows={f.placeholder: list(b.rows)},
                        image_grids={f.placeholder: [list(g) for g in b.grids]})
        rows = [patch_bytes(img, f.native, f.row_frames)[0] for img in b.images]
        pixels = torch.cat(rows) if rows else torch.zeros(0, f.numel, dtype=torch.uint8)
        return ReadSample(item, {f.name: pixels})


def mimo_config(path: str, preset: dict, spec, precision: str, steps: int, max_tokens: int, seed: int):
    """The mimo config of the directory's model: ``qwen3_vl_modules`` of its ``config.json``
    (both modules' ``init.hf``: the directory), images cut by ``spec``, world 1."""
    from mimo.commands.hf_qwen3_vl import qwen3_vl_modules
    from mimo.compose.config import config_from_dict
    from mimo.llm.hf import read_config_json

    modules = qwen3_vl_modules(read_config_json(os.path.join(path, "config.json")), path)
    modules["vision"]["image"] = {"min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels, "mean": list(spec.mean),
                                  "std": list(spec.std)}
    train = {"micro_batches": 1, "steps": steps, "lr": LR, "weight_decay": 0.0, "lr_schedule": "constant",
             "precision": precision, "grad_reduce": "bf16" if precision == "bf16-pure" else "fp32", "grad_clip": None,
             "compile": False, "seed": seed}
    # the samples come from the bench's plan and reader (no shards): data.source only passes validation
    data = {"source": "synthetic", "tokens_per_microbatch": max_tokens, "max_sample_tokens": max_tokens, "seed": seed}
    return config_from_dict({"world_size": 1, "modules": modules, "data": data, "train": train}, source="native_vlm_step")


def run_mimo(config, plan: BenchPlan, samples: list[Sample], ids, pad_id: int, device: torch.device, steps: int, warmup: int,
             variants: list[str], budget_s: float | None = None) -> dict:
    """Build the model, the pipeline over ``plan`` and the optimizers once; train steps
    1..steps for each variant in turn (``eager``: as built; ``compile``: then
    ``compile_blocks``), as ``bench/llava_step.py``'s run_mimo; a variant stops between steps
    past ``budget_s`` of its own wall time."""
    from mimo.compose.data_spec import text_spec
    from mimo.compose.inputs import encoder_feeds
    from mimo.compose.model import MimoModel
    from mimo.data.pipeline import DataPipeline
    from mimo.training.optim import model_optimizers
    from mimo.training.precision import PrecisionPolicy
    from mimo.training.run import compile_blocks
    from mimo.training.step import train_step

    policy = PrecisionPolicy.named(config.train.precision, config.train.grad_reduce)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = MimoModel(config, 0, device=device, dtype=policy.params)
    # decoded images travel as uint8 patch rows, normalised on the device (the shards' path)
    feeds = [dataclasses.replace(f, pixel_dtype=torch.uint8) for f in encoder_feeds(config, model.encoder_grids())]
    (feed,) = feeds
    reader = BenchReader(samples, feed, ids, pad_id)
    pipeline = DataPipeline(plan, text_spec(config), model.llm.grid, model.llm.ctx.sequence_parallel, feeds,
                            config.train.micro_batches, config.data.workers, config.data.prefetch, model.rank,
                            make_reader=lambda: reader, device=model.device, ahead=True, mrope=True,
                            schedule=config.train.schedule, encoder_prefetch=config.train.encoder_prefetch)
    pipeline.last_step = steps
    optimizers = model_optimizers(config, model, policy)
    build_s = time.perf_counter() - t0
    cuda = device.type == "cuda"

    seen = []  # per pipeline step: (seconds, real tokens, computed positions, image rows)
    deliver = pipeline.step

    def counted_step(step):
        t = time.perf_counter()
        mbs = deliver(step)
        seen.append((time.perf_counter() - t, sum(mb.plan.real_tokens for mb in mbs), sum(mb.pack.num_tokens for mb in mbs),
                     sum(int(v.numel()) for mb in mbs for v in mb.pack.image_slots.values())))
        return mbs

    pipeline.step = counted_step
    out, compiled = {}, False
    try:
        for n, variant in enumerate(variants):
            if variant == "compile" and not compiled:
                compile_blocks(model)
                compiled = True
            elif variant not in ("eager", "compile") or (variant == "eager" and compiled):
                raise SystemExit(f"unknown variant {variant!r} (eager, compile; eager before compile)")
            name = variant if variant not in out else f"{variant}#{n + 1}"
            seen.clear()
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            log(f"mimo {name} ...")
            deadline = time.perf_counter() + budget_s if budget_s else None
            try:
                run = timed_run(lambda s: train_step(model, pipeline, s, optimizers, policy), steps, warmup, device, deadline)
                timed = seen[warmup:]
                run.update(data_s_median=statistics.median(t for t, *_ in timed), real=sum(r for _, r, _, _ in timed),
                           computed=sum(c for *_, c, _ in timed), image_rows=sum(i for *_, i in timed))
                out[name] = run
                log(f"mimo {name}: median step {statistics.median(run['times']):.4f} s")
            except Exception as err:  # noqa: BLE001 - a variant that fails is reported, the others still run
                out[name] = {"error": f"{type(err).__name__}: {err}"[:1500]}
                log(f"mimo {name}: {out[name]['error'][:200]}")
            _free(device)  # (after the except block: a failed step's tensors are gone with its traceback)
    finally:
        pipeline.close()
        del model, optimizers, pipeline
        _free(device)
    return {"variants": out, "build_s": build_s, "policy": policy}


# ---------------------------------------------------------------- the bench


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a CPU-sized model (runs in seconds)")
    ap.add_argument("--batch", type=int, default=4, help="samples per step (both sides)")
    ap.add_argument("--steps", type=int, default=13, help="steps in all")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps")
    ap.add_argument("--seed", type=int, default=0, help="the samples' and the weights' seed")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the preset's, 32000 / 512)")
    ap.add_argument("--device", default=None, help="default: cuda if available")
    ap.add_argument("--precision", choices=["bf16-pure", "bf16", "fp32"], default=None,
                    help="mimo's train.precision (transformers: bf16 weights unless fp32); default bf16-pure on CUDA, fp32 on the CPU")
    ap.add_argument("--init", choices=["hf", "verify"], default=None,
                    help="random weights: transformers' init (hf) or verify-hf's randomize_vlm_ (verify); default: the preset's")
    ap.add_argument("--variants", default=None, help="mimo's, comma-separated, in turn on one model: eager, compile "
                    "(default: eager,compile on CUDA, eager on the CPU)")
    ap.add_argument("--hf-attn", default=None, help="transformers' attention implementations to try, comma-separated "
                    "(default: sdpa,flash_attention_2,flex_attention on CUDA, sdpa on the CPU)")
    ap.add_argument("--hf-experts", default=None, help="transformers' experts implementations to try, first one with "
                    "every attention (default: grouped_mm,eager on CUDA, eager on the CPU)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall seconds one transformers configuration or one "
                    "mimo variant may take (model build included for transformers'); past it, it stops between steps and "
                    "is reported as an error (default: 150 on CUDA, none on the CPU)")
    ap.add_argument("--hf-budget-s", type=float, default=None, help="wall seconds of transformers' whole search: no "
                    "configuration starts after it (default: 200 on CUDA, none on the CPU)")
    ap.add_argument("--no-hf", action="store_true", help="mimo only")
    ap.add_argument("--no-mimo", action="store_true", help="transformers only")
    ap.add_argument("--tmp-dir", default=None, help="where the model's safetensors are written (default: the system's)")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    if args.batch < 1:
        ap.error("--batch must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    import transformers

    from mimo.compose.data_spec import native_spec
    from mimo.compose.native_vlm import VisionTokenIds, text_ids
    from mimo.data.native_images import NativeImageSpec
    from mimo.training.flops import device_peak_flops, model_flops, param_counts

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    preset_name = "small" if args.small else "default"
    preset = PRESETS[preset_name]
    vocab = args.vocab or preset["vocab"]
    precision = args.precision or ("bf16-pure" if cuda else "fp32")
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    init = args.init or preset["init"]
    variants = (args.variants or ("eager,compile" if cuda else "eager")).split(",")
    attns = (args.hf_attn or ("sdpa,flash_attention_2,flex_attention" if cuda else "sdpa")).split(",")
    experts = (args.hf_experts or ("grouped_mm,eager" if cuda else "eager")).split(",")
    budget_s = args.budget_s if args.budget_s is not None else (150.0 if cuda else None)
    hf_budget_s = args.hf_budget_s if args.hf_budget_s is not None else (200.0 if cuda else None)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 stays fp32 on both sides

    cfg = hf_config(preset, vocab)
    ids = VisionTokenIds.from_hf_config(token_ids(vocab))
    pad_id = int(text_ids(vocab, ids)[0])  # a text token (padding carries no loss, is masked)
    v = preset["vision"]
    factor = v["patch_size"] * v["spatial_merge_size"]
    spec = NativeImageSpec(patch=v["patch_size"], temporal_patch=v["temporal_patch_size"], merge=v["spatial_merge_size"],
                           min_pixels=factor * factor, max_pixels=preset["sides"][1] ** 2, mean=MEAN, std=STD)
    samples = make_samples(args.steps * args.batch, args.seed, preset, spec, ids, vocab)
    steps_of = [list(range(k * args.batch, (k + 1) * args.batch)) for k in range(args.steps)]
    max_tokens = max(len(s.tokens) for s in samples) * args.batch

    rate = llava_step.matmul_rate(device)
    res: dict = {"bench": "native_vlm_step", "preset": preset_name, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                 "torch": torch.__version__, "transformers": transformers.__version__, "precision": precision,
                 "hf_dtype": str(dtype).removeprefix("torch."), "init": init, "batch": args.batch, "steps": args.steps,
                 "warmup": args.warmup, "seed": args.seed,
                 "model": {"vision": dict(v), "text": dict(preset["text"], vocab=vocab, mrope_section=preset["mrope"],
                                                              rope_theta=preset["rope_theta"])},
                 "matmul_tflops_measured": rate}
    with tempfile.TemporaryDirectory(prefix="native-vlm-step-", dir=args.tmp_dir) as tmp:
        t0 = time.perf_counter()
        log(f"building and saving the model ({preset_name}, vocab {vocab}, {init} init) into {tmp} ...")
        state = build_source(cfg, init, args.seed, device, dtype, tmp)
        res["source_build_s"] = time.perf_counter() - t0
        config = mimo_config(tmp, preset, spec, precision, args.steps, max_tokens, args.seed)
        enc = config.encoders["vision"]
        if native_spec(enc).image != spec:
            raise SystemExit(f"the config's image spec {native_spec(enc).image} is not the samples' {spec}")
        key = enc.placeholder
        planned = [samples[i].planned(i, key) for i in range(len(samples))]
        plan = BenchPlan([[planned[i] for i in idx] for idx in steps_of])
        timed_samples = [p for idx in steps_of[args.warmup:] for p in (planned[i] for i in idx)]
        counts = param_counts(config)
        flops = model_flops(config, timed_samples, counts)
        rated = device_peak_flops(device, precision)
        rated = rated / 1e12 if rated else None
        n_all = sum(t.numel() for t in state.values())
        res.update({
            "params_total": n_all, "params_llm_active": counts[config.llm_name],
            "params_vision": counts["vision"] + counts["vision.mergers"],
            "samples_timed": len(timed_samples), "images_timed": sum(p.images for p in timed_samples),
            "text_only_samples_timed": sum(p.images == 0 for p in timed_samples),
            "image_tokens_timed": sum(sum(p.image_rows[key]) for p in timed_samples),
            "real_tokens_timed": sum(p.tokens for p in timed_samples),
            "real_tokens_per_step": sum(p.tokens for p in timed_samples) / (args.steps - args.warmup),
            "sample_tokens_max": max(len(s.tokens) for s in samples),
            "model_tflop_per_step": flops / (args.steps - args.warmup) / 1e12, "peak_tflops_rated": rated,
        })

        # ---- transformers first (its models freed before mimo's is built)
        hf_best = None
        if not args.no_hf:
            batches = hf_batches(samples, args.steps, args.batch, spec, ids, pad_id, dtype, pin=cuda)
            real = sum(int(b["attention_mask"].sum()) for b in batches[args.warmup:])
            padded = sum(b["attention_mask"].numel() for b in batches[args.warmup:])
            image_rows = sum(int((b["input_ids"] == ids.image).sum()) for b in batches[args.warmup:])
            runs = search_hf(cfg, state, batches, attns, experts, device, dtype, args.steps, args.warmup, budget_s, hf_budget_s)
            del batches
            res["hf_runs"] = {}
            for name, r in runs.items():
                if "times" not in r:
                    res["hf_runs"][name] = r
                    continue
                res["hf_runs"][name] = dict(summary(r, real, padded, flops, rated, rate), **r["implementations"],
                                            image_tokens=image_rows, wall_s=r["wall_s"])
            ran = [n for n, r in res["hf_runs"].items() if "real_tokens_per_s" in r]
            if ran:
                hf_best = max(ran, key=lambda n: res["hf_runs"][n]["real_tokens_per_s"])
                res["hf"] = dict(res["hf_runs"][hf_best], config=hf_best)
        del state
        _free(device)

        # ---- mimo
        mimo_best = None
        if not args.no_mimo:
            got = run_mimo(config, plan, samples, ids, pad_id, device, args.steps, args.warmup, variants, budget_s)
            p = got["policy"]
            res["mimo_build_s"] = got["build_s"]
            res["mimo_policy"] = {"params": str(p.params), "compute": str(p.compute), "grad_reduce": str(p.grad_reduce),
                                  "optimizer_state": str(p.optimizer_state), "master_params": str(p.master_params)}
            res["mimo_variants"] = {}
            for name, r in got["variants"].items():
                if "times" not in r:
                    res["mimo_variants"][name] = r
                    continue
                res["mimo_variants"][name] = dict(summary(r, r["real"], r["computed"], flops, rated, rate),
                                                  image_tokens=r["image_rows"], data_s_median=r["data_s_median"])
            ran = [n for n, r in res["mimo_variants"].items() if "real_tokens_per_s" in r]
            if ran:
                mimo_best = max(ran, key=lambda n: res["mimo_variants"][n]["real_tokens_per_s"])
                res["mimo"] = dict(res["mimo_variants"][mimo_best], variant=mimo_best)

    if hf_best and mimo_best:
        hf = res["hf"]
        res["ratio"] = res["mimo"]["real_tokens_per_s"] / hf["real_tokens_per_s"]
        res["ratios"] = {n: r["real_tokens_per_s"] / hf["real_tokens_per_s"] for n, r in res["mimo_variants"].items()
                         if "real_tokens_per_s" in r}
        res["same_real_tokens"] = all(r["real_tokens"] == hf["real_tokens"] for r in res["mimo_variants"].values()
                                      if "real_tokens" in r)
        first = next(iter(res["mimo_variants"].values()))  # the first variant: step 1 from the same weights
        if "losses" in first:
            res["loss_step1"] = {"mimo": first["loss_first"], "hf": hf["loss_first"],
                                 "rel_diff": abs(first["loss_first"] - hf["loss_first"]) / abs(hf["loss_first"])}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
