"""Multi-token prediction (``arch.mtp``, ``mimo.llm.config.MTPArch``) on the last pipeline stage.

Depth k (1..D) predicts token t + 1 + k at position t (DeepSeek-V3's MTP modules; Qwen3-Next /
Qwen3.5's ``mtp.*`` weights):

    x_k = fc_k([norm_e_k(embed(token t + k)) | norm_h_k(h_{k-1})])     (Qwen's order: embedding first)
    h_k = norm_k(block_k(x_k))                                          (the model's own layer kinds)
    logits_k = head(h_k)

``h_0`` is the main model's final-normed hidden state (what its head reads). Everything stays
inside each sample of the pack: token t + k and label t + k exist only where t + k lies in t's
sample (else the pad token, and no loss), and the block's layers mix only within samples, so a
position never sees another sample. An image placeholder's token embeds as its token id (the
positions whose targets are image rows take no loss anyway).

The embedding and the head are the stage's: on the first stage its embedding; on a later one
the tied head's weight (same vocab split), or, untied, ``MTPHeads.embed``, a copy of the first
stage's embedding under the same canonical name (``embed.weight``) that ``sync_tied_grads``
keeps equal, as it does a tied head.

Parameters (canonical names): ``mtp.<k>.fc.weight`` [D, 2D], ``mtp.<k>.norm_embed.weight``,
``mtp.<k>.norm_hidden.weight``, ``mtp.<k>.norm.weight`` (zero-centred where the arch's norms
are) and the block's layers ``mtp.<k>.layers.<i>.…``, numbered on after the main pattern
(``HybridArch.mtp_layers``): a router's layer index names no main layer.

``losses`` gives each depth's summed token losses (fp32). In a training forward the stage
attaches ``loss_weight / D * sum_k losses_k / loss_norm`` to its output (``attach_loss``: the
objective, not the reported loss) and adds the detached sums to ``sums_K``, read once per step
for the metrics (``mtp/loss``) and zeroed with ``reset``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

from mimo.core.batch import PackedBatch
from mimo.llm.blocks import build_layer
from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext
from mimo.llm.norm import RMSNorm
from mimo.llm.ssm import segments
from mimo.parallel import gemm
from mimo.parallel.context import ParallelContext
from mimo.parallel.cross_entropy import vocab_parallel_cross_entropy
from mimo.parallel.init import param_seed
from mimo.parallel.layers import TPModule, VocabParallelEmbedding
from mimo.parallel.placement import ParamPlacement, replicated
from mimo.parallel.recompute import checkpoint

__all__ = ["MTPHeads", "MTPDepth", "shift_in_samples", "mtp_metrics"]


def shift_in_samples(x_T: torch.Tensor, k: int, cu_seqlens: torch.Tensor, fill) -> torch.Tensor:
    """``out[t] = x[t + k]`` where t + k lies in t's sample (segment of ``cu_seqlens``), else ``fill``."""
    t = x_T.shape[0]
    seg_T, _ = segments(cu_seqlens.to(x_T.device), t)
    src_T = torch.arange(t, device=x_T.device) + k
    inside_T = src_T < t
    src_T = src_T.clamp(max=t - 1)
    inside_T &= seg_T.index_select(0, src_T) == seg_T
    return torch.where(inside_T, x_T.index_select(0, src_T), torch.full_like(x_T, fill))


class _Fuse(TPModule):
    """``fc``: [embedding | hidden] (2D) -> D, replicated over TP (under sequence parallel each
    rank multiplies its own tokens: a partial weight gradient)."""

    def __init__(self, hidden: int, ctx: ParallelContext):
        super().__init__(ctx)
        self._placements = {"weight": replicated((hidden, 2 * hidden), partial=("tp",) if self.sequence_parallel else ())}
        self.weight = self._new_param(self._placements["weight"], None, None)

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    def forward(self, x_TC: torch.Tensor) -> torch.Tensor:
        return gemm.linear(x_TC, self.weight, None, self.recipe)


