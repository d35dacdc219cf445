"""Config of the hybrid LLM module (``kind: hybrid``): architecture, weights, layout.

Defaults that depend on other sizes are filled in by ``HybridArch.__post_init__``, so a built
config carries concrete numbers:

    kv_heads        = heads                      (plain multi-head attention)
    head_dim        = hidden // heads
    ffn             = 4 * hidden                 (MLP inner size)
    mamba_heads     = 2 * hidden // mamba_head_dim   (Mamba-2's expand factor 2)
    gdn_heads       = heads,  gdn_v_heads = gdn_heads
    gdn_head_dim    = head_dim, gdn_v_head_dim = gdn_head_dim
    qkv_bias, o_bias = attention_bias            (Llama: all four projections; Qwen2 sets
                                                  qkv_bias only, as Hugging Face does)

A default that does not come out whole (hidden not divisible by heads, ...) stays None and
``validate`` asks for it explicitly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from mimo.core.errors import ConfigError
from mimo.parallel.grid import ParallelConfig
from mimo.parallel.lora_config import LoraConfig
from mimo.llm.pattern import LayerPattern, LayerSpec, layer_costs, parse_pattern
from mimo.core.schema import at_least, join_path, tp_divides


@dataclass
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face's ``rope_parameters`` / ``rope_scaling``.

    ``linear`` divides every frequency by ``factor``; ``llama3`` (Llama 3.1+) scales only the
    low frequencies and blends the middle band (see ``mimo.llm.rope.inv_freq``); ``yarn``
    (DeepSeek-V3) blends interpolated and original frequencies over the band the ``beta_*``
    bounds give, scales cos / sin by ``attention_factor`` (default: from ``mscale`` /
    ``mscale_all_dim``) and MLA's softmax scale by ``mscale(factor, mscale_all_dim)^2``, as
    Hugging Face's ``_compute_yarn_parameters`` / ``yarn_apply_mscale`` (``mimo.llm.mla``; built
    for MLA layers, ``+``, only).
    """

    type: Literal["linear", "llama3", "yarn"]
    factor: float
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn: the ramp's bounds, in rotations over the original context
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn (also MLA's softmax scale)
    attention_factor: float | None = None  # yarn: cos / sin scale; None: from mscale / mscale_all_dim
    truncate: bool = True  # yarn: round the ramp's bounds outwards to whole dims

    def validate(self, path: str) -> list[str]:
        problems = [f"{join_path(path, n)}: must be > 0, got {getattr(self, n)}"
                    for n in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                              "beta_fast", "beta_slow")
                    if getattr(self, n) <= 0]
        problems += [f"{join_path(path, n)}: must be >= 0, got {getattr(self, n)}"
                     for n in ("mscale", "mscale_all_dim") if getattr(self, n) is not None and getattr(self, n) < 0]
        if self.attention_factor is not None and self.attention_factor <= 0:
            problems.append(f"{join_path(path, 'attention_factor')}: must be > 0, got {self.attention_factor}")
        if self.type == "llama3" and not problems and self.high_freq_factor <= self.low_freq_factor:
            problems.append(f"{join_path(path, 'high_freq_factor')}: must exceed low_freq_factor={self.low_freq_factor}")
        if self.type != "yarn":
            odd = [n for n in ("mscale", "mscale_all_dim", "attention_factor") if getattr(self, n) is not None]
            problems += [f"{join_path(path, n)}: a yarn field; rope_scaling type is {self.type!r}" for n in odd]
        return problems


@dataclass
class AuxLoss:
    """A Switch-style load-balancing loss ``E * sum_i f_i * P_i`` (``mimo.llm.router``)."""

    kind: Literal["none", "global", "per_sample"] = "none"
    coeff: float = 0.0

    def validate(self, path: str) -> list[str]:
        if self.coeff < 0:
            return [f"{join_path(path, 'coeff')}: must be >= 0, got {self.coeff}"]
        if self.kind != "none" and self.coeff == 0:
            return [f"{join_path(path, 'coeff')}: aux_loss kind {self.kind!r} needs coeff > 0 (or kind: none)"]
        return []


