"""The whole run's config: YAML -> overrides -> dataclasses -> every problem, before any process.

Each component owns its section's dataclass (``mimo.encoders.config``, ``mimo.llm.config``,
``mimo.parallel.grid.ParallelConfig``); this module adds the data and train sections and the checks
that span modules: rank ranges against the world and against each other, placeholders,
data sizes against the LLM. Relative paths in the config are relative to the working
directory of the process (as every command resolves them).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from mimo.data.config import DataConfig
from mimo.encoders.config import EncoderModuleConfig, KimiEncoderModuleConfig, NativeEncoderModuleConfig
from mimo.core.errors import ConfigError, LayoutError
from mimo.llm.config import LLMModuleConfig
from mimo.core.schema import apply_overrides, at_least, closest, convert, join_path, load_yaml, validate_tree

# kind: vit; the native-resolution kinds (mimo.encoders.config.NATIVE_TOWERS): qwen3_vl, kimi_k25
EncoderConfig = EncoderModuleConfig | NativeEncoderModuleConfig | KimiEncoderModuleConfig
ModuleConfig = EncoderModuleConfig | NativeEncoderModuleConfig | KimiEncoderModuleConfig | LLMModuleConfig

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


@dataclass
class CheckpointConfig:
    # None: <run dir>/checkpoints, the run dir being --run-dir or runs/<config file name>/ (see
    # config_from_dict); set: the run dir defaults to its parent
    dir: str | None = None
    every: int | None = None  # steps between checkpoints; None: only at the end of training
    keep: int | None = None  # how many recent checkpoints to keep; None: all
    # the step only snapshots the state (host copies); a thread per rank writes and commits it
    # while training goes on (mimo.training.async_save)
    async_save: bool = False

    def validate(self, path: str) -> list[str]:
        return at_least(self, path, 1, "every", "keep")


@dataclass
class WandbConfig:
    """Weights & Biases (``pip install mimo[wandb]``): ``mimo train`` logs metrics.jsonl's numbers there."""

    project: str
    entity: str | None = None
    name: str | None = None  # None: the run directory's name


@dataclass
class LogConfig:
    wandb: WandbConfig | None = None  # set: log to Weights & Biases too
    # the peak FLOP/s of one device (TFLOP/s) that mfu is measured against; None: a table of
    # datasheet dense peaks by GPU name (no mfu where the device is not in it, e.g. on CPU)
    peak_tflops: float | None = None

    def validate(self, path: str) -> list[str]:
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            return [f"{join_path(path, 'peak_tflops')}: must be > 0, got {self.peak_tflops}"]
        return []


@dataclass
class Fp8Config:
    """FP8 matrix products through the GEMM seam (``mimo.parallel.fp8``): every LLM layer's and
    vision block's linear and expert GEMMs; embeddings, LM head, patch embedding, projectors
    and routers stay in the run's precision. ``recipe``: tensorwise, rowwise, delayed, or
    blockwise (DeepSeek-V3's 1x128 activation / gradient tiles and 128x128 weight blocks)."""

    recipe: Literal["tensorwise", "rowwise", "delayed", "blockwise"] = "tensorwise"
    amax_history: int = 16  # delayed: steps of amax history whose max sets the scales
    # LLM layers kept in the run's precision: "first", "last", or global layer indices
    bf16_layers: list = field(default_factory=list)
    # each weight quantized once per optimizer step and kept (1 byte an element and its scales),
    # not in every product, microbatch and recompute; off under train.distributed_optimizer,
    # whose weights are still being gathered when the step begins
    cache_weights: bool = True
    # weight gradients in FP8 too (experts: scales per expert and column); false: in the
    # activations' dtype wherever the recipe keeps the input so (rowwise, blockwise, experts)
    wgrad: bool = True
    # the experts' grouped FP8 products: mimo's own, or torchao's (rowwise, CUDA, torchao installed;
    # its own quantization kernels, power-of-two scales, FP8 weight gradients, weights quantized per call)
    backend: Literal["mimo", "torchao"] = "mimo"

    def validate(self, path: str) -> list[str]:
        problems = at_least(self, path, 1, "amax_history")
        if self.backend == "torchao" and self.recipe != "rowwise":
            problems.append(f"{join_path(path, 'backend')}: torchao's grouped FP8 products scale row-wise; set "
                            f"{join_path(path, 'recipe')}: rowwise (got {self.recipe})")
        for item in self.bf16_layers:
            if item not in ("first", "last") and not (isinstance(item, int) and not isinstance(item, bool) and item >= 0):
                problems.append(f"{join_path(path, 'bf16_layers')}: items are 'first', 'last' or layer indices >= 0, got {item!r}")
        return problems

    def kept_layers(self, num_layers: int) -> set[int]:
        """Global indices of the LLM layers ``bf16_layers`` keeps out of FP8."""
        named = {"first": 0, "last": num_layers - 1}
        return {named[i] if i in named else i for i in self.bf16_layers if i in named or isinstance(i, int)}


