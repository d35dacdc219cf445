"""DeepSeek sparse attention (DSA, DeepSeek-V3.2) over packed sequences (THD): the ``D`` layer
of the pattern (Megatron's symbol). MLA (``mimo.llm.mla``, its projections, RoPE, TP, SP and
weights unchanged) whose every query attends only to the ``index_topk`` keys of its sample's
causal prefix that a lightning indexer scores highest (all of them where the prefix is shorter).

The indexer (Hugging Face's ``DeepseekV32Indexer``), from the layer's normed input ``x`` and the
query latent ``ql = q_a_layernorm(q_a_proj(x))``::

    q_i = wq_b(ql)  [T, G, I]        k_i = LayerNorm(wk(x))  [T, I]      (G heads of I channels)
    RoPE (half-split pairs, not MLA's interleaved ones) on the first qk_rope_head_dim channels of each
    w   = weights_proj(x) * G^-0.5  [T, G]                                (fp32)
    I[t, s] = sum_g w[t, g] * relu(q_i[t, g] . k_i[s] * I^-0.5)         (fp32)

**FP8 scoring** (V3.2's ``fp8_index``): where the layer's products run in FP8 (``train.fp8``, the
layer not in ``bf16_layers``), the indexer's queries and keys are rotated by the normalised
Hadamard transform (orthogonal: the scores it leaves as they are) and rounded to e4m3 with one
scale per row (a token's head; a token's key), as DeepSeek's ``rotate_activation`` / ``act_quant``
do; the scores are those of the rounded values (their gradient taken straight through the
rounding). ``dsa_index_head_dim`` must then be a power of two.

Selection: per query the keys of its causal prefix ordered by ``I`` (ties to the earlier key:
a stable sort, the same on every layout; ``torch.topk``, which transformers calls, leaves ties
unordered, and the two agree wherever the top set has no tie at its edge), the first
``index_topk`` kept. The attention (scale, values, output projection as MLA's) then runs over
the kept keys only.

**Training the indexer** (``DSATrainConfig``; the V3.2 report). Its inputs are detached: only its
KL loss trains it, and it sends no gradient into the model. With p the main attention's
probabilities of a query summed over all heads (over TP too) and L1-normalised, detached, the
indexer's loss for that query is ``KL(p || softmax(I))`` over the keys attended: in the dense
warm-up (``warmup``: every causal key attended, nothing selected; the rest of the LLM frozen by
``mimo.compose.model``) all of the prefix, in the sparse stage the selected keys. Summed over real
queries, times ``kl_weight``, divided by the step's loss-token count as the MoE aux losses are, it
joins the objective through ``attach_loss`` (a training forward only); ``kl_sum`` keeps the
layer's last unscaled sum, and ``kl_acc`` the step's (a training forward's, not its recompute's),
which training reports as ``dsa/indexer_kl`` in metrics.jsonl (``step_kl``).

Layout. The indexer is replicated over TP and computed whole on every TP rank (under SP on the
gathered rows: its inputs are detached, so the gathers carry no gradient): each rank selects the
same keys and its indexer weights get the complete gradient (not partial over TP). Under CP the
indexer keys, like MLA's keys and values, are all-gathered (their gradients reduce-scattered back)
and each local chunk scores against its sample's prefix up to its own end (``CPChunks.key_rows``).
The sparse attention is exact and materialises each run's ``[heads, queries, keys]`` scores
(O(longest sample^2) memory per head): the reference path, on the CPU and the GPU alike. Not built:
the generation cache, FP8 index scoring, selective recompute of the core, a sparse kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mimo.core.errors import ConfigError, MimoError
from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext
from mimo.llm.mla import MLA, MLAConfig
from mimo.llm.router import attach_loss
from mimo.parallel.collectives import gather_seq
from mimo.parallel.context import ParallelContext
from mimo.parallel.fp8 import E4M3, quantize
from mimo.parallel.kernels import wide
from mimo.parallel.recompute import replaying

__all__ = ["IndexerConfig", "Indexer", "DSA", "build_dsa", "rope_half", "select_keys", "set_dsa_training", "dsa_layers",
           "step_kl", "hadamard", "fp8_rounded"]

INDEX_NORM_EPS = 1e-6  # the indexer's k_norm (Hugging Face builds nn.LayerNorm(head_dim, eps=1e-6))


@dataclass(frozen=True)
class IndexerConfig:
    hidden: int
    q_lora_rank: int
    heads: int
    head_dim: int
    topk: int
    rope_dim: int  # channels of each head that rotate (MLA's qk_rope_head_dim)

    @classmethod
    def from_arch(cls, arch: HybridArch) -> "IndexerConfig":
        need = ("mla_q_lora_rank", "dsa_index_topk", "dsa_index_heads", "dsa_index_head_dim")
        missing = [n for n in need if getattr(arch, n) is None]
        if missing:
            raise ConfigError(f"arch.{missing[0]}: DSA layers ('D') need {', '.join(f'arch.{n}' for n in missing)}")
        return cls(arch.hidden, arch.mla_q_lora_rank, arch.dsa_index_heads, arch.dsa_index_head_dim,
                   arch.dsa_index_topk, arch.mla_qk_rope_head_dim)


def rope_half(x_TGR: torch.Tensor, cos_TP: torch.Tensor, sin_TP: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout (channel i pairs with i + R/2, frequency i), as the indexer
    rotates (Hugging Face's ``apply_rotary_pos_emb``)."""
    cos, sin = cos_TP.to(x_TGR.dtype)[:, None, :], sin_TP.to(x_TGR.dtype)[:, None, :]
    x1, x2 = x_TGR.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class IndexNorm(nn.LayerNorm):
    """The indexer's key norm (a plain LayerNorm, replicated), initialised as the identity."""

    def param_init(self, name: str):
        value = 1.0 if name == "weight" else 0.0
        return lambda t, gen: t.fill_(value)