@dataclass
class MoEArch:
    """MoE layers (pattern symbol ``E``): router, routed experts, optional shared expert.

    ``mimo.llm.router`` (scores, top-k, groups, expert bias, quantile balancing, aux losses) and
    ``mimo.llm.experts`` (grouped-GEMM experts, shared expert, latent projections) say what each
    field does.
    """

    experts: int  # routed experts
    topk: int
    ffn: int  # expert inner size
    act: Literal["swiglu", "relu2", "gelu"] = "swiglu"
    shared_ffn: int = 0  # shared expert inner size, 0 = none
    shared_gate: bool = False  # sigmoid gate on the shared expert output (Qwen2-MoE)
    score: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk: bool = True  # renormalise the k gate values
    scale: float = 1.0  # routed scaling factor
    groups: int = 1  # group-limited routing: experts in this many groups ...
    group_topk: int = 1  # ... of which a token's experts come from the best group_topk
    expert_bias: bool = False  # aux-loss-free balancing: a bias for selection only
    bias_update_rate: float = 1.0e-3
    quantile_balancing: bool = False  # Megatron-Core 0.19's per-expert bias from load quantiles
    quantile_ema: float = 0.0
    aux_loss: AuxLoss = field(default_factory=AuxLoss)
    z_loss_coeff: float = 0.0
    latent: int = 0  # latent projection size around the experts (Nemotron-H), 0 = none
    # softmax scores before top-k (Qwen, OLMoE, Mixtral: the same top-k either way); the
    # renormalisation epsilon of Hugging Face's model (0: plain division, as Qwen and Mixtral)
    norm_eps: float = 0.0
    router_bias: bool = False  # a bias on the router logits (none of the supported families)

    def validate(self, path: str) -> list[str]:
        key = lambda name: join_path(path, name)  # noqa: E731
        problems = at_least(self, path, 1, "experts", "topk", "ffn", "groups", "group_topk")
        problems += at_least(self, path, 0, "shared_ffn", "latent")
        if problems:
            return problems
        e, k = self.experts, self.topk
        if k > e:
            problems.append(f"{key('topk')}: topk={k} exceeds experts={e}")
        if e % self.groups:
            problems.append(f"{key('groups')}: groups={self.groups} must divide experts={e}")
        elif self.group_topk > self.groups:
            problems.append(f"{key('group_topk')}: group_topk={self.group_topk} exceeds groups={self.groups}")
        elif self.groups > 1 and self.group_topk * (e // self.groups) < k:
            problems.append(
                f"{key('group_topk')}: group_topk * experts / groups = {self.group_topk} * {e // self.groups} "
                f"= {self.group_topk * e // self.groups} experts to choose from, fewer than topk={k}"
            )
        if self.groups > 1 and e // self.groups < 2:
            problems.append(f"{key('groups')}: group-limited routing ranks groups by their top-2 scores; "
                            f"each group needs at least 2 experts, got {e // self.groups}")
        for name in ("bias_update_rate", "z_loss_coeff", "norm_eps"):
            if getattr(self, name) < 0:
                problems.append(f"{key(name)}: must be >= 0, got {getattr(self, name)}")
        if self.scale <= 0:
            problems.append(f"{key('scale')}: must be > 0, got {self.scale}")
        if not 0.0 <= self.quantile_ema < 1.0:
            problems.append(f"{key('quantile_ema')}: must be in [0, 1), got {self.quantile_ema}")
        if self.quantile_balancing:
            if self.aux_loss.kind != "none":
                problems.append(f"{key('quantile_balancing')}: exclusive with aux losses (aux_loss.kind is {self.aux_loss.kind!r})")
            if self.groups > 1:
                problems.append(f"{key('quantile_balancing')}: exclusive with group-limited routing (groups={self.groups})")
            if self.expert_bias:
                problems.append(f"{key('quantile_balancing')}: exclusive with expert_bias (both steer selection with a per-expert bias)")
            if k >= e:
                problems.append(f"{key('quantile_balancing')}: needs topk < experts (it reads each token's (topk+1)-th score)")
        if self.shared_gate and not self.shared_ffn:
            problems.append(f"{key('shared_gate')}: needs a shared expert (shared_ffn > 0)")
        return problems

    @property
    def gated(self) -> bool:
        return self.act == "swiglu"

    def active_params(self, hidden: int) -> int:
        """Parameters one token uses in a layer of width ``hidden`` (router, its topk experts,
        shared expert and gate, latent projections): its FLOPs are 2 x that per token forward."""
        per_expert = (3 if self.gated else 2) * self.ffn * (self.latent or hidden)
        shared = (3 if self.gated else 2) * self.shared_ffn * hidden + (hidden if self.shared_gate else 0)
        return self.experts * hidden + self.topk * per_expert + shared + 2 * self.latent * hidden


@dataclass
class MTPArch:
    """Multi-token prediction (DeepSeek-V3's MTP modules; Qwen3-Next / Qwen3.5's ``mtp.*``), on the
    last pipeline stage (``mimo.llm.mtp``): depth k of ``depth`` predicts token t + 1 + k at
    position t from the previous depth's normed hidden state (the main model's, for k = 1) and the
    embedding of token t + k, through one block of the model's own layer kinds; the embedding and
    the head are the model's. Training adds ``loss_weight / depth`` times the depths' losses (each
    summed over its tokens and divided by the step's loss-token count, as the main loss is) to the
    objective; metrics report them apart (``mtp/loss``)."""

    depth: int = 1
    loss_weight: float = 0.1
    # each depth's block: layer symbols of the pattern (no '|'); None: attention, then MoE where
    # the main pattern has MoE layers, else an MLP (Qwen3-Next / Qwen3.5's MTP layer)
    pattern: str | None = None

    def block(self, arch: "HybridArch") -> str:
        """The layer symbols of one depth's block."""
        if self.pattern is not None:
            return self.pattern
        return "*E" if "E" in arch.pattern else "*-"

    def validate(self, path: str) -> list[str]:
        problems = at_least(self, path, 1, "depth")
        if self.loss_weight < 0:
            problems.append(f"{join_path(path, 'loss_weight')}: must be >= 0, got {self.loss_weight}")
        if self.pattern is None:
            return problems
        try:
            block = parse_pattern(self.pattern)
        except ConfigError as e:
            return problems + [f"{join_path(path, 'pattern')}: {p}" for p in e.problems]
        if block.explicit_stage_sizes is not None:
            problems.append(f"{join_path(path, 'pattern')}: an MTP block runs on the last stage; no '|'")
        elif not block.layers:
            problems.append(f"{join_path(path, 'pattern')}: an MTP block needs at least one layer")
        return problems


@dataclass
class HybridArch:
    pattern: str  # layer symbols, see mimo.llm.pattern
    hidden: int
    heads: int  # attention query heads
    vocab: int
    kv_heads: int | None = None
    head_dim: int | None = None
    ffn: int | None = None
    # gated SiLU (Llama, Qwen), squared ReLU (Nemotron-H), or plain GELU (erf)
    mlp_act: Literal["swiglu", "relu2", "gelu"] = "swiglu"
    mlp_bias: bool = False  # biases on the MLP projections (Llama's mlp_bias)
    qk_norm: bool = False  # RMSNorm on each query / key head (Qwen3)
    qk_norm_full: bool = False  # the QK-norm over all heads' q / k at once (OLMoE), not per head
    attention_bias: bool = False  # default of both flags below
    qkv_bias: bool | None = None  # biases of the q / k / v projections
    o_bias: bool | None = None  # bias of the attention output projection (added once, after TP)
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    init_std: float = 0.02  # std of weights at random init (output projections scaled down)
    norm_eps: float = 1e-5
    max_seq_len: int = 4096
    # Mamba-2 (M layers)
    mamba_heads: int | None = None
    mamba_head_dim: int = 64
    mamba_state: int = 128
    mamba_groups: int = 1  # groups of heads sharing B and C
    mamba_chunk: int = 128  # tokens per chunk of the torch SSD scan (speed / memory only, same function)
    mamba_dt_min: float = 0.0  # floor of softplus(dt) (Hugging Face Nemotron-H: time_step_limit[0]); 0: none
    # Gated DeltaNet (G layers)
    gdn_heads: int | None = None  # query / key heads
    gdn_v_heads: int | None = None  # value heads (a multiple of gdn_heads)
    gdn_head_dim: int | None = None
    gdn_v_head_dim: int | None = None
    gdn_chunk: int = 64  # tokens per chunk of the torch gated delta rule (speed / memory only)
    conv_kernel: int = 4  # short causal convolution of Mamba-2 and GDN
    # MoE (E layers)
    moe: MoEArch | None = None
    rope: bool = True  # false: attention without positions (Nemotron-H)
    # multimodal RoPE (Qwen3-VL, ``mimo.llm.mrope``): (time, height, width) frequency counts,
    # summing to head_dim / 2, interleaved as Qwen3-VL does; attention rotates by the pack's
    # ``positions_3d`` (``PackedBatch``). None: plain 1-D RoPE
    mrope_section: list[int] | None = None
    # deepstack (Qwen3-VL): level k of an image's multi-level features is added to its rows'
    # hidden states right after layer ``deepstack_layers[k]`` (an index into the pattern's
    # layers, ``layers.<i>``: Qwen3-VL adds after its decoder layer k, our MLP / MoE layer
    # 2k + 1). Strictly increasing, all on the first pipeline stage (where image rows arrive).
    deepstack_layers: list[int] = field(default_factory=list)
    # Qwen3-Next / Qwen3.5 layers (off by default: every other family's numbers unchanged).
    # Every RMSNorm of the LLM that those models make zero-centred (each layer's pre-norm, the
    # final norm, QK-norm) stores its weight as an offset from 1 and scales in fp32
    # (``mimo.llm.norm``); the gated norm inside GDN / Mamba-2 stays as it is
    norm_zero_centred: bool = False
    # gated attention: the q projection yields, per head, its query and as many gate channels
    # (stored interleaved per head, [q_h | g_h], as Hugging Face's q_proj); the attention output
    # is multiplied by sigmoid(gate) before o_proj
    attn_output_gate: bool = False
    # partial rotary (Hugging Face's partial_rotary_factor): only the first
    # int(head_dim * rotary_fraction) channels of each head rotate (M-RoPE sections then sum to
    # half of that), the rest pass through
    rotary_fraction: float = 1.0
    # multi-token prediction heads on the last stage (MTPArch); None: none
    mtp: MTPArch | None = None
    # multi-head latent attention (+ layers, DeepSeek-V3's MLA, ``mimo.llm.mla``; ``heads`` query
    # heads): queries from a low-rank latent of mla_q_lora_rank (None: one full projection), keys
    # and values from a latent of mla_kv_lora_rank plus one rotary key of mla_qk_rope_head_dim
    # shared by all heads; per head a key / query of qk_nope + qk_rope channels and a value of
    # mla_v_head_dim. Required (but q_lora_rank) where the pattern has '+'
    mla_q_lora_rank: int | None = None
    mla_kv_lora_rank: int | None = None
    mla_qk_rope_head_dim: int | None = None
    mla_qk_nope_head_dim: int | None = None
    mla_v_head_dim: int | None = None
    # DeepSeek sparse attention (D layers, DeepSeek-V3.2's DSA, ``mimo.llm.dsa``): MLA (the mla_*
    # fields, mla_q_lora_rank required) whose queries each attend to the dsa_index_topk keys a
    # lightning indexer of dsa_index_heads heads of dsa_index_head_dim channels scores highest
    dsa_index_topk: int | None = None
    dsa_index_heads: int | None = None
    dsa_index_head_dim: int | None = None

    MLA_REQUIRED = ("mla_kv_lora_rank", "mla_qk_rope_head_dim", "mla_qk_nope_head_dim", "mla_v_head_dim")
    MLA_DEEPSEEK_V3 = {"mla_q_lora_rank": 1536, "mla_kv_lora_rank": 512, "mla_qk_rope_head_dim": 64,
                       "mla_qk_nope_head_dim": 128, "mla_v_head_dim": 128}

    @property
    def rotary_dim(self) -> int | None:
        """Channels of each head that RoPE rotates (``int(head_dim * rotary_fraction)``, as Hugging Face)."""
        return None if self.head_dim is None else int(self.head_dim * self.rotary_fraction)

    def __post_init__(self) -> None:
        def whole(a: int, b: int) -> int | None:
            return a // b if b >= 1 and a % b == 0 else None

        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.head_dim is None:
            self.head_dim = whole(self.hidden, self.heads)
        if self.ffn is None:
            self.ffn = 4 * self.hidden
        if self.mamba_heads is None:
            self.mamba_heads = whole(2 * self.hidden, self.mamba_head_dim)
        if self.gdn_heads is None:
            self.gdn_heads = self.heads
        if self.gdn_v_heads is None:
            self.gdn_v_heads = self.gdn_heads
        if self.gdn_head_dim is None:
            self.gdn_head_dim = self.head_dim
        if self.gdn_v_head_dim is None:
            self.gdn_v_head_dim = self.gdn_head_dim
        if self.qkv_bias is None:
            self.qkv_bias = self.attention_bias
        if self.o_bias is None:
            self.o_bias = self.attention_bias

    def _mrope_problems(self, key) -> list[str]:
        sec = self.mrope_section
        if sec is None:
            return []
        dim, name = (self.head_dim, "head_dim") if self.rotary_fraction == 1.0 else (self.rotary_dim, "rotary_dim")
        half = dim // 2 if dim else None
        if (len(sec) != 3 or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in sec)
                or sum(sec) != half or dim % 2):
            return [f"{key('mrope_section')}: {list(sec)} must be three positive ints summing to {name} / 2 = "
                    f"{dim} / 2"]
        if not self.rope:
            return [f"{key('mrope_section')}: M-RoPE needs rope: true"]
        return []

    def _rotary_problems(self, key) -> list[str]:
        f = self.rotary_fraction
        if f == 1.0:
            return []
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:
            return [f"{key('rotary_fraction')}: must be in (0, 1], got {f!r}"]
        if not self.rope:
            return [f"{key('rotary_fraction')}: partial rotary needs rope: true"]
        rd = self.rotary_dim
        if rd < 2 or rd % 2:
            return [f"{key('rotary_fraction')}: int(head_dim * rotary_fraction) = int({self.head_dim} * {f}) = {rd} "
                    f"rotary channels; must be even and >= 2"]
        return []

    @property
    def deepstack_levels(self) -> int:
        """Levels of multi-level image features (deepstack) beside the main rows: an image row
        reaches the first stage as ``hidden * (1 + deepstack_levels)`` columns."""
        return len(self.deepstack_layers)

    def layer_pattern(self) -> LayerPattern:
        """The parsed pattern (ConfigError if it is malformed), its automatic split costed by
        ``layer_costs``."""
        return parse_pattern(self.pattern, layer_costs(self))

    def mtp_layers(self) -> list[list[LayerSpec]]:
        """Each MTP depth's layers (``mtp.block``), numbered on after the pattern's: their global
        indices (``layers.<i>``) name no main layer; [] without MTP."""
        if self.mtp is None:
            return []
        kinds = [s.kind for s in parse_pattern(self.mtp.block(self)).layers]
        first = len(self.layer_pattern().layers)
        return [[LayerSpec(first + k * len(kinds) + j, kind) for j, kind in enumerate(kinds)] for k in range(self.mtp.depth)]

    def all_layers(self) -> list[LayerSpec]:
        """The pattern's layers, then each MTP depth's (``mtp_layers``)."""
        return [*self.layer_pattern().layers, *(s for depth in self.mtp_layers() for s in depth)]

    def validate(self, path: str) -> list[str]:
        key = lambda name: join_path(path, name)  # noqa: E731
        problems = at_least(
            self, path, 1, "hidden", "heads", "vocab", "max_seq_len",
            "mamba_head_dim", "mamba_state", "mamba_groups", "mamba_chunk", "gdn_chunk", "conv_kernel",
        )
        problems += [f"{key(n)}: must be > 0, got {getattr(self, n)}" for n in ("rope_theta", "norm_eps", "init_std") if getattr(self, n) <= 0]
        problems += [f"{key('mamba_dt_min')}: must be >= 0, got {self.mamba_dt_min}"] if self.mamba_dt_min < 0 else []
        if not problems:  # sizes that may be defaults derived from the ones above
            problems = at_least(
                self, path, 1, "kv_heads", "head_dim", "ffn",
                "mamba_heads", "gdn_heads", "gdn_v_heads", "gdn_head_dim", "gdn_v_head_dim",
            )
        try:
            kinds = self.layer_pattern().kinds
        except ConfigError as e:
            return problems + [f"{key('pattern')}: {p}" for p in e.problems]
        if problems:
            return problems
        # MLA layers have head sizes of their own: an MLA pattern without attention needs no head_dim
        # (an MTP block of its own kinds is checked too; its default block has attention)
        mla_only = kinds & {"mla", "dsa"} and "attention" not in kinds and (
            self.mtp is None or self.mtp.pattern is not None and "*" not in self.mtp.pattern)
        if self.head_dim is None and not mla_only:
            problems.append(f"{key('hidden')}: {self.hidden} is not divisible by heads={self.heads}; set head_dim explicitly")
        if self.heads % self.kv_heads:
            problems.append(f"{key('kv_heads')}: heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.qk_norm_full and not self.qk_norm:
            problems.append(f"{key('qk_norm_full')}: needs qk_norm: true")
        if self.head_dim is not None:  # (both about attention's heads)
            problems += self._rotary_problems(key)
            problems += self._mrope_problems(key)
        layers = len(self.layer_pattern().layers)
        ds = list(self.deepstack_layers)
        if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < layers for i in ds):
            problems.append(f"{key('deepstack_layers')}: {ds} must be layer indices 0..{layers - 1} of the pattern")
        elif any(b <= a for a, b in zip(ds, ds[1:])):
            problems.append(f"{key('deepstack_layers')}: {ds} must be strictly increasing (level k after layer k's index)")
        if self.mtp is not None and not self.mtp.validate(key("mtp")):  # (its own problems: validated on its own)
            kinds = kinds | {s.kind for depth in self.mtp_layers() for s in depth}
        if "moe" in kinds and self.moe is None:
            where = (f"'E' at position {self.pattern.index('E') + 1}" if "E" in self.pattern else "in arch.mtp's block")
            problems.append(f"{key('moe')}: the pattern has MoE layers ({where}); describe them under arch.moe")
        if "mamba" in kinds:
            if self.mamba_heads is None:
                problems.append(
                    f"{key('mamba_heads')}: the default 2*hidden/mamba_head_dim = 2*{self.hidden}/{self.mamba_head_dim} "
                    f"is not whole; set mamba_heads"
                )
            elif self.mamba_heads % self.mamba_groups:
                problems.append(f"{key('mamba_groups')}: mamba_heads={self.mamba_heads} must be a multiple of mamba_groups={self.mamba_groups}")
        if "gdn" in kinds:
            if self.gdn_head_dim is None:
                problems.append(f"{key('gdn_head_dim')}: no default (head_dim is not set); set gdn_head_dim")
            if self.gdn_v_heads % self.gdn_heads:
                problems.append(f"{key('gdn_v_heads')}: must be a multiple of gdn_heads={self.gdn_heads}, got {self.gdn_v_heads}")
        problems += self._mla_problems(path, kinds)
        return problems

    @property
    def mla_qk_head_dim(self) -> int | None:
        """Channels of each MLA query / key head: qk_nope + qk_rope."""
        if self.mla_qk_nope_head_dim is None or self.mla_qk_rope_head_dim is None:
            return None
        return self.mla_qk_nope_head_dim + self.mla_qk_rope_head_dim

    def _mla_problems(self, path: str, kinds: set[str]) -> list[str]:
        """The MLA fields where the pattern (or the MTP block) has '+' layers; yarn RoPE scaling,
        which only MLA layers build."""
        key = lambda name: join_path(path, name)  # noqa: E731
        problems = []
        s = self.rope_scaling  # (its own fields: RopeScaling.validate, which the config tree runs)
        if s is not None:
            if s.type == "yarn" and "attention" in kinds:
                problems.append(f"{key('rope_scaling')}: type yarn is built for MLA layers ('+') only; this pattern "
                                f"has attention layers ('*'): use linear / llama3 scaling, or '+' layers")
        if not kinds & {"mla", "dsa"}:
            return problems
        symbol = "+" if "mla" in kinds else "D"
        where = (f"'{symbol}' at position {self.pattern.index(symbol) + 1}" if symbol in self.pattern
                 else "in arch.mtp's block")
        missing = [n for n in self.MLA_REQUIRED if getattr(self, n) is None]
        if missing:
            example = ", ".join(f"{n}: {self.MLA_DEEPSEEK_V3[n]}" for n in missing)
            problems.append(f"{key(missing[0])}: the pattern has MLA layers ({where}); set {', '.join(missing)} "
                            f"(DeepSeek-V3: {example}; mla_q_lora_rank is optional, None: a full q projection)")
        problems += at_least(self, path, 1, "mla_q_lora_rank", *self.MLA_REQUIRED)
        rope = self.mla_qk_rope_head_dim
        if rope is not None and rope >= 1 and rope % 2:
            problems.append(f"{key('mla_qk_rope_head_dim')}: must be even (rotary pairs), got {rope}")
        if not self.rope:
            problems.append(f"{key('rope')}: MLA layers ({where}) rotate their rope channels; set rope: true")
        if self.mrope_section is not None:
            problems.append(f"{key('mrope_section')}: M-RoPE is not built for MLA layers ({where})")
        if "dsa" in kinds:
            problems += self._dsa_problems(path)
        return problems

    def _dsa_problems(self, path: str) -> list[str]:
        """The DSA fields where the pattern (or the MTP block) has 'D' layers."""
        key = lambda name: join_path(path, name)  # noqa: E731
        need = ("mla_q_lora_rank", "dsa_index_topk", "dsa_index_heads", "dsa_index_head_dim")
        missing = [n for n in need if getattr(self, n) is None]
        if missing:
            return [f"{key(missing[0])}: the pattern has DeepSeek sparse attention layers ('D'); set "
                    f"{', '.join(missing)} (DeepSeek-V3.2: mla_q_lora_rank: 1536, dsa_index_topk: 2048, "
                    f"dsa_index_heads: 64, dsa_index_head_dim: 128; the indexer reads the query latent)"]
        problems = at_least(self, path, 1, *need[1:])
        rope, dim = self.mla_qk_rope_head_dim, self.dsa_index_head_dim
        if rope is not None and dim >= 1 and dim < rope:
            problems.append(f"{key('dsa_index_head_dim')}: the indexer rotates mla_qk_rope_head_dim={rope} channels of "
                            f"each head; needs at least that many, got {dim}")
        return problems