class MTPDepth(nn.Module):
    """One depth: its norms, ``fc``, block and output norm (module doc)."""

    def __init__(self, arch: HybridArch, specs, ctx: ParallelContext):
        super().__init__()
        d, partial, zc = arch.hidden, ctx.sequence_parallel, arch.norm_zero_centred
        self.norm_embed = RMSNorm(d, arch.norm_eps, ctx, partial=partial, zero_centred=zc)
        self.norm_hidden = RMSNorm(d, arch.norm_eps, ctx, partial=partial, zero_centred=zc)
        self.fc = _Fuse(d, ctx)
        self.layers = nn.ModuleDict({str(s.index): build_layer(arch, s, ctx) for s in specs})
        self.norm = RMSNorm(d, arch.norm_eps, ctx, partial=partial, zero_centred=zc)

    def forward(self, e_TD: torch.Tensor, h_TD: torch.Tensor, seq: SeqContext) -> torch.Tensor:
        x_TD = self.fc(torch.cat([self.norm_embed(e_TD), self.norm_hidden(h_TD)], dim=-1))
        for layer in self.layers.values():
            x_TD = checkpoint(layer, x_TD, seq) if getattr(layer, "recompute_full", False) else layer(x_TD, seq)
        return self.norm(x_TD)


class MTPHeads(nn.Module):
    """The depths of ``arch.mtp`` on the last stage (module doc). ``own_embedding``: this stage
    has neither the embedding nor a tied head, so it keeps a copy (``embed``)."""

    def __init__(self, arch: HybridArch, ctx: ParallelContext, own_embedding: bool):
        super().__init__()
        self.arch, self.cfg, self.ctx = arch, arch.mtp, ctx
        for k, specs in enumerate(arch.mtp_layers()):  # named mtp.<k>.…
            self.add_module(str(k), MTPDepth(arch, specs, ctx))
        if own_embedding:
            self.embed = VocabParallelEmbedding(arch.vocab, arch.hidden, ctx)
        # the step's summed token losses per depth (a plain attribute: a buffer would follow the
        # model's dtype); made on the first training forward
        self.sums_K: torch.Tensor | None = None

    @property
    def depths(self) -> list[MTPDepth]:
        return [self.get_submodule(str(k)) for k in range(self.cfg.depth)]

    @torch.no_grad()
    def init_weights(self, seed: int, std: float, out_std: float, embed_seed: int) -> None:
        for k, depth in enumerate(self.depths):
            for name in ("norm_embed", "norm_hidden", "norm"):
                getattr(depth, name).init_weights()
            depth.fc.init_weights(param_seed(seed, f"mtp.{k}.fc"), std)
            for index, layer in depth.layers.items():
                layer.init_weights(param_seed(seed, f"layers.{index}"), std, out_std)
        if hasattr(self, "embed"):
            self.embed.init_weights(embed_seed, std)

    def layers(self) -> list[nn.Module]:
        return [layer for depth in self.depths for layer in depth.layers.values()]

    def losses(self, h_TD: torch.Tensor, batch: PackedBatch, seq: SeqContext, embed: Callable, logits: Callable,
               tp_group, compiled: bool = False) -> list[torch.Tensor]:
        """Each depth's fp32 token losses, summed over the pack (module doc). ``h_TD``: the main
        model's final-normed hidden states; ``embed(tokens_T)``, ``logits(h_TD)``: the stage's."""
        out = []
        for k, depth in enumerate(self.depths, start=1):
            tokens_T = shift_in_samples(batch.tokens, k, batch.cu_seqlens, 0)
            labels_T = shift_in_samples(batch.labels, k, batch.cu_seqlens, -100)
            mask_T = shift_in_samples(batch.loss_mask, k, batch.cu_seqlens, False)
            h_TD = depth(embed(tokens_T), h_TD, seq)
            out.append(vocab_parallel_cross_entropy(logits(h_TD), labels_T, tp_group, self.arch.vocab, mask_T,
                                                    compiled=compiled).sum())
        return out

    def objective(self, losses: list[torch.Tensor], loss_norm: float | torch.Tensor) -> torch.Tensor:
        """What training adds to the loss (``loss_weight / depth * sum / loss_norm``); the detached
        sums go to ``sums_K``."""
        with torch.no_grad():
            sums_K = torch.stack([x.detach() for x in losses]).to(torch.float64)
            self.sums_K = sums_K if self.sums_K is None else self.sums_K + sums_K
        return torch.stack(losses).sum() * (self.cfg.loss_weight / self.cfg.depth) / loss_norm

    def reset(self) -> None:
        self.sums_K = None


def mtp_metrics(losses_K: torch.Tensor) -> dict[str, float]:
    """``mtp/loss`` (the depths' mean) and, with several depths, ``mtp/loss_depth<k>``, from
    each depth's loss of the step (its summed token losses over the step's loss-token count)."""
    per_K = [float(x) for x in losses_K]
    out = {"mtp/loss": math.fsum(per_K) / len(per_K)}
    if len(per_K) > 1:
        out.update({f"mtp/loss_depth{k}": v for k, v in enumerate(per_K, start=1)})
    return out