class Indexer(nn.Module):
    """The lightning indexer's weights (Hugging Face's names) and its projections (module doc);
    replicated over TP, plain (unsharded, in the run's precision, no adapters; FP8 only in its
    scores)."""

    def __init__(self, cfg: IndexerConfig):
        super().__init__()
        self.cfg = cfg
        g, i = cfg.heads, cfg.head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, g * i, bias=False)
        self.wk = nn.Linear(cfg.hidden, i, bias=False)
        self.k_norm = IndexNorm(i, eps=INDEX_NORM_EPS)
        self.weights_proj = nn.Linear(cfg.hidden, g, bias=False)

    def queries_keys(self, x_TD, ql_TQ, cos_TP, sin_TP, fp8: bool = False):
        """(queries ``[T, G, I]``, keys ``[T, I]``, head weights ``[T, G]``), fp32; ``fp8``: the
        queries and keys as FP8 scoring reads them (module doc)."""
        cfg, t = self.cfg, x_TD.shape[0]
        r = cfg.rope_dim
        q_TGI = self.wq_b(ql_TQ).view(t, cfg.heads, cfg.head_dim)
        k_T1I = self.k_norm(self.wk(x_TD))[:, None, :]
        q_TGI = torch.cat([rope_half(q_TGI[..., :r], cos_TP, sin_TP), q_TGI[..., r:]], dim=-1)
        k_TI = torch.cat([rope_half(k_T1I[..., :r], cos_TP, sin_TP), k_T1I[..., r:]], dim=-1)[:, 0]
        w_TG = F.linear(wide(x_TD), wide(self.weights_proj.weight)) * cfg.heads ** -0.5
        q_TGI, k_TI = wide(q_TGI), wide(k_TI)
        if fp8:
            h_II = hadamard(cfg.head_dim, q_TGI.device, q_TGI.dtype)
            q_TGI, k_TI = fp8_rounded(q_TGI @ h_II), fp8_rounded(k_TI @ h_II)
        return q_TGI, k_TI, w_TG