@dataclass
class HybridInit:
    hf: str | None = None  # a Hugging Face checkpoint directory to import weights from

    def validate(self, path: str) -> list[str]:
        if self.hf is not None and not os.path.isdir(self.hf):
            return [f"{join_path(path, 'hf')}: no directory {self.hf!r}"]
        return []


@dataclass
class DSATrainConfig:
    """How DeepSeek sparse attention layers ('D') train (``mimo.llm.dsa``; DeepSeek-V3.2's report):
    ``warmup: true`` is the dense warm-up stage (every D layer attends to all its causal keys, only
    the lightning indexers train, on their KL loss; the rest of the LLM is frozen), false the
    sparse stage (top-k attention; the indexers on their KL over the selected keys, the rest on the
    LM loss). Run the warm-up, then the sparse stage from its checkpoint (``train.init_from``)."""

    warmup: bool = False
    kl_weight: float = 1.0  # the indexers' KL loss enters the objective times this, per loss token

    def validate(self, path: str) -> list[str]:
        return [] if self.kl_weight >= 0 else [f"{join_path(path, 'kl_weight')}: must be >= 0, got {self.kl_weight}"]


@dataclass
class LLMModuleConfig:
    kind: Literal["hybrid"]
    arch: HybridArch
    init: HybridInit = field(default_factory=HybridInit)
    freeze: bool = False  # true: the whole LLM is frozen (LLaVA stage 1 trains only projectors)
    lora: LoraConfig | None = None  # low-rank adapters train, every base weight frozen (mimo.parallel.lora)
    lr: float | None = None  # this module's AdamW learning rate (None: train.lr)
    weight_decay: float | None = None  # None: train.weight_decay
    # activation recompute of this module (mimo.parallel.recompute); None: train.recompute / recompute_layers
    recompute: Literal["none", "selective", "full"] | None = None
    recompute_layers: int | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dsa: DSATrainConfig = field(default_factory=DSATrainConfig)  # D layers' training stage

    @property
    def trains(self) -> bool:
        """Some part of it trains (it is not frozen whole)."""
        return not self.freeze

    def stages(self) -> list[tuple[LayerSpec, ...]]:
        """Layers of each pipeline stage."""
        return self.arch.layer_pattern().stages(self.parallel.pp)

    def validate(self, path: str) -> list[str]:
        arch, par = self.arch, self.parallel
        pkey = lambda name: join_path(path, "parallel", name)  # noqa: E731
        problems = []
        try:
            pattern = arch.layer_pattern()
        except ConfigError:
            return problems  # reported by HybridArch.validate
        problems += self._expert_layout_problems(pattern, pkey)
        if self.dsa.warmup and "dsa" not in pattern.kinds:
            problems.append(f"{join_path(path, 'dsa', 'warmup')}: the dense warm-up trains the indexers of DeepSeek sparse "
                            f"attention layers ('D'); the pattern {arch.pattern!r} has none")
        if self.dsa.warmup and (self.freeze or self.lora is not None):
            problems.append(f"{join_path(path, 'dsa', 'warmup')}: the warm-up trains the indexers only (the rest frozen); "
                            f"drop freeze / lora")
        if self.lora is not None:
            if self.freeze:
                problems.append(f"{join_path(path, 'lora')}: a frozen LLM (freeze: true) trains no adapters; drop one")
            if par.gtp > 1:
                problems.append(f"{join_path(path, 'lora')}: adapters on GTP-sharded weights are not built (parallel.gtp: 1)")
        if par.pp >= 1:
            try:
                first = {s.index for s in pattern.stages(par.pp)[0]}
            except ConfigError as e:
                problems += [f"{pkey('pp')}: {p}" for p in e.problems]
            else:
                late = [i for i in arch.deepstack_layers  # (indices outside the pattern: HybridArch.validate)
                        if isinstance(i, int) and 0 <= i < len(pattern.layers) and i not in first]
                if late:
                    problems.append(f"{pkey('pp')}: arch.deepstack_layers {late} lie beyond the first pipeline stage "
                                    f"(layers {min(first)}..{max(first)}); image rows arrive there only: put them on "
                                    f"it with '|' in arch.pattern")
        kinds = set(pattern.kinds)
        if arch.mtp is not None:
            if par.cp > 1:
                problems.append(f"{pkey('cp')}: arch.mtp runs with cp=1 only (its shifted tokens would cross the "
                                f"CP chunks); got cp={par.cp}")
            if not arch.mtp.validate(""):  # (else reported there)
                kinds |= {s.kind for depth in arch.mtp_layers() for s in depth}
        if par.tp >= 1:
            sizes = {"heads": arch.heads, "kv_heads": arch.kv_heads}
            if "mlp" in kinds:
                sizes["ffn"] = arch.ffn
            if "mamba" in kinds:
                sizes["mamba_heads"] = arch.mamba_heads
            if "gdn" in kinds:
                sizes.update(gdn_heads=arch.gdn_heads, gdn_v_heads=arch.gdn_v_heads)
            if "moe" in kinds and arch.moe is not None:
                if par.expert_tp == par.tp:  # else the experts' F splits over etp (checked there)
                    sizes["moe.ffn"] = arch.moe.ffn
                if arch.moe.shared_ffn:
                    sizes["moe.shared_ffn"] = arch.moe.shared_ffn
            problems += tp_divides(par.tp, sizes, pkey("tp"))
        if par.gtp > 1 and par.tp >= 1:
            problems += self._gtp_problems(pattern, pkey("gtp"))
            if arch.mtp is not None:
                problems.append(f"{pkey('gtp')}: arch.mtp is not built for gtp > 1 (its block's weights are not "
                                f"GTP-sharded); got gtp={par.gtp}")
        return problems

    def _gtp_problems(self, pattern: LayerPattern, key: str) -> list[str]:
        """GTP splits each large weight's output rows (every fused part on its own) over tp x gtp."""
        arch, n = self.arch, self.parallel.tp * self.parallel.gtp
        sizes = {"hidden": arch.hidden}
        if "attention" in pattern.kinds:
            sizes.update({"heads*head_dim": arch.heads * arch.head_dim, "kv_heads*head_dim": arch.kv_heads * arch.head_dim})
        if pattern.kinds & {"mla", "dsa"} and arch.mla_qk_head_dim is not None and arch.mla_v_head_dim is not None:
            sizes.update({"heads*mla_qk_head_dim": arch.heads * arch.mla_qk_head_dim,
                          "heads*(mla_qk_nope_head_dim+mla_v_head_dim)": arch.heads * (arch.mla_qk_nope_head_dim + arch.mla_v_head_dim)})
        if "mlp" in pattern.kinds:
            sizes["ffn"] = arch.ffn
        if "mamba" in pattern.kinds:
            sizes.update({"mamba_heads*mamba_head_dim": arch.mamba_heads * arch.mamba_head_dim,
                          "mamba_heads": arch.mamba_heads, "mamba_groups*mamba_state": arch.mamba_groups * arch.mamba_state})
        if "gdn" in pattern.kinds:
            sizes.update({"gdn_heads*gdn_head_dim": arch.gdn_heads * arch.gdn_head_dim,
                          "gdn_v_heads*gdn_v_head_dim": arch.gdn_v_heads * arch.gdn_v_head_dim, "gdn_v_heads": arch.gdn_v_heads})
        if "moe" in pattern.kinds and arch.moe is not None and arch.moe.shared_ffn:
            sizes["moe.shared_ffn"] = arch.moe.shared_ffn
        bad = [f"arch.{k}={v}" for k, v in sizes.items() if v and v % n]
        return [f"{key}: tp*gtp = {n} must divide {', '.join(bad)} (GTP splits each weight's output rows over "
                f"tp x gtp)"] if bad else []

    def expert_layout(self) -> tuple[int, int] | None:
        """``(etp, ep)`` of the experts' own view of the grid (parallel folding), or None where
        experts are laid out like the dense layers (no MoE layer, or ep = 1 and etp = tp)."""
        try:
            has_moe = "moe" in self.arch.layer_pattern().kinds
        except ConfigError:
            return None
        return (self.parallel.expert_tp, self.parallel.ep) if has_moe and self.parallel.folded else None

    def _expert_layout_problems(self, pattern: LayerPattern, pkey) -> list[str]:
        """ep / etp against the experts and the stage's ranks (numbers named)."""
        par, moe = self.parallel, self.arch.moe
        if min(par.tp, par.cp, par.dp, par.ep, par.expert_tp) < 1:
            return []  # reported by ParallelConfig.validate
        if "moe" not in pattern.kinds or moe is None:
            bad = [f"{pkey(n)}: {n}={getattr(par, n)} needs MoE layers ('E' in arch.pattern); this LLM has none"
                   for n in ("ep", "etp", "egtp")
                   if getattr(par, n) is not None and getattr(par, n) != (par.tp if n == "etp" else 1)]
            return bad
        problems = []
        if moe.experts >= 1 and moe.experts % par.ep:
            problems.append(f"{pkey('ep')}: ep={par.ep} must divide arch.moe.experts={moe.experts}")
        if par.expert_tp != par.tp and moe.ffn >= 1 and moe.ffn % par.expert_tp:  # etp = tp: the tp check says it
            problems.append(f"{pkey('etp')}: etp={par.expert_tp} must divide arch.moe.ffn={moe.ffn}")
        stage = par.tp * par.cp * par.replicas
        if stage % (par.expert_tp * par.ep):
            problems.append(f"{pkey('ep')}: etp*ep = {par.expert_tp}*{par.ep} = {par.expert_tp * par.ep} does not divide "
                            f"the {stage} ranks of a pipeline stage (tp*cp*dp = {par.tp}*{par.cp}*{par.replicas})")
        elif par.egtp > 1:  # egtp splits the experts' data replicas (edp) and each expert's output rows
            edp = stage // (par.expert_tp * par.ep)
            out = moe.latent or self.arch.hidden
            if edp % par.egtp:
                problems.append(f"{pkey('egtp')}: egtp={par.egtp} must divide the experts' {edp} data replicas "
                                f"(edp = tp*cp*dp / (etp*ep))")
            if moe.ffn % (par.expert_tp * par.egtp) or out % par.egtp:
                problems.append(f"{pkey('egtp')}: etp*egtp = {par.expert_tp * par.egtp} must divide arch.moe.ffn={moe.ffn} "
                                f"and egtp={par.egtp} the experts' output size {out}")
        return problems
