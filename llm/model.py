"""Pipeline stages of the hybrid LLM.

An ``LLMStage`` runs its slice of the pattern's layers on one rank's pack. The first stage
also owns the token embedding and the scatter of image rows into their slots, and *declares*
where it wants those rows (``image_placement``: docs/design.md §2, so bridges know nothing about
models). The last stage owns the final norm, the vocab-parallel head and the loss. Stages
never look at layer types: layers come from ``mimo.llm.blocks``.

Parameter names are layout-independent: ``embed.weight``, ``layers.<global index>.…``,
``norm.weight``, ``head.weight``. Random init draws every tensor from
``param_seed(seed, <its name>)``, so a model built at any TP / PP holds the same full weights.

A stage is built on the LLM's ``ParallelContext`` (``mimo.parallel.context``): its pipeline
coordinate is the stage index, its TP group and sequence parallelism go to every layer.
``LLMStage(arch)`` alone is the one-process model (the reference of every layout).

Tied embeddings: with one stage the head reads the embedding's weight. With several, the last
stage holds a copy (``head.weight``, whose canonical name is ``embed.weight``, initialised and
loaded identically); after backward ``sync_tied_grads`` all-reduces the two copies' gradients
over ``embedding_group`` (first and last stage ranks of one TP/CP/DP coordinate), so both
take the same optimizer step and stay equal.

Multi-token prediction (``arch.mtp``, ``mimo.llm.mtp``): the last stage also holds the MTP
depths; a training forward attaches their weighted losses to its logits (the objective), and
with several stages an untied model's last stage keeps a copy of the embedding for them, synced
as a tied head is (``embedding_copy``).

Multimodal positions and deepstack (Qwen3-VL): with ``arch.mrope_section`` attention rotates by
the pack's 3-D ``positions_3d`` (``PackedBatch``; ``mimo.data.positions``), carried to every layer in
the ``SeqContext``. With ``arch.deepstack_layers`` an image row may reach the first stage as
``hidden * (1 + levels)`` columns (docs/design.md §10: the main features, then each level's):
the main columns are scattered into the embeddings, level k's are added to the same slots right
after layer ``deepstack_layers[k]`` has run (Hugging Face's ``_deepstack_process``); those layers
must lie on the first stage (``LayoutError`` otherwise). Rows of ``hidden`` columns take no
deepstack add.

Activations: without sequence parallel, the hidden states between layers and stages are the
whole pack ``[T, D]`` (replicated over TP); with it, this rank's contiguous ``[T/tp, D]`` block
(the pack must already be padded to a multiple of tp, ``mimo.parallel.layout.PackLayout``).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from mimo.core.batch import PackedBatch
from mimo.core.errors import LayoutError
from mimo.llm.attention import document_block_mask, set_attention_kernel
from mimo.llm.blocks import build_layer
from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext
from mimo.llm.mtp import MTPHeads
from mimo.llm.norm import RMSNorm
from mimo.llm.router import attach_loss
from mimo.parallel import gemm
from mimo.parallel.collectives import copy_to_group, gather_along, gather_seq
from mimo.parallel.context import ParallelContext
from mimo.parallel.cross_entropy import vocab_parallel_cross_entropy
from mimo.parallel.grid import ParallelGrid
from mimo.parallel.init import param_seed
from mimo.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, vocab_parallel_lookup
from mimo.parallel.lora import LoraTarget
from mimo.parallel.layout import RunPlacement, SampleRuns, packed_runs
from mimo.parallel.params import ParamInfo, full_tensors, load_full_, main_grad, param_table
from mimo.parallel.recompute import checkpoint, set_block_recompute


class LLMStage(nn.Module):
    """This rank's stage of the LLM described by ``arch``, on ``ctx`` (default: the one-process
    model, ``ParallelContext.for_tp()``); see module doc. ``LayoutError`` if a layer of
    ``arch.deepstack_layers`` is not on the first pipeline stage (on every stage alike)."""

    def __init__(self, arch: HybridArch, ctx: ParallelContext | None = None, *, device=None, dtype=None):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        if not ctx.member:
            raise LayoutError(f"rank {ctx.rank} is not in the LLM's grid {ctx.grid!r}: it has no stage")
        stage, num_stages = ctx.pp_rank, ctx.pp_size
        self.arch, self.stage, self.num_stages = arch, stage, num_stages
        pattern = arch.layer_pattern()
        # one stage runs every layer, '|' or not: the one-process reference of any pattern
        self.specs = pattern.layers if num_stages == 1 else pattern.stages(num_stages)[stage]
        if arch.deepstack_layers:
            first = pattern.layers if num_stages == 1 else pattern.stages(num_stages)[0]
            late = [i for i in arch.deepstack_layers if i not in {s.index for s in first}]
            if late:
                raise LayoutError(f"arch.deepstack_layers {late} are not layers of the first pipeline stage "
                                  f"(layers {first[0].index}..{first[-1].index} of {len(pattern.layers)}); image "
                                  f"rows and their deepstack levels arrive there only")
        # layer index -> deepstack level added right after it (first stage)
        self.deepstack_after = {i: k for k, i in enumerate(arch.deepstack_layers)} if stage == 0 else {}
        self.tp_group, self.tp_size, self.tp_rank = ctx.tp, ctx.tp_size, ctx.tp_rank
        self.sequence_parallel = ctx.sequence_parallel
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.tied = arch.tie_embeddings
        self.compiled_loss = False  # train.compile: the cross entropy's row math as fused kernels
        self.flex_masks = False  # train.attention: flex (set_attention_kernel): context builds the block mask
        if self.is_first:
            self.embed = VocabParallelEmbedding(arch.vocab, arch.hidden, ctx)
        self.layers = nn.ModuleDict({str(s.index): build_layer(arch, s, ctx) for s in self.specs})
        if self.is_last:
            # under SP each rank normalises its own tokens: the norm weight's gradient is partial
            self.norm = RMSNorm(arch.hidden, arch.norm_eps, ctx, partial=ctx.sequence_parallel,
                                zero_centred=arch.norm_zero_centred)
            if not (self.tied and self.is_first):  # one stage, tied: the head reads embed.weight
                self.head = ColumnParallelLinear(arch.hidden, arch.vocab, bias=False, ctx=ctx, pad_out_features=True)
            if arch.mtp is not None:  # after the head: its heads read the embedding and the head
                self.mtp = MTPHeads(arch, ctx, own_embedding=not (self.is_first or self.tied))
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    # ---------------------------------------------------------------- parameters
    def canonical_name(self, name: str) -> str:
        """Layout-independent name of a parameter (the tied head copy is ``embed.weight``)."""
        if name == "mtp.embed.weight" or (self.tied and name == "head.weight"):
            return "embed.weight"
        return name

    def param_table(self) -> dict[str, ParamInfo]:
        return param_table(self, self.canonical_name)

    @torch.no_grad()
    def init_weights(self, seed: int, std: float | None = None) -> None:
        """TP/PP-invariant random init: each part from ``param_seed(seed, <its name>)``."""
        std = self.arch.init_std if std is None else std
        # projections into the residual stream: std / sqrt(#residual branches), one per layer
        # here (Megatron's std / sqrt(2 * num_layers) counts an attention + MLP block as two)
        out_std = std / math.sqrt(len(self.arch.layer_pattern().layers))
        if self.is_first:
            self.embed.init_weights(param_seed(seed, "embed"), std)
        for index, layer in self.layers.items():
            layer.init_weights(param_seed(seed, f"layers.{index}"), std, out_std)
        if self.is_last:
            self.norm.init_weights()
            if hasattr(self, "head"):
                self.head.init_weights(param_seed(seed, "embed" if self.tied else "head"), std)
            if hasattr(self, "mtp"):
                self.mtp.init_weights(seed, std, out_std, param_seed(seed, "embed"))

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full, unpadded parameters by canonical name (collective over the TP group)."""
        return full_tensors(self.param_table())

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradients by canonical name (collective over the TP group)."""
        return full_tensors(self.param_table(), grads=True)

    def load_full_(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load this rank's slices from full tensors by canonical name (local)."""
        load_full_(self.param_table(), state)

    def embedding_copy(self) -> nn.Parameter | None:
        """This stage's copy of an embedding that lives on the first and the last stage (a tied
        head, or the embedding MTP reads; else None)."""
        if self.num_stages == 1 or not (self.tied or self.arch.mtp is not None):
            return None
        if self.is_first:
            return self.embed.weight
        if not self.is_last:
            return None
        return self.head.weight if self.tied else self.mtp.embed.weight

    def set_recompute(self, mode: str, layers: int | None = None) -> None:
        """Activation recompute (``mimo.parallel.recompute``) for this stage's first ``layers``
        layers (all when None): ``full`` re-runs each one's forward in backward, ``selective``
        the memory-heavy cheap parts inside it, ``none`` nothing."""
        set_block_recompute(self.layers.values(), mode, layers)
        if hasattr(self, "mtp") and layers is None:  # (a count of layers counts the main ones)
            set_block_recompute(self.mtp.layers(), mode)

    def set_attention_kernel(self, kind: str) -> None:
        """``train.attention`` on every attention layer (``mimo.llm.attention.set_attention_kernel``);
        with ``flex``, ``context`` builds each pack's block mask, once for all of them."""
        self.flex_masks = set_attention_kernel(self, kind) > 0 and kind == "flex"

    # ---------------------------------------------------------------- inputs
    def local_len(self, batch: PackedBatch) -> int:
        t = batch.num_tokens
        if self.sequence_parallel:
            if t % self.tp_size:
                raise LayoutError(
                    f"sequence parallel needs the pack padded to a multiple of tp={self.tp_size}; got {t} positions"
                )
            return t // self.tp_size
        return t

    def context(self, batch: PackedBatch, loss_norm: float | None = None, cache=None) -> SeqContext:
        """What every layer sees of ``batch`` (under context parallelism: this rank's chunks,
        joined across the CP group by the sequence-mixing layers; ``cache``: a
        ``mimo.llm.cache.GenerationCache``, not under context parallelism). With ``flex_masks`` a
        plain forward's context carries the pack's block mask (none under CP or a cache: flex
        attention takes auto's path there)."""
        cp = None
        if batch.cp is not None:
            if cache is not None:
                raise LayoutError("greedy generation with a cache needs cp=1 (generate without one under context parallelism)")
            from mimo.llm.cp import CPChunks

            if batch.cp.cp != self.ctx.dense.size("cp"):
                raise LayoutError(f"a pack cut for cp={batch.cp.cp} on an LLM with cp={self.ctx.dense.size('cp')}")
            cp = CPChunks(batch.cp, self.ctx.cp, batch.tokens.device)
        seq = SeqContext(batch.cu_seqlens, batch.positions, batch.max_seqlen, batch.num_real_tokens, loss_norm, cp, cache,
                         positions_3d=batch.positions_3d if self.arch.mrope_section is not None else None)
        if self.flex_masks and cp is None and cache is None:
            seq.block_mask = document_block_mask(seq)
        return seq

    def image_placement(self, grid: ParallelGrid, samples: Sequence[tuple[int, Sequence[int]]],
                        blocks: Sequence[range], deepstack: bool = False) -> RunPlacement:
        """Where this stage wants the rows of one encoder, built by the one builder training's
        bridges use (``packed_runs``, through ``mimo.bridges.plan.image_bridge_plans``).

        ``samples[i] = (sequence length, positions of its rows)``; ``blocks``: the DP blocks.
        Rows land at their positions in the pack, on the TP rank holding that position under
        sequence parallel (replicated over TP otherwise); each rank's buffer is compact, its
        rows in the order of ``local_image_slots``. ``deepstack``: the encoder sends each row
        with its deepstack levels, ``hidden * (1 + arch.deepstack_levels)`` columns (module doc).
        """
        width = self.arch.hidden * (1 + (self.arch.deepstack_levels if deepstack else 0))
        return packed_runs(grid, SampleRuns.of_positions(samples), blocks, width, self.sequence_parallel)

    def local_image_slots(self, batch: PackedBatch, key: str) -> torch.Tensor:
        """Positions in this rank's hidden states where ``key``'s compact rows go (in row order);
        the same slots ``image_placement`` gives this rank."""
        slots = batch.image_slots[key]
        if not self.sequence_parallel:
            return slots
        n = self.local_len(batch)
        lo = self.tp_rank * n
        mine = (slots >= lo) & (slots < lo + n)
        return slots[mine] - lo

    def embed_tokens(self, batch: PackedBatch, image_rows: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Token embeddings with image rows scattered into their slots: ``[T_local, D]`` (of
        deepstack rows, their first ``hidden`` columns)."""
        return self._embed(batch, self._image_inputs(batch, image_rows, self.embed.weight.device))

    def _embed(self, batch: PackedBatch, inputs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        h_TD = self.embed(batch.tokens)
        for slots_R, rows_RW in inputs.values():
            h_TD = h_TD.index_copy(0, slots_R, rows_RW[:, : h_TD.shape[1]].to(h_TD.dtype))  # differentiable in both
        return h_TD

    def _image_inputs(self, batch: PackedBatch, image_rows: Mapping[str, torch.Tensor] | None,
                      device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per key: (this rank's slots, its rows), the rows' width checked: ``hidden``, or
        ``hidden * (1 + deepstack levels)``."""
        out, d = {}, self.arch.hidden
        widths = {d, d * (1 + self.arch.deepstack_levels)}
        for key, rows_RD in (image_rows or {}).items():
            slots_R = self.local_image_slots(batch, key).to(device)
            if rows_RD.dim() != 2 or rows_RD.shape[0] != slots_R.numel() or rows_RD.shape[1] not in widths:
                want = " or ".join(f"({slots_R.numel()}, {w})" for w in sorted(widths))
                raise LayoutError(f"image rows {key!r}: got {tuple(rows_RD.shape)}, this rank's slots need {want}")
            out[key] = (slots_R, rows_RD)
        return out

    # ---------------------------------------------------------------- compute
    def forward(self, batch: PackedBatch, hidden: torch.Tensor | None = None,
                image_rows: Mapping[str, torch.Tensor] | None = None, loss_norm: float | None = None,
                cache=None) -> torch.Tensor:
        """Hidden states ``[T_local, D]`` for the next stage, or, on the last stage, this rank's
        vocab-parallel logits ``[T, V_padded / tp]`` (see ``loss`` and ``gather_logits``).

        ``batch``: the rank's whole pack; ``hidden``: the previous stage's output (not on the
        first stage); ``image_rows``: per placeholder key, this rank's compact rows
        ``[R_local, D]`` in the order of ``local_image_slots`` (first stage only; with deepstack
        levels ``[R_local, D * (1 + levels)]``, module doc);
        ``loss_norm``: in a training forward, the step's loss-token count (MoE aux losses);
        ``cache``: greedy generation's ``mimo.llm.cache.GenerationCache`` of this stage (its
        first forward the prefill of the samples' prompts, then one decode step per forward).
        """
        t_local = self.local_len(batch)
        if self.is_first:
            if hidden is not None:
                raise ValueError("the first stage embeds tokens; it takes no hidden states")
            inputs = self._image_inputs(batch, image_rows, self.embed.weight.device)
            h_TD = self._embed(batch, inputs)
            # rows carrying deepstack levels: (slots, the levels' columns [R, levels * D])
            d = self.arch.hidden
            deepstack = [(slots_R, rows_RW[:, d:]) for slots_R, rows_RW in inputs.values()
                         if self.deepstack_after and rows_RW.shape[1] > d]
        else:
            if hidden is None or hidden.shape[0] != t_local:
                got = None if hidden is None else tuple(hidden.shape)
                raise LayoutError(f"stage {self.stage} needs hidden states [{t_local}, {self.arch.hidden}], got {got}")
            if image_rows:
                raise ValueError("only the first stage takes image rows")
            h_TD, deepstack = hidden, []
        seq = self.context(batch, loss_norm, cache)
        if cache is None:
            h_TD = self._layers(h_TD, seq, deepstack)
        else:
            cache.begin(batch)
            # compiled layers (train.compile) run eagerly: a decode step's shapes and the cache's
            # host-side lengths change every step, and each change would compile them again
            with torch.compiler.set_stance("force_eager"):
                h_TD = self._layers(h_TD, seq, deepstack)
            cache.end()
        if not self.is_last:
            return h_TD
        h_TD = self.norm(h_TD)
        logits_TV = self.logits(h_TD)
        if hasattr(self, "mtp") and self.training and loss_norm is not None and cache is None:
            # joins the objective through the logits' backward; the reported loss stays the main one
            logits_TV = attach_loss(logits_TV, self.mtp.objective(self.mtp_losses(h_TD, batch, seq), loss_norm))
        return logits_TV

    def mtp_losses(self, h_TD: torch.Tensor, batch: PackedBatch, seq: SeqContext | None = None) -> list[torch.Tensor]:
        """Each MTP depth's summed fp32 token losses on ``batch`` (``mimo.llm.mtp``), from the
        final-normed hidden states ``h_TD`` (last stage, ``arch.mtp``)."""
        seq = self.context(batch) if seq is None else seq
        return self.mtp.losses(h_TD, batch, seq, self._mtp_embed, self.logits, self.tp_group, self.compiled_loss)

    def _mtp_embed(self, tokens_T: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            return self.embed(tokens_T)
        if self.tied:  # the head's copy of the embedding, split as the embedding is
            return vocab_parallel_lookup(tokens_T, self.head.weight, self.arch.vocab, self.ctx, self.sequence_parallel)
        return self.mtp.embed(tokens_T)

    def _layers(self, h_TD: torch.Tensor, seq: SeqContext, deepstack=()) -> torch.Tensor:
        """The stage's layers; ``deepstack``: (slots, level rows ``[R, levels * D]``) added level
        by level right after the layers of ``deepstack_after``."""
        for index, layer in self.layers.items():
            h_TD = checkpoint(layer, h_TD, seq) if getattr(layer, "recompute_full", False) else layer(h_TD, seq)
            level = self.deepstack_after.get(int(index)) if deepstack else None
            if level is not None:
                d = h_TD.shape[1]
                for slots_R, levels_RW in deepstack:  # differentiable in both
                    h_TD = h_TD.index_add(0, slots_R, levels_RW[:, level * d:(level + 1) * d].to(h_TD.dtype))
        return h_TD

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "head"):
            return self.head(x_TD)
        # tied, single stage: the embedding's (vocab-padded, TP-split) weight is the head
        x_TD = gather_seq(x_TD, self.tp_group) if self.sequence_parallel else copy_to_group(x_TD, self.tp_group)
        return gemm.linear(x_TD, self.embed.weight, None, self.embed.recipe)

    def token_losses(self, logits_TV: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """fp32 per-token losses ``[T]`` (0 where the loss mask is off or the label < 0)."""
        return vocab_parallel_cross_entropy(logits_TV, batch.labels, self.tp_group, self.arch.vocab, batch.loss_mask,
                                            compiled=self.compiled_loss)

    def loss(self, logits_TV: torch.Tensor, batch: PackedBatch, num_loss_tokens: float | torch.Tensor) -> torch.Tensor:
        """Sum of this pack's token losses / ``num_loss_tokens``, the loss-token count over every
        DP rank and microbatch of the step (docs/design.md §2), so that summing gradients over them
        gives the per-token mean of the whole batch."""
        return self.token_losses(logits_TV, batch).sum() / num_loss_tokens

    def gather_logits(self, logits_TV: torch.Tensor) -> torch.Tensor:
        """Full logits ``[T, vocab]`` on every TP rank, padding stripped (for verification)."""
        return gather_along(logits_TV, -1, self.tp_group)[..., : self.arch.vocab]


def count_loss_tokens(batch: PackedBatch) -> int:
    """Tokens of a pack that count in the loss (loss mask on, label >= 0)."""
    return batch.num_loss_tokens


def build_stage(arch: HybridArch, ctx: ParallelContext, *, device=None, dtype=None) -> LLMStage | None:
    """The stage this rank runs on the LLM's context (grid dims tp, cp, dp, pp), or None on a
    rank outside the grid. Local: the context already holds its groups."""
    if not ctx.member:
        return None
    return LLMStage(arch, ctx, device=device, dtype=dtype)


def embedding_group(ctx: ParallelContext):
    """The group of the first and last pipeline stage ranks that share this rank's TP/CP/DP
    coordinates (tied embeddings), or None where there is nothing to sync.

    From the context's group registry: collective over the world the first time (every rank
    calls it at the same point; all such groups are requested in a fixed order). For pp = 2
    each pair is a PP group, and the registry hands out that very communicator. Keep the
    result; do not call it per step.
    """
    if ctx.pp_size == 1:
        return None
    pairs = [[ranks[0], ranks[-1]] for ranks in ctx.grid.partition("pp")]  # ordered by first rank
    return ctx.registry.partition(pairs, ctx.rank)


def sync_tied_grads(stage: LLMStage, group) -> None:
    """Sum the gradients of a tied embedding's first- and last-stage copies (after backward,
    before clipping and the optimizer step). A no-op where the stage holds no copy."""
    weight = stage.embedding_copy()
    if weight is None or group is None:
        return
    grad = main_grad(weight)  # the run's main gradient where training keeps one
    if grad is None:
        weight.grad = grad = torch.zeros_like(weight)
    dist.all_reduce(grad, group=group)  # in place: a main gradient stays in its buffer


# ``lora.targets`` of the LLM (paths under its stage, MTP blocks included), as the Hugging Face
# decoders lay their projections out: q, k, v, gate and up are separate there (an adapter each)
_LAYER = r"(.+\.)?layers\.\d+\."
LORA_TARGETS = {
    "q": LoraTarget(_LAYER + "qkv", (("q",),)),
    "k": LoraTarget(_LAYER + "qkv", (("k",),)),
    "v": LoraTarget(_LAYER + "qkv", (("v",),)),
    "o": LoraTarget(_LAYER + "o_proj"),
    "gate": LoraTarget(_LAYER + "up_proj", (("gate",),)),
    "up": LoraTarget(_LAYER + "up_proj", (("up",),)),
    "down": LoraTarget(_LAYER + "down_proj"),
    # multi-latent attention (+): the latents' down projections (replicated over TP) and the heads'
    # up projections (q_b_proj, or q_proj without a q latent); o is the "o" above
    "q_a": LoraTarget(_LAYER + r"q_a_proj", owner="MLA"),
    "q_b": LoraTarget(_LAYER + r"(q_b_proj|q_proj)", owner="MLA"),
    "kv_a": LoraTarget(_LAYER + r"kv_a_proj_with_mqa", owner="MLA"),
    "kv_b": LoraTarget(_LAYER + r"kv_b_proj", owner="MLA"),
    # the routed experts: an adapter per expert on its up (gate | up) and down projections
    "experts": LoraTarget(_LAYER + "experts", cls="GroupedExperts"),
    # the shared expert: as a dense MLP, an adapter each on gate, up and down
    "shared": LoraTarget(_LAYER + "shared", (("gate",), ("up",), ("down",)), cls="SharedExpert"),
    # Gated DeltaNet's fused input projection, one adapter per Qwen3.5 module: in_proj_qkv, _z, _b, _a
    "gdn_in": LoraTarget(_LAYER + "mixer", (("q", "k", "v"), ("z",), ("b",), ("a",)), cls="GatedDeltaNetMixer"),
    "gdn_out": LoraTarget(_LAYER + r"mixer\.out_proj", owner="GatedDeltaNetMixer"),
    # Mamba-2's input rows z | x | dt | B | C (two weights of ours), one adapter as Hugging Face's one in_proj
    "mamba_in": LoraTarget(_LAYER + "mixer", (("z", "x", "dt", "B", "C"),), cls="Mamba2Mixer"),
    "mamba_out": LoraTarget(_LAYER + r"mixer\.out_proj", owner="Mamba2Mixer"),
}