def hadamard(n: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The normalised ``n x n`` Hadamard matrix (Sylvester's; symmetric, orthogonal)."""
    if n < 1 or n & (n - 1):
        raise MimoError(f"arch.dsa_index_head_dim={n}: FP8 index scoring rotates each head by a Hadamard transform, "
                        f"which needs a power of two (DeepSeek-V3.2: 128)")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).to(device=device, dtype=dtype)


def fp8_rounded(x_NI: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e4m3 with one scale per row (its amax over the last dim to 448), back in
    ``x``'s dtype; the gradient passes straight through the rounding."""
    q, inv = quantize(x_NI.detach(), E4M3, x_NI.detach().abs().amax(-1, keepdim=True).float())
    return x_NI + ((q.float() * inv).to(x_NI.dtype) - x_NI).detach()


def index_scores(q_LGI, k_KI, w_LG, scale: float) -> torch.Tensor:
    """``[L, K]``: ``sum_g w[l, g] * relu(q[l, g] . k[k] * scale)``."""
    return torch.einsum("lg,lgk->lk", w_LG, F.relu(torch.einsum("lgi,ki->lgk", q_LGI, k_KI) * scale))


def select_keys(scores_LK: torch.Tensor, allowed_LK: torch.Tensor, topk: int) -> torch.Tensor:
    """``[L, K]`` bool: each query's ``topk`` allowed keys of highest score (all of them where it
    has fewer), ties to the lower key index."""
    masked = scores_LK.detach().masked_fill(~allowed_LK, float("-inf"))
    n = min(topk, masked.shape[-1])
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :n]
    return torch.zeros_like(allowed_LK).scatter(1, order, True) & allowed_LK


class DSA(MLA):
    """``forward(h_TD, seq) -> h_TD`` (see module doc); MLA's weights plus ``indexer.*``."""

    def __init__(self, cfg: MLAConfig, icfg: IndexerConfig, ctx: ParallelContext | None = None, impl: str = "auto"):
        super().__init__(cfg, ctx, impl)
        if cfg.q_lora_rank is None:
            raise ConfigError("arch.mla_q_lora_rank: DSA layers ('D') read the query latent; set it")
        if icfg.head_dim < icfg.rope_dim:
            raise ConfigError(f"arch.dsa_index_head_dim={icfg.head_dim} is below mla_qk_rope_head_dim={icfg.rope_dim}")
        self.icfg = icfg
        self.indexer = Indexer(icfg)
        self.warmup = False  # the dense warm-up (set_dsa_training)
        self.fp8_index: bool | None = None  # FP8 index scoring; None: where the layer's products run in FP8
        self.kl_weight = 1.0
        self.kl_sum: torch.Tensor | None = None
        self.kl_acc = torch.zeros((), dtype=torch.float32)  # the step's KL sum (fp32 whatever the model's dtype)

    def forward(self, h_TD: torch.Tensor, seq: SeqContext) -> torch.Tensor:
        if seq.cache is not None:
            raise MimoError("DeepSeek sparse attention layers ('D') have no generation cache: generation is not built "
                            "for them")
        x_TD, ql_TQ, q_TF, kv_TF, kr_TR = self.projections(h_TD)
        if self.ctx.sequence_parallel:  # the indexer runs on every row of the local sequence (module doc)
            group = self.o_proj.group
            x_TD, ql_TQ = (gather_seq(t.detach().contiguous(), group) for t in (x_TD, ql_TQ))
        cos_TP, sin_TP = self.rope_tables(seq.positions)  # (MLA's heads and the indexer rotate by the same)
        q_THE, k_THE, v_THV = self.heads(q_TF, kv_TF, kr_TR, seq, (cos_TP, sin_TP))
        fp8 = self.fp8_index
        if fp8 is None:  # as the layer's products: FP8 under train.fp8 (bf16_layers aside)
            fp8 = getattr(self.q_b_proj.recipe, "kind", "default") != "default"
        iq_TGI, ik_TI, w_TG = self.indexer.queries_keys(x_TD.detach(), ql_TQ.detach(), cos_TP, sin_TP, fp8)
        train = self.training and seq.loss_norm is not None
        o_THV, kl = self._sparse_attention(q_THE, k_THE, v_THV, iq_TGI, ik_TI, w_TG, seq, train)
        o_TF = o_THV.reshape(o_THV.shape[0], -1)
        if kl is not None:
            self.kl_sum = kl.detach()
            if torch.is_grad_enabled() and not replaying():
                self.kl_acc = self.kl_acc.to(kl.device) + self.kl_sum.float()
            if self.kl_weight:
                o_TF = attach_loss(o_TF, kl * (self.kl_weight / seq.loss_norm))
        return h_TD + self.o_proj(o_TF)

    @staticmethod
    def _runs(seq: SeqContext):
        """(query rows, key rows into the keys attended, causal offset) of each segment: its own
        rows without CP; under CP a local chunk's rows and its sample's prefix in the gathered keys."""
        if seq.cp is None:
            cu = seq.cu_seqlens.tolist()
            return [(slice(s, e), slice(s, e), 0) for s, e in zip(cu[:-1], cu[1:]) if e > s]
        rows, cu_k, _ = seq.cp.key_rows
        cu_q, cu_kl = seq.cp.ends_host(), cu_k.tolist()
        return [(slice(qs, qe), rows[cu_kl[i]:cu_kl[i + 1]], (cu_kl[i + 1] - cu_kl[i]) - (qe - qs))
                for i, (qs, qe) in enumerate(zip(cu_q[:-1], cu_q[1:])) if qe > qs]

    def _sparse_attention(self, q_THE, k_THE, v_THV, iq_TGI, ik_TI, w_TG, seq: SeqContext, train: bool):
        """(output ``[T, heads_local, v]``, the indexer's KL summed over real queries or None)."""
        if seq.cp is not None:  # keys of every CP rank (gradients reduce-scattered back to their owners)
            k_THE, v_THV, ik_TI = (seq.cp.gather(x.contiguous()) for x in (k_THE, v_THV, ik_TI))
        real_T = seq.real_mask() if train else None
        iscale, scale = self.icfg.head_dim ** -0.5, self.softmax_scale
        outs, kls = [], []
        for qs, ks, off in self._runs(seq):
            q_LHE, k_KHE, v_KHV = q_THE[qs], k_THE[ks], v_THV[ks]
            lq, lk = q_LHE.shape[0], k_KHE.shape[0]
            allowed_LK = (torch.arange(lk, device=q_LHE.device)[None, :]
                          <= torch.arange(lq, device=q_LHE.device)[:, None] + off)
            scores_LK = index_scores(iq_TGI[qs], ik_TI[ks], w_TG[qs], iscale)
            keep_LK = allowed_LK if self.warmup else select_keys(scores_LK, allowed_LK, self.icfg.topk)
            s_HLK = torch.einsum("lhe,khe->hlk", q_LHE, k_KHE) * scale
            p_HLK = torch.softmax(wide(s_HLK).masked_fill(~keep_LK, float("-inf")), dim=-1).to(q_LHE.dtype)
            outs.append(torch.einsum("hlk,khv->lhv", p_HLK, v_KHV))
            if train:
                real_L = None if real_T is None else real_T[qs]
                kls.append(self._kl(p_HLK.detach(), scores_LK, keep_LK, real_L))
        # the runs tile the local sequence in order (padding is a trailing segment of its own)
        out = torch.cat(outs) if outs else q_THE.new_zeros(0, q_THE.shape[1], v_THV.shape[-1])
        return out, (torch.stack(kls).sum() if kls else None) if train else None

    def _kl(self, p_HLK, scores_LK, keep_LK, real_L) -> torch.Tensor:
        """``sum over queries of KL(p || softmax(scores))`` over the kept keys (module doc)."""
        target_LK = wide(p_HLK).sum(0)
        group = self.o_proj.group
        if self.ctx.tp_size > 1:  # every head of every TP rank
            dist.all_reduce(target_LK, group=group)
        target_LK = target_LK / target_LK.sum(-1, keepdim=True)
        logq_LK = torch.log_softmax(scores_LK.masked_fill(~keep_LK, float("-inf")), dim=-1)
        kl_LK = torch.where(keep_LK, torch.xlogy(target_LK, target_LK) - target_LK * logq_LK.clamp_min(-1e30), 0.0)
        kl_L = kl_LK.sum(-1)
        return kl_L.sum() if real_L is None else kl_L[real_L].sum()

    def extra_repr(self) -> str:
        c = self.icfg
        return (super().extra_repr() + f", index_heads={c.heads}, index_head_dim={c.head_dim}, index_topk={c.topk}, "
                f"warmup={self.warmup}")


def build_dsa(arch: HybridArch, spec, ctx: ParallelContext | None = None) -> DSA:
    """Builder of the ``"dsa"`` layer kind (``mimo.llm.blocks.PROVIDERS`` names it)."""
    return DSA(MLAConfig.from_arch(arch), IndexerConfig.from_arch(arch), ctx)


def set_dsa_training(module: nn.Module, warmup: bool, kl_weight: float) -> list[DSA]:
    """Set every DSA layer of ``module`` to the dense warm-up (``warmup``) or the sparse stage,
    with the KL weight; in the warm-up freeze every parameter but the indexers'. The layers."""
    layers = dsa_layers(module)
    for layer in layers:
        layer.warmup, layer.kl_weight = warmup, kl_weight
    if warmup and layers:
        for name, p in module.named_parameters():
            p.requires_grad_(".indexer." in f".{name}")
    return layers


def dsa_layers(module: nn.Module | None) -> list[DSA]:
    """Every DSA layer of ``module`` (none for None)."""
    return [] if module is None else [m for m in module.modules() if isinstance(m, DSA)]


def step_kl(layers: list[DSA], reset: bool = False) -> torch.Tensor:
    """The summed KL of the step's training forwards over ``layers`` (fp64 on the CPU, a device
    sync); ``reset``: zero the layers' accumulators instead (at a step's start) and return 0."""
    if reset:
        for layer in layers:
            layer.kl_acc = torch.zeros((), dtype=torch.float32)
        return torch.zeros((), dtype=torch.float64)
    return sum((layer.kl_acc.to("cpu", torch.float64) for layer in layers), torch.zeros((), dtype=torch.float64))