@dataclass
class TrainConfig:
    micro_batches: int = 1  # global microbatches per step
    steps: int = 100
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    warmup_ratio: float | None = None  # warmup as a fraction of steps (rounded up), instead of warmup_steps
    # after warmup (mimo.training.optim.lr_at): cosine / linear decay to min_lr, constant, or
    # wsd (warmup-stable-decay: constant, then linear decay over the last decay_ratio of steps)
    lr_schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    min_lr: float | None = None  # the final lr at train.lr (a module's own lr ends at the same fraction); None: 10%
    decay_ratio: float = 0.1  # wsd: the fraction of steps that decays
    precision: Literal["fp32", "bf16", "bf16-pure"] = "fp32"
    # the dtype gradients accumulate over microbatches and are summed over DP in: fp32 (main
    # gradients beside bf16 weights), or bf16 (the weights' own .grad; 4 bytes a parameter less)
    grad_reduce: Literal["fp32", "bf16"] = "fp32"
    grad_clip: float | None = 1.0  # max global gradient norm; None: no clipping
    # a step whose loss or gradient norm is not finite: stop (the run ends with exit status 2 and
    # writes no checkpoint of it), or skip_step (no update; counted in metrics.jsonl's skipped_steps)
    on_nonfinite: Literal["stop", "skip_step"] = "stop"
    seed: int = 0  # parameter initialisation and dropout
    # "simple": every microbatch forward, then every backward; "1f1b": the tick-table pipeline
    # schedule of mimo.schedules (1F1B per LLM stage, encoders ahead by encoder_prefetch)
    schedule: Literal["simple", "1f1b"] = "1f1b"
    encoder_prefetch: int = 1  # microbatches whose encoder forward is done by stage 0's F(k) (1f1b)
    compile: bool = False  # torch.compile each LLM layer and vision block (fused elementwise work; GPU runs)
    # with compile: each vision block's forward and backward replayed as CUDA graphs (torch.compile's
    # reduce-overhead mode): no launch work on the host for the encoders. Their shapes repeat while
    # the image count does (each new count records its graphs once); GPU runs, encoders at tp 1
    cuda_graphs: bool = False
    grad_bucket_mb: float = 25.0  # DP gradient sums run in buckets of this many MiB, overlapping backward
    # activation recompute (mimo.parallel.recompute) of every module's first recompute_layers
    # layers of each pipeline stage (ViT blocks; None: all); modules.<name>.recompute overrides
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_layers: int | None = None
    # ZeRO-1 (mimo.training.bucket_optim): gradients reduce-scattered over each parameter's
    # data-parallel group (EDP for experts), each rank's AdamW on its shard, weights all-gathered
    distributed_optimizer: bool = False
    optimizer_offload: bool = False  # fp32 masters and moments in pinned host memory, the update on the host
    # MoE token dispatch where experts are folded (ep > 1 or etp != tp; mimo.llm.dispatch):
    # auto (alltoall for now), alltoall (all_to_all_single over EP, all-gather-v over ETP), deepep
    # (DeepEP's kernels: GPUs, bf16, etp 1)
    moe_dispatcher: Literal["auto", "alltoall", "deepep"] = "auto"
    # the kernel of the LLM's attention layers ('*') over packed samples (mimo.llm.attention): auto
    # (varlen where usable, else exact), varlen (flash attention over cu_seqlens: CUDA, bf16), exact
    # (one SDPA per sample, the reference), flex (compiled FlexAttention with a causal document mask
    # built once per pack; CUDA for training: torch's FlexAttention has no CPU backward). Under flex,
    # generation's cache runs auto's path; multi-latent attention ('+', 'D') always runs auto
    attention: Literal["auto", "varlen", "exact", "flex"] = "auto"
    fp8: Fp8Config | None = None  # set: FP8 GEMMs (mimo.parallel.fp8)
    trace_steps: list[int] = field(default_factory=list)  # steps whose per-rank event traces `mimo train` writes
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    # weights (not optimizer state or step) of a mimo checkpoint at the same layout to start a new
    # run from, e.g. LLaVA stage 2 from stage 1: a step-N folder, or a checkpoint folder (its latest)
    init_from: str | None = None

    def validate(self, path: str) -> list[str]:
        problems = at_least(self, path, 1, "micro_batches", "steps", "encoder_prefetch")
        problems += at_least(self, path, 0, "weight_decay", "warmup_steps")
        for name in ("lr", "grad_clip", "grad_bucket_mb"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                problems.append(f"{join_path(path, name)}: must be > 0, got {value}")
        problems += [f"{join_path(path, 'trace_steps')}: steps are 1-based, got {s}" for s in self.trace_steps if s < 1]
        if self.optimizer_offload and self.precision == "bf16-pure":  # (the distributed optimizer takes it)
            problems.append(f"{join_path(path, 'optimizer_offload')}: bf16-pure's optimizer state is not offloaded yet "
                            f"(train.precision: bf16, or no offload)")
        if self.grad_reduce == "bf16" and self.precision == "fp32":
            problems.append(f"{join_path(path, 'grad_reduce')}: bf16 gradients need bf16 weights; train.precision is fp32 "
                            f"(use bf16 or bf16-pure, or grad_reduce: fp32)")
        if self.grad_reduce == "bf16" and self.distributed_optimizer:
            problems.append(f"{join_path(path, 'grad_reduce')}: the distributed optimizer reduce-scatters into fp32 "
                            f"main-gradient shards (use grad_reduce: fp32)")
        if self.recompute_layers is not None and self.recompute_layers < 1:
            problems.append(f"{join_path(path, 'recompute_layers')}: must be >= 1 (or unset: all layers), got {self.recompute_layers}")
        if self.cuda_graphs and not self.compile:
            problems.append(f"{join_path(path, 'cuda_graphs')}: the graphs are torch.compile's; set train.compile: true too")
        return problems + self._lr_schedule_problems(path)

    @property
    def warmup(self) -> int:
        """Warmup steps: ``warmup_ratio`` of ``steps`` rounded up, else ``warmup_steps``."""
        return math.ceil(self.warmup_ratio * self.steps) if self.warmup_ratio is not None else self.warmup_steps

    @property
    def decay(self) -> int:
        """wsd's decaying steps: ``decay_ratio`` of ``steps`` rounded up (0 for the other schedules)."""
        return math.ceil(self.decay_ratio * self.steps) if self.lr_schedule == "wsd" else 0

    def _lr_schedule_problems(self, path: str) -> list[str]:
        problems = []
        if self.warmup_ratio is not None:
            if not 0 <= self.warmup_ratio < 1:
                problems.append(f"{join_path(path, 'warmup_ratio')}: must be in [0, 1), got {self.warmup_ratio}")
            if self.warmup_steps:
                problems.append(f"{join_path(path, 'warmup_ratio')}: set either warmup_steps or warmup_ratio, not both")
        if self.min_lr is not None and self.min_lr < 0:
            problems.append(f"{join_path(path, 'min_lr')}: must be >= 0, got {self.min_lr}")
        elif self.min_lr is not None and self.min_lr > self.lr > 0:
            problems.append(f"{join_path(path, 'min_lr')}: {self.min_lr} is more than {join_path(path, 'lr')}={self.lr}")
        if not 0 < self.decay_ratio <= 1:
            problems.append(f"{join_path(path, 'decay_ratio')}: must be in (0, 1], got {self.decay_ratio}")
        elif self.lr_schedule == "wsd" and self.steps >= 1 and not problems:
            if self.warmup + self.decay > self.steps:
                problems.append(f"{join_path(path, 'decay_ratio')}: {self.warmup} warmup and {self.decay} "
                                f"decay steps are more than {join_path(path, 'steps')}={self.steps}")
        return problems


@dataclass
class EvalConfig:
    """``mimo eval`` (and the end of ``mimo demo``): the held-out split and how much of it."""

    # held-out WebDataset shards (tokenized like data.shards); None: pass --shards. Checked by
    # mimo eval, not here: training does not need them
    shards: str | None = None
    samples: int | None = None  # the first N usable held-out samples in shard order; None: all
    every: int | None = None  # `mimo train` evaluates every N steps (metrics.jsonl lines with "eval": true)
    max_new_tokens: int = 16  # greedy generation stops here or at the end-of-turn token
    # greedy generation keeps a cache (attention K/V, Mamba-2 / GDN states): one prefill, then one
    # token per sample and step; false: every step runs the whole sequence again (cp > 1 always does)
    cache: bool = True

    def validate(self, path: str) -> list[str]:
        problems = at_least(self, path, 1, "samples", "max_new_tokens", "every")
        if self.every is not None and self.shards is None:
            problems.append(f"{join_path(path, 'every')}: evaluating during training needs {join_path(path, 'shards')}")
        return problems


def one_process_module(cfg):
    """A module's config at one process (every parallel size 1, ranks 0:1): its full shapes."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, tp=1, cp=1, dp=1, pp=1, ep=1, etp=1, gtp=1, egtp=1, ranks="0:1", sequence_parallel=False))


@dataclass
class MimoConfig:
    world_size: int
    modules: dict[str, ModuleConfig]
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    # ---- views ----
    def without_adapters(self) -> "MimoConfig":
        """The config with no module's ``lora`` section: what an import writes is the base."""
        out = copy.deepcopy(self)
        for module in out.modules.values():
            module.lora = None
        return out

    @property
    def llm_name(self) -> str:
        return next(name for name, m in self.modules.items() if isinstance(m, LLMModuleConfig))

    @property
    def llm(self) -> LLMModuleConfig:
        return self.modules[self.llm_name]

    @property
    def encoders(self) -> dict[str, EncoderConfig]:
        """Every encoder module, of any kind (``native``: a native-resolution one, ``kind: qwen3_vl`` or ``kimi_k25``)."""
        return {name: m for name, m in self.modules.items() if isinstance(m, (EncoderModuleConfig, NativeEncoderModuleConfig))}

    def trainable_problems(self) -> list[str]:
        """What keeps the commands that run the data path (``train``, ``verify-train``, ``eval``,
        ``generate``, ``inspect-data``, ``prepare-data``, ``check-config``'s data checks) from
        running this config: a native-resolution encoder (``kind: qwen3_vl``, ``kimi_k25``) fed by synthetic
        data, which draws fixed-size images only."""
        if self.data.source != "synthetic":
            return []
        return [f"modules.{name}: kind {enc.kind} (native resolution) cannot take data.source: synthetic (it draws "
                f"fixed-size images); use WebDataset shards (mimo make-demo-data writes some)"
                for name, enc in self.encoders.items() if enc.native]

    def require_trainable(self) -> None:
        """ConfigError with ``trainable_problems`` (one line per such encoder), if any."""
        problems = self.trainable_problems()
        if problems:
            raise ConfigError(problems)

    def synthetic_shape(self) -> tuple[int, tuple[int, int]]:
        """``source: synthetic``: (samples per microbatch, [lo, hi] text tokens), defaults resolved."""
        d, s = self.data, self.data.synthetic
        prefix = s.images_per_sample * sum(e.rows_per_image for e in self.encoders.values() if not e.native)
        lo, hi = s.text_tokens if s.text_tokens is not None else (1, d.max_sample_tokens - prefix)
        return s.samples_per_microbatch or max(1, d.tokens_per_microbatch // d.max_sample_tokens), (lo, hi)

    def _synthetic_problems(self) -> list[str]:
        d, s = self.data, self.data.synthetic
        prefix = s.images_per_sample * sum(e.rows_per_image for e in self.encoders.values() if not e.native)
        samples, (lo, hi) = self.synthetic_shape()
        if s.text_tokens is None and hi < 1:
            return [f"data.max_sample_tokens: {d.max_sample_tokens} leaves no room for text after {prefix} image rows "
                    f"per synthetic sample"]
        if prefix + hi > d.max_sample_tokens:
            return [f"data.synthetic.text_tokens: the longest sample ({prefix} image rows + {hi} text tokens) is more "
                    f"than data.max_sample_tokens={d.max_sample_tokens}"]
        if samples * (prefix + hi) > d.tokens_per_microbatch:
            return [f"data.synthetic.samples_per_microbatch: {samples} samples of up to {prefix + hi} tokens may exceed "
                    f"data.tokens_per_microbatch={d.tokens_per_microbatch}"]
        return []

    def recompute_for(self, name: str) -> tuple[str, int | None]:
        """(mode, first layers) of module ``name``'s activation recompute: its own setting, else train's."""
        module = self.modules[name]
        mode = module.recompute if module.recompute is not None else self.train.recompute
        layers = module.recompute_layers if module.recompute_layers is not None else self.train.recompute_layers
        return mode, layers

    def rank_range(self, name: str) -> range:
        return self.modules[name].parallel.rank_range(self.world_size)

    def layout_rows(self) -> list[dict[str, Any]]:
        """One row per module: module, kind, ranks, tp, cp, dp, pp, colocated_with, and
        ``experts`` (the MoE experts' etp, ep, edp where they are folded, else None)."""
        rows = []
        for name, module in self.modules.items():
            par, ranks = module.parallel, self.rank_range(name)
            folded = getattr(module, "expert_layout", lambda: None)()
            rows.append(
                {
                    "module": name,
                    "kind": module.kind,
                    "ranks": f"{ranks.start}:{ranks.stop}",
                    "tp": par.tp,
                    "cp": par.cp,
                    "dp": par.dp,
                    "pp": par.pp,
                    "colocated_with": [o for o in self.modules if o != name and self.rank_range(o) == ranks],
                    "experts": None if folded is None else {
                        "etp": folded[0], "ep": folded[1], "edp": par.tp * par.cp * par.replicas // (folded[0] * folded[1])},
                }
            )
            if par.gtp > 1:  # (only where used: the rows of other layouts stay as they were)
                rows[-1]["gtp"] = par.gtp
        return rows

    def as_dict(self) -> dict[str, Any]:
        """Plain data (defaults filled in), e.g. to record beside a checkpoint."""
        return dataclasses.asdict(self)

    # ---- checks spanning modules (each module checked itself already) ----
    def validate(self, path: str) -> list[str]:
        problems = at_least(self, path, 1, "world_size")
        for name, module in self.modules.items():
            if module.recompute_layers is not None and module.recompute_layers < 1:
                problems.append(f"{join_path(path, 'modules', name, 'recompute_layers')}: must be >= 1, got {module.recompute_layers}")
            for key in ("lr", "weight_decay"):
                value = getattr(module, key)
                if value is not None and (value < 0 or (key == "lr" and value == 0)):
                    problems.append(f"{join_path(path, 'modules', name, key)}: must be {'> 0' if key == 'lr' else '>= 0'}, got {value}")
        problems += self._module_set()
        if not problems:
            problems += self._rank_ranges()
        placeholders: dict[str, str] = {}
        for name, enc in self.encoders.items():
            other = placeholders.setdefault(enc.placeholder, name)
            if other != name:
                problems.append(
                    f"modules.{name}.placeholder: {enc.placeholder!r} is already the placeholder of "
                    f"modules.{other}; each encoder needs its own"
                )
        llms = [name for name, m in self.modules.items() if isinstance(m, LLMModuleConfig)]
        if self.data.source == "synthetic" and not problems:
            problems += self._synthetic_problems()
        if len(llms) == 1:
            max_len = self.modules[llms[0]].arch.max_seq_len
            if self.data.max_sample_tokens > max_len:
                problems.append(
                    f"data.max_sample_tokens: {self.data.max_sample_tokens} is more than "
                    f"modules.{llms[0]}.arch.max_seq_len={max_len}"
                )
            problems += self._tokenizer_problems(llms[0])
            problems += self._native_width_problems(llms[0])
            problems += self._dispatcher_problems(llms[0])
            problems += self._attention_problems(llms[0])
            problems += self._fp8_problems(llms[0])
        return problems + self._cuda_graph_problems()

    def _native_width_problems(self, llm: str) -> list[str]:
        """A native encoder's rows reach the LLM's first stage as they leave the tower: the main
        merger's ``out_hidden`` columns, then each deepstack level's; the LLM takes ``hidden``
        columns per level (its own, then one per ``arch.deepstack_layers`` entry)."""
        arch, problems = self.modules[llm].arch, []
        if not (isinstance(arch.hidden, int) and isinstance(arch.deepstack_layers, list)):
            return problems
        wants = arch.hidden * (1 + len(arch.deepstack_layers))
        for name, enc in self.encoders.items():
            if not enc.native or not isinstance(enc.arch.deepstack_layers, list):
                continue
            levels = len(enc.arch.deepstack_layers)
            if enc.arch.out_width != wants:
                problems.append(
                    f"modules.{name}.arch: the tower's rows are out_hidden * (1 + len(deepstack_layers)) = "
                    f"{enc.arch.out_hidden} * {1 + levels} = {enc.arch.out_width} wide, but modules.{llm}.arch takes "
                    f"hidden * (1 + len(deepstack_layers)) = {arch.hidden} * {1 + len(arch.deepstack_layers)} = {wants} "
                    f"(out_hidden must be the LLM's hidden, and both need as many deepstack levels)")
        merges = {name: enc.arch.spatial_merge for name, enc in self.encoders.items() if enc.native}
        if getattr(arch, "mrope_section", None) is not None and len(set(merges.values())) > 1:
            found = ", ".join(f"modules.{name}.arch.spatial_merge={m}" for name, m in merges.items())
            problems.append(f"modules: native-resolution encoders with different spatial merges ({found}) cannot share "
                            f"the M-RoPE LLM's 3-D positions (each pack places its images with one merge size): give "
                            f"them the same one")
        videos = [name for name, enc in self.encoders.items() if enc.native and enc.video is not None]
        if len(videos) > 1:
            problems.append(f"modules: {' and '.join(f'modules.{n}.video' for n in videos)}: one tower at most takes "
                            f"videos (each video file of a sample goes to one)")
        placeholders = {e.placeholder for e in self.encoders.values()}
        for name in videos:
            if self.encoders[name].video_placeholder in placeholders:
                problems.append(f"modules.{name}.video_placeholder: {self.encoders[name].video_placeholder!r} is an "
                                f"encoder's image placeholder; give videos a text of their own")
        return problems

    def _cuda_graph_problems(self) -> list[str]:
        """``train.cuda_graphs`` against the encoders' layouts: a graph replays its kernels as
        captured, so no TP collective may sit inside a block, and no recompute may run it a
        second time inside the backward."""
        if not self.train.cuda_graphs:
            return []
        problems = []
        for name, enc in self.encoders.items():
            if enc.native:
                problems.append(f"train.cuda_graphs: modules.{name} is a native-resolution tower: its input's shape changes "
                                f"with every microbatch's images, which a graph cannot replay (drop train.cuda_graphs)")
                continue
            if self.modules[name].parallel.tp > 1:
                problems.append(f"train.cuda_graphs: modules.{name}.parallel.tp > 1 puts TP collectives inside the vision "
                                f"blocks; graphs take encoders at tp 1 (set tp: 1, or drop train.cuda_graphs)")
            if self.recompute_for(name)[0] != "none":
                problems.append(f"train.cuda_graphs: modules.{name} recomputes its blocks in the backward; graphs take "
                                f"encoders without recompute (set modules.{name}.recompute: none, or drop train.cuda_graphs)")
        return problems

    def _fp8_problems(self, llm: str) -> list[str]:
        """``train.fp8`` against the layouts: GTP-gathered weights do not take FP8 products yet,
        and layer indices must exist."""
        if self.train.fp8 is None:
            return []
        problems = []
        for name, module in self.modules.items():
            for key in ("gtp", "egtp"):
                if getattr(module.parallel, key, 1) > 1:
                    problems.append(f"train.fp8: modules.{name}.parallel.{key} > 1 is not supported with FP8 GEMMs yet "
                                    f"(set {key}: 1, or drop train.fp8)")
        if self.train.fp8.backend == "torchao" and self.modules[llm].parallel.expert_tp > 1:
            problems.append(f"train.fp8.backend: torchao quantizes each rank's slice of the experts' inner dimension "
                            f"on its own, not as one process does (modules.{llm}: experts split {self.modules[llm].parallel.expert_tp} "
                            f"ways by tp / etp); use the mimo backend, or etp 1")
        layers = len(self.modules[llm].arch.layer_pattern().layers)
        bad = sorted(i for i in self.train.fp8.kept_layers(layers) if i >= layers)
        if bad:
            problems.append(f"train.fp8.bf16_layers: {bad} beyond the LLM's {layers} layers")
        arch, kept = self.modules[llm].arch, self.train.fp8.kept_layers(layers)
        dim = arch.dsa_index_head_dim
        if dim is not None and dim >= 1 and dim & (dim - 1) and any(
                s.kind == "dsa" and s.index not in kept for s in arch.layer_pattern().layers):
            problems.append(f"train.fp8: DSA layers score their indexer in FP8 after a Hadamard rotation, which needs "
                            f"modules.{llm}.arch.dsa_index_head_dim a power of two (got {dim}); or keep them in bf16 "
                            f"(train.fp8.bf16_layers)")
        return problems

    def _dispatcher_problems(self, llm: str) -> list[str]:
        """``train.moe_dispatcher: deepep`` against what DeepEP's kernels move (bf16 rows, no
        expert tensor parallelism inside EP)."""
        folded = self.modules[llm].expert_layout()
        if self.train.moe_dispatcher != "deepep" or folded is None:
            return []
        problems = []
        if folded[0] != 1:
            problems.append(f"train.moe_dispatcher: deepep needs modules.{llm}.parallel.etp = 1, got etp={folded[0]} "
                            f"(expert tensor parallelism inside EP runs with alltoall)")
        if self.train.precision == "fp32":
            problems.append("train.moe_dispatcher: deepep moves bf16 rows; train.precision is fp32 (use bf16, or alltoall)")
        return problems

    def _attention_problems(self, llm: str) -> list[str]:
        """``train.attention`` where the config alone shows it never runs: varlen's kernel takes
        bf16 only, and flex has no context-parallel path (CP would silently run another kernel)."""
        kind, problems = self.train.attention, []
        if kind == "varlen" and self.train.precision == "fp32":
            problems.append("train.attention: varlen (flash attention) takes bf16; train.precision is fp32 "
                            "(use bf16, or auto / exact / flex)")
        if kind == "flex" and self.modules[llm].parallel.cp > 1:
            problems.append(f"train.attention: flex has no context-parallel path; modules.{llm}.parallel.cp is "
                            f"{self.modules[llm].parallel.cp} (use auto, or cp: 1)")
        return problems

    def _tokenizer_problems(self, llm: str) -> list[str]:
        """The tokenizer against the LLM's vocab and the template (mimo.data.tokenizer)."""
        from mimo.data.tokenizer import config_tokenizer_problems

        if self.data.source != "webdataset":
            return []
        return config_tokenizer_problems(self.data.tokenizer, self.data.template, [e.placeholder for e in self.encoders.values()],
                                         self.modules[llm].arch.vocab, f"modules.{llm}.arch.vocab")

    def _module_set(self) -> list[str]:
        problems = [
            f"modules.{name}: module names must be letters, digits, '_' or '-' (they appear in key paths)"
            for name in self.modules
            if not _MODULE_NAME.match(name)
        ]
        llms = [name for name, m in self.modules.items() if isinstance(m, LLMModuleConfig)]
        if len(llms) != 1:
            found = ", ".join(llms) if llms else "none"
            problems.append(f"modules: needs exactly one LLM module (kind: hybrid); found {found}")
        return problems

    def _rank_ranges(self) -> list[str]:
        problems, ranges = [], {}
        for name, module in self.modules.items():
            par, key = module.parallel, f"modules.{name}.parallel"
            try:
                ranks = par.rank_range(self.world_size)
            except LayoutError:
                continue  # reported by ParallelConfig.validate
            if ranks.stop > self.world_size:
                problems.append(f"{key}.ranks: {par.ranks!r} exceeds world_size={self.world_size} (ranks 0:{self.world_size})")
                continue
            ranges[name] = ranks
            if min(par.tp, par.cp, par.dp, par.pp, par.gtp) >= 1 and par.size != len(ranks):
                where = f"ranks {par.ranks!r} hold" if par.ranks is not None else "the whole world (no parallel.ranks) holds"
                names, sizes = ("tp", "gtp", "cp", "dp", "pp") if par.gtp > 1 else ("tp", "cp", "dp", "pp"), []
                sizes = [str(getattr(par, n)) for n in names]
                problems.append(f"{key}: {'*'.join(names)} = {'*'.join(sizes)} = {par.size}, but {where} {len(ranks)} ranks")
        for (a, ra), (b, rb) in itertools.combinations(ranges.items(), 2):
            shared = set(ra) & set(rb)
            if shared and ra != rb:
                problems.append(
                    f"modules.{b}.parallel.ranks: {_show_range(rb)} partially overlaps modules.{a}.parallel.ranks "
                    f"{_show_range(ra)}; two modules share either all their ranks (colocated) or none"
                )
        used = set().union(*ranges.values()) if ranges else set()
        unused = [r for r in range(self.world_size) if r not in used]
        if unused and len(ranges) == len(self.modules):
            which = f"ranks {_compress(unused)} are" if len(unused) > 1 else f"rank {unused[0]} is"
            problems.append(
                f"world_size: {which} used by no module (world_size={self.world_size}); "
                f"shrink world_size or widen a module's parallel.ranks"
            )
        return problems


# ---------------------------------------------------------------- loading


def load_config(path: str | os.PathLike, overrides: Iterable[str] = (), run_dir: str | None = None) -> MimoConfig:
    """Read a YAML config, apply dotted ``key=value`` overrides, convert and validate it.

    Raises ConfigError listing every problem, each naming its key path. ``run_dir`` (``--run-dir``)
    is where an unset ``train.checkpoint.dir`` points (its ``checkpoints/``).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
    return config_from_dict(load_yaml(text, source=str(path)), overrides, source=str(path), run_dir=run_dir)


def config_from_dict(raw: Any, overrides: Iterable[str] = (), source: str = "config", run_dir: str | None = None) -> MimoConfig:
    """Like ``load_config`` for already-parsed YAML (``raw`` is not modified); ``source`` names
    the config file (its stem names the default run directory)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(raw).__name__}")
    raw = copy.deepcopy(raw)
    problems, overrides = _unknown_module_overrides(raw, list(overrides))
    problems += apply_overrides(raw, overrides, MimoConfig)
    config, more = convert(MimoConfig, raw)
    problems += more
    if config is not None:
        problems += validate_tree(config)
    if problems:
        raise ConfigError(problems)
    if config.train.checkpoint.dir is None:  # each run its own directory: never the working directory itself
        config.train.checkpoint.dir = os.path.join(run_dir or run_dir_for(source), "checkpoints")
    return config


def run_dir_for(config_path: str) -> str:
    """``runs/<config file name without .yaml>``, relative to the working directory."""
    return os.path.join("runs", os.path.splitext(os.path.basename(config_path))[0])


def _unknown_module_overrides(raw: dict, overrides: list[str]) -> tuple[list[str], list[str]]:
    """(problems, the other overrides): an override into a module the config does not have is a
    typo (``modules.vison.parallel.tp=2``), unless the line creates that module
    (``modules.NAME.kind=...`` or ``modules.NAME={...}``)."""
    modules = raw.get("modules") if isinstance(raw.get("modules"), dict) else {}
    keys = [text.partition("=")[0].strip().split(".") for text in overrides]
    created = {k[1] for k in keys if k[0] == "modules" and (len(k) == 2 or (len(k) == 3 and k[2] == "kind"))}
    problems, kept = [], []
    for text, k in zip(overrides, keys):
        if len(k) > 2 and k[0] == "modules" and k[1] not in modules and k[1] not in created:
            near = closest(k[1], [str(name) for name in modules])
            hint = f" — did you mean {near!r}?" if near else f" (the config's modules: {', '.join(map(str, modules)) or 'none'})"
            problems.append(f"override {text!r}: unknown module {k[1]!r}{hint}")
        else:
            kept.append(text)
    return problems, kept


def _show_range(r: range) -> str:
    return f"'{r.start}:{r.stop}'"


def _compress(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0:3, 5'."""
    parts = []
    for _, group in itertools.groupby(enumerate(ranks), key=lambda iv: iv[1] - iv[0]):
        run = [r for _, r in group]
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}:{run[-1] + 1}")
    return ", ".join(parts)

