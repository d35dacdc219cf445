"""FP8 matrix products behind the GEMM seam (``train.fp8``).

A module's ``recipe`` (``mimo.parallel.gemm.GemmRecipe``) of kind ``tensorwise``, ``rowwise``,
``delayed`` or ``blockwise`` makes ``gemm.linear`` / ``gemm.grouped_linear`` quantize both
operands of each product to float8 and multiply them with ``torch._scaled_mm`` /
``torch._scaled_grouped_mm``, accumulating in fp32 and writing the activations' dtype:

* ``tensorwise``: one scale per tensor from its current amax (amax / 448 for e4m3). Forward
  operands e4m3, the output gradient e5m2 (the "hybrid" format: gradients need range more than
  precision). The quantized input and weight are kept for backward (half the bytes of bf16).
* ``rowwise``: one scale per row of each operand along the contracted dimension (each token's
  row of the input, each output row of the weight), all e4m3. The weight gradient contracts
  tokens, so it quantizes the kept bf16 input and the output gradient again along them; the
  input gradient contracts the weight's rows, whose forward scales fold into the output
  gradient's columns (``fold_row_scales``): the forward's float8 weight serves it as it is.
* ``delayed``: per-tensor scales from the amax history of earlier steps (``amax_history``
  steps, its maximum; the first step, without history, takes the current amax, reduced over
  TP). Each product
  records its operands' amax in the current slot; once per optimizer step ``history_step``
  reduces the current slots over the module's ranks (max: one all-reduce per group) and rolls
  the window. The history is the module's persistent ``fp8_history`` buffer ``[sites, 3, H]``
  (rows: input, weight, output gradient), so checkpoints carry it.
* ``blockwise`` (DeepSeek-V3's / Megatron's fine-grained scaling): activations and output
  gradients one scale per 1x128 tile (a row's 128 consecutive elements along the contracted
  dimension), weights one per 128x128 block, all e4m3 (``quantize_blocks``). Each product is
  quantized along its own contraction: the input gradient ``g @ w`` tiles ``g`` along ``O`` and
  takes the forward's float8 weight with its block scales transposed (a 128x128 block is one
  whatever the direction: no second pass over the weight); the weight gradient ``g.T @ x``
  contracts tokens, so it tiles the kept high-precision input and the output gradient again
  along them (rows padded to 16 with zeros, the last tile partial). A dimension that is not a
  multiple of 128 ends in a partial tile / block: its amax is over the elements it has (the
  same as zero padding), and the kernel takes it so (cuBLAS reads ``ceil(n / 128)`` scales).
  Native: ``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128`` for the tiles
  and ``BlockWise128x128`` for the weight's blocks (forward and input gradient), 1x128 x 1x128
  for the weight gradient; cuBLAS runs it on sm90 from CUDA 12.9 (``_cuda_takes_blocks``
  probes it once), without fast accumulation (cuBLAS refuses it for block scales), elsewhere
  the dequantized product (below).

Weights are quantized once per optimizer step where the module's site caches them
(``apply_fp8(cache=True)``: ``train.fp8.cache_weights``): ``refresh_weights`` quantizes every
weight the cache does not hold as it is, where a step or a forward-only pass begins, outside any
compiled graph; a step's finaliser drops the weights that train (``invalidate_weights``: an
optimizer writes them through its flat buffers or its own kernel, which bumps no tensor version),
a checkpoint load all of them. Every product, microbatch and recompute of the step then reads the
one float8 copy, in the orientation the recipe's products share (row-wise and block-wise input
gradients take the forward's float8 weight, see below; a second orientation is never built).
Eager products check the cached copy against the weight's version and storage and quantize
themselves where it is stale; compiled ones read it unchecked.

Scales are computed in fp32 and their reciprocals passed to the products. Where an amax
reduction keeps a quantization independent of the layout it is reduced over the module's TP
group (``FP8Site.group``): a per-tensor amax always (each rank holds a shard of the tensor),
a per-row amax where the contracted dimension is split (row-parallel layers). With these
reductions a TP layout quantizes exactly as one process does. ``blockwise`` reduces nothing:
its tiles and blocks are laid on the local shard, and where the TP-split dimension's local size
is a multiple of 128 (every shard then starts at one) no tile or block straddles a shard
boundary, so each is whole on one rank and is the one-process tile / block. Where it is not,
the shard's last tile / block is partial and the layout quantizes its own blocks, not the
one-process ones (still 1x128 / 128x128 FP8, not bit-equal to one process): ``apply_fp8`` warns
once, naming the modules.

Experts: ``torch._scaled_grouped_mm`` takes row-wise scales only, so the grouped product
quantizes row-wise under every recipe but ``blockwise`` (below). It needs each group's rows to
start at a multiple of 16: the local dispatcher lays the rows out so when asked
(``gemm.grouped_row_align``: padding rows of gate 0 between the experts' blocks, as Megatron's
router padding adds zero-probability tokens); otherwise (the all-to-all dispatchers) the
product copies the rows into a buffer padded so with zero rows and reads its output back at
theirs. The weight
gradient of the experts contracts each group's rows, so its operands (the output gradient and
the kept input) are quantized with one scale per group and column (``quantize_group_columns``)
and multiplied by the kernel's 2d x 2d form (``grouped_weight_grad_fp8``: the groups along the
contraction, each starting at a multiple of 16 rows, as for the forward).

``wgrad`` (``train.fp8.wgrad``, on by default): off, weight gradients are products in the
activations' dtype wherever the recipe keeps the input so (``rowwise``, ``blockwise``, and every
recipe's experts); ``tensorwise`` and ``delayed`` dense products keep only the float8 input, so
their weight gradient stays FP8.

Under ``blockwise`` the experts are quantized block-wise as the dense products are (rows in
1x128 tiles, each expert's weight in 128x128 blocks), their weight gradient too: its tiles run
along each expert's rows from its first (the rows copied where each expert starts at a multiple
of 128), so none straddles two experts. torch has no block-scaled grouped kernel (2.11's
``F.scaled_grouped_mm`` finds none for 1x128 x 128x128 on an H100), so the three products
multiply the dequantized operands (``torch._grouped_mm``; bf16 on CUDA, fp32 on the CPU): the
recipe's numerics, not its speed, and the rows need no alignment (``gemm.grouped_row_align`` 1).

Where ``torch._scaled_mm`` cannot run the product (a dimension not a multiple of 16, a
device without FP8 GEMMs, the CPU for grouped products and for block scales) the same quantized
operands are multiplied after dequantizing them: the same rounding of the inputs, another
accumulation order. CPU tests check the scaling this way.

Under ``torch.compile`` the row-wise and block-wise products (dense and grouped) trace into the
layer's graph with no break and no guard on the row count (block-wise: but for a weight
gradient of one 128-row tile, a size-1 dim dynamo specializes): their forward operands are
quantized in plain torch code before the autograd Function, which takes only tensors and plain
values.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mimo.parallel import fp8_kernels
from mimo.parallel.kernels import on_triton
from mimo.parallel.grouped import GROUP_ALIGN, grouped_rows_op, grouped_weight_grad_op, padded_groups, rows_expert

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
ROLES = ("input", "weight", "grad")
log = logging.getLogger("mimo.parallel.fp8")
_TINY = 1e-12  # an all-zero tensor gets scale 1 / _TINY-bounded, never a division by zero
TILE = 128  # blockwise: activations' and gradients' 1 x TILE tiles, weights' TILE x TILE blocks
ROW_TILE, WEIGHT_BLOCK = (1, TILE), (TILE, TILE)


def _reduce_max(amax: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def amax_of(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """fp32 amax of ``x``: of the whole tensor (``dim`` None) or along ``dim`` (kept); zeros for
    an empty ``x`` (a rank with no rows this microbatch: its amax takes no part in a max)."""
    if x.numel() == 0:
        shape = () if dim is None else tuple(1 if d == dim % x.dim() else n for d, n in enumerate(x.shape))
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    a = x.abs()
    return (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()


def quantize(x: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, inv_scale)``: ``x * scale`` saturated into ``dtype``, ``x ~ q * inv_scale``;
    ``scale = FP8_MAX / amax`` (broadcast against ``x``)."""
    scale = FP8_MAX[dtype] / amax.clamp_min(_TINY)
    q = (x.float() * scale).clamp_(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return q, scale.reciprocal()


def quantize_blocks(x: torch.Tensor, dtype: torch.dtype, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., R, C]`` quantized with one scale per ``block`` (rows, cols) of its last two
    dims, e.g. ``ROW_TILE`` (1 x 128: a row's 128 consecutive elements) or ``WEIGHT_BLOCK``
    (128 x 128), through ``quantize``: ``(q [..., R, C], inv_scale [..., ceil(R / rows),
    ceil(C / cols)])``. A last block that ``x`` does not fill is padded with zeros, so its amax
    is that of the elements it has. ``q`` keeps ``x``'s layout (a transposed view stays one)."""
    *lead, R, C = x.shape
    br, bc = block
    pr, pc = -R % br, -C % bc
    xf = x.float()
    if pr or pc:
        xf = F.pad(xf, (0, pc, 0, pr))
    blocks = xf.reshape(*lead, (R + pr) // br, br, (C + pc) // bc, bc)
    q, inv = quantize(blocks, dtype, blocks.abs().amax(dim=(-3, -1), keepdim=True))
    q = q.reshape(*lead, R + pr, C + pc)
    return (q[..., :R, :C] if pr or pc else q), inv.reshape(*lead, (R + pr) // br, (C + pc) // bc)


def dequantize_blocks(q: torch.Tensor, inv: torch.Tensor, block: tuple[int, int], dtype=torch.float32) -> torch.Tensor:
    """``q * inv`` with ``inv`` (``quantize_blocks``'s) spread over its blocks, in ``dtype``."""
    *_, R, C = q.shape
    s = inv
    if block[0] > 1:
        s = s.repeat_interleave(block[0], dim=-2)[..., :R, :]
    if block[1] > 1:
        s = s.repeat_interleave(block[1], dim=-1)[..., :C]
    return (q.float() * s).to(dtype)


def _cpu_takes_rowwise() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales (2.14 does, 2.11 does not)."""
    a = torch.zeros(16, 16, dtype=E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
        return True
    except RuntimeError:
        return False


_CPU_ROWWISE = _cpu_takes_rowwise()  # probed once, outside any compiled graph
_CUDA_BLOCKS: dict[int, bool] = {}


def _cuda_takes_blocks(device: int) -> bool:
    """Whether ``torch.nn.functional.scaled_mm`` runs 1x128 x 128x128 block scaling on this GPU
    (cuBLAS: sm90, CUDA 12.9+); probed once a device, by ``FP8Site`` (outside any graph)."""
    if device not in _CUDA_BLOCKS:
        ok = hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")
        if ok:
            a = torch.zeros(16, TILE, dtype=E4M3, device=f"cuda:{device}")
            try:
                _scaled_mm_blocks(a, a.t(), a.new_ones(16, 1, dtype=torch.float32), a.new_ones(1, 1, dtype=torch.float32),
                                  (ROW_TILE, WEIGHT_BLOCK), torch.bfloat16)
            except (RuntimeError, ValueError, NotImplementedError):
                ok = False
        _CUDA_BLOCKS[device] = ok
    return _CUDA_BLOCKS[device]


class FP8Site:
    """One module's FP8 settings (its ``recipe``): the recipe ``kind``, the TP group amaxes are
    reduced over, and for ``delayed`` the module that owns the ``fp8_history`` buffer. Each of
    its weights carries ``fp8_row`` (its history row) and ``fp8_split`` (whether its product
    contracts a TP-split dimension: row-parallel): plain attributes that ``torch.compile``
    reads as it reads ``weight.gtp``."""

    def __init__(self, kind: str, group=None, split_in=(), owner=None, weights=(), cache: bool = False,
                 wgrad: bool = True, backend: str = "mimo"):
        self.kind, self.group, self.owner, self.backend = kind, group, owner, backend
        # weight gradients in FP8 (``train.fp8.wgrad``); off: in the activations' dtype where the
        # recipe keeps the input so (rowwise, blockwise, every recipe's experts)
        self.wgrad = wgrad
        split = {id(w) for w in split_in}
        for i, w in enumerate(weights):
            w.fp8_row, w.fp8_split = i, id(w) in split
        self.weights = list(weights)
        # ``cache``: each weight's float8 form kept from one ``refresh`` to the next (once per
        # optimizer step) and shared by every product, microbatch and recompute; entries are
        # (wq, w_inv, the weight's version and storage when quantized, delayed: the amax it
        # recorded); None: quantized in every product
        self.cached: list[tuple] | None = [None] * len(self.weights) if cache else None
        # set by history_step on every rank alike: from then on a delayed scale comes from the
        # history without a collective (before, the fallback amax is reduced over TP)
        self.warm = False
        self.cuda_fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
        if kind == "blockwise" and self.cuda_fp8:
            self.cuda_fp8 = _cuda_takes_blocks(torch.cuda.current_device())

    def native(self, x: torch.Tensor) -> bool:
        """Whether ``torch._scaled_mm`` runs this recipe's products on ``x``'s device (the CPU's
        takes no block scales)."""
        if x.is_cuda:
            return self.cuda_fp8
        return self.kind not in ("rowwise", "blockwise") or (self.kind == "rowwise" and _CPU_ROWWISE)

    def history(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``[3, H + 1]`` history of the product with ``weight`` (delayed), else None."""
        return None if self.owner is None else self.owner.fp8_history[weight.fp8_row]

    def amax(self, x: torch.Tensor, dim: int | None = None, split: bool = False) -> torch.Tensor:
        """The current amax ``x`` is scaled by: per tensor (``dim`` None; reduced over TP: a shard's
        amax) or per slice along ``dim`` (reduced where that dimension is ``split`` over TP)."""
        amax = amax_of(x, dim)
        return _reduce_max(amax, self.group) if dim is None or split else amax

    def delayed_amax(self, x: torch.Tensor, history: torch.Tensor, role: int) -> torch.Tensor:
        """Delayed scaling: the window's max (this step's amax recorded in the current slot);
        without history yet, the current amax (reduced over TP)."""
        return delayed_amax(x, history, role, None if self.warm else self.group)

    def quantize_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(wq, w_inv)``: ``weight`` as this recipe's products take it: 128x128 blocks
        (``blockwise``); else row-wise along its input dimension (``rowwise``, and every
        recipe's experts, ``[E, O, I]``), or per tensor (current or delayed amax). The scales
        take no gradient: the weight is read detached."""
        w, hist = weight.detach(), self.history(weight)
        if self.kind == "blockwise":
            return quantize_blocks(w, E4M3, WEIGHT_BLOCK)
        if self.kind == "rowwise" or w.dim() == 3:
            amax = self.amax(w, -1, weight.fp8_split)
        elif hist is None:
            amax = self.amax(w)
        else:
            amax = self.delayed_amax(w, hist, 1)
        return quantize(w, E4M3, amax)

    def weight(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantize_weight(w)``, from the cache where it holds ``w`` as it is now. Compiled
        code reads a cached form without the check (a tensor's version is not traced): the
        steps and forward-only passes refresh the cache first (``refresh_weights``), outside the
        graph; where nothing is cached it quantizes (the graph guards on that)."""
        if self.cached is not None:
            entry = self.cached[w.fp8_row]
            if entry is not None and (torch.compiler.is_compiling() or entry[2:4] == (w._version, w.data_ptr())):
                return entry[:2]
        return self.quantize_weight(w)

    @torch.no_grad()
    def refresh(self) -> int:
        """Quantize into the cache every weight changed since it was cached (an optimizer step,
        a checkpoint load), on every rank in the same order (a quantization may reduce an amax
        over TP). ``delayed``: an unchanged weight's amax is recorded again in the step's history
        slot, as its products would have. Returns how many were quantized."""
        n = 0
        for i, w in enumerate(self.weights):
            entry, hist = self.cached[i], self.history(w)
            if entry is None or entry[2:4] != (w._version, w.data_ptr()):
                wq, w_inv = self.quantize_weight(w)
                recorded = hist[1, 0].clone() if hist is not None else None
                self.cached[i] = (wq, w_inv, w._version, w.data_ptr(), recorded)
                n += 1
            elif hist is not None:
                hist[1, 0] = torch.maximum(hist[1, 0], entry[4])
        return n

    def invalidate(self, trainable_only: bool = False) -> None:
        """Drop the cached forms (of the weights that train): the weights changed in a way their
        version does not show (an optimizer writes them through flat buffers or its own kernel)."""
        if self.cached is not None:
            for i, w in enumerate(self.weights):
                if w.requires_grad or not trainable_only:
                    self.cached[i] = None

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for e in self.cached or () if e is not None for t in e[:2])


def delayed_amax(x: torch.Tensor, history: torch.Tensor, role: int, group) -> torch.Tensor:
    cur = _reduce_max(amax_of(x, None), group)
    with torch.no_grad():
        history[role, 0] = torch.maximum(history[role, 0], cur)
    past = history[role, 1:].amax()
    return torch.where(past > 0, past, cur)


def scaled_mm(a_q, b_q, a_inv, b_inv, out_dtype: torch.dtype, native: bool, fast: bool = False,
              blocks: tuple | None = None) -> torch.Tensor:
    """``(a_q * a_inv) @ (b_q * b_inv)``: ``a_q [M, K]`` row-major, ``b_q [K, N]``; per-tensor
    inverse scales (0-d) or row-wise ones (``a_inv [M, 1]``, ``b_inv [1, N]``), or with
    ``blocks = (a_block, b_block)`` block-wise ones (``quantize_blocks``'s, each over its own
    operand as it is here: ``a_block`` ``ROW_TILE``, ``b_block`` ``WEIGHT_BLOCK`` or ``(128, 1)``,
    b's tiles along K). ``torch._scaled_mm`` (block scales: ``F.scaled_mm``) where ``native``
    and K, N are multiples of 16, else the dequantized product."""
    if blocks is not None:
        if native and a_q.shape[1] % 16 == 0 and b_q.shape[1] % 16 == 0 and min(a_q.shape + b_q.shape) > 0:
            return _scaled_mm_blocks(a_q, b_q, a_inv, b_inv, blocks, out_dtype)
        return (dequantize_blocks(a_q, a_inv, blocks[0]) @ dequantize_blocks(b_q, b_inv, blocks[1])).to(out_dtype)
    if native and a_q.shape[1] % 16 == 0 and b_q.shape[1] % 16 == 0:
        rowwise = a_inv.dim() > 0
        # the kernels want b column-major; row-wise scaling writes bf16 on CUDA
        out = torch.bfloat16 if rowwise and a_q.is_cuda else out_dtype
        y = torch._scaled_mm(a_q, b_q.t().contiguous().t(), scale_a=a_inv.float().contiguous(),
                             scale_b=b_inv.float().contiguous(), out_dtype=out, use_fast_accum=fast and a_q.is_cuda)
        return y.to(out_dtype)
    return ((a_q.float() * a_inv) @ (b_q.float() * b_inv)).to(out_dtype)


def _scaled_mm_blocks(a_q, b_q, a_inv, b_inv, blocks, out_dtype) -> torch.Tensor:
    """``F.scaled_mm`` on block-scaled operands (cuBLAS, sm90): ``a`` row-major with its 1x128
    scales outer-dim-major (``[M, ceil(K/128)]``, stride ``(1, M)``); ``b`` column-major, its
    tiles along K (``b_inv [ceil(K/128), N]``) as ``[N, ceil(K/128)]`` outer-dim-major, or its
    128x128 blocks (``b_inv [Kb, Nb]``) as ``[L4, Nb]`` K-major with ``Kb`` padded to ``L4``, a
    multiple of 4 (cuBLAS's layout; checked on an H100 with torch 2.11). ``a``'s rows padded to
    a multiple of 16 (zero rows, scale 1): cuBLAS finds no kernel where a column of ``a``'s
    scales is not 16-byte aligned (M = 333 fails, 332 runs); the output read back at its rows.
    No fast accumulation: cuBLAS refuses it with block scales."""
    rows = a_q.shape[0]
    a_q, a_inv = _pad_rows(a_q.contiguous()), F.pad(a_inv.float(), (0, 0, 0, -rows % 16), value=1.0)
    weight_blocks = blocks[1] == WEIGHT_BLOCK
    if weight_blocks:
        b_s = F.pad(b_inv.float().t(), (0, -b_inv.shape[0] % 4)).t()
    else:
        b_s = b_inv.float().t()
    out = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.float32
    return scaled_mm_blocks_op(a_q, b_q, a_inv, b_s, weight_blocks, out)[:rows].to(out_dtype)


@torch.library.custom_op("mimo::scaled_mm_blocks", mutates_args=())
def scaled_mm_blocks_op(a_q: torch.Tensor, b_q: torch.Tensor, a_s: torch.Tensor, b_s: torch.Tensor,
                        weight_blocks: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``F.scaled_mm`` with 1x128 scales of ``a`` (``[M, Kb]``) and 1x128 (``[N, Kb]``) or
    128x128 (``[L4, Nb]``) ones of ``b``, each laid out here as cuBLAS reads it (see
    ``_scaled_mm_blocks``). An op, which ``torch.compile`` calls whole: dynamo 2.11 cannot trace
    ``torch._scaled_mm_v2``, and the compiler may hand an op's inputs over in other strides."""
    st = F.ScalingType
    return F.scaled_mm(a_q.contiguous(), b_q.t().contiguous().t(), a_s.t().contiguous().t(), st.BlockWise1x128,
                       b_s.t().contiguous().t(), st.BlockWise128x128 if weight_blocks else st.BlockWise1x128,
                       output_dtype=out_dtype)


@scaled_mm_blocks_op.register_fake
def _(a_q, b_q, a_s, b_s, weight_blocks, out_dtype):
    return a_q.new_empty(a_q.shape[0], b_q.shape[1], dtype=out_dtype)


def fold_row_scales(g_TO: torch.Tensor, w_inv_TO: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The output gradient quantized row-wise for the input gradient ``g @ w``, with the
    weight's forward (row-wise) scales folded in: ``w[o] = wq[o] * w_inv[o]`` and the product
    contracts ``o``, so ``g @ w = (g * w_inv) @ wq`` and the forward's float8 weight serves
    backward as it is (no second pass over the weight, quantizing it along ``O``). ``w_inv_TO``
    broadcasts against ``g`` (each row's expert's scales for grouped products); the rows' amax
    is reduced over ``group`` where ``O`` is split over TP."""
    gw_TO = g_TO.float() * w_inv_TO
    return quantize(gw_TO, E4M3, _reduce_max(amax_of(gw_TO, -1), group))


def _pad_rows(x: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """``x`` with zero rows appended up to a multiple of ``multiple`` rows (the contraction of
    a weight gradient); float8 tensors padded through their bytes. Compiled, it pads by the
    symbolic ``-rows % multiple`` even when that is 0 (the same values, copied): a test of it
    would guard the graph on the row count modulo ``multiple``."""
    extra = -x.shape[0] % multiple
    if not torch.compiler.is_compiling() and not extra:
        return x
    if x.dtype in FP8_MAX:
        return F.pad(x.view(torch.uint8), (0, 0, 0, extra)).view(x.dtype)
    return F.pad(x, (0, 0, 0, extra))


class _Fp8Linear(torch.autograd.Function):
    """``x [T, I] @ w [O, I].T`` from their float8 forms (quantized by the caller, see
    ``fp8_linear``); backward quantizes the output gradient (see module doc). Every input is an
    argument, so that ``torch.compile`` traces it."""

    @staticmethod
    def forward(ctx, x_TI, w_OI, xq, x_inv, wq, w_inv, g_hist, kind, group, split, warm, native, wgrad):
        rowwise = kind == "rowwise"
        if kind == "blockwise":  # x's 1x128 tiles, w's 128x128 blocks (w.T's: the same blocks transposed)
            y_TO = scaled_mm(xq, wq.t(), x_inv, w_inv.t(), x_TI.dtype, native, blocks=(ROW_TILE, WEIGHT_BLOCK))
        else:
            y_TO = scaled_mm(xq, wq.t(), x_inv, w_inv.t() if rowwise else w_inv, x_TI.dtype, native, fast=True)
        ctx.kind, ctx.group, ctx.split, ctx.warm, ctx.native, ctx.dtype = kind, group, split, warm, native, x_TI.dtype
        ctx.w_dtype, ctx.wgrad = w_OI.dtype, wgrad
        if rowwise or kind == "blockwise":  # wgrad contracts T: x is quantized again along it; dgrad takes the float8 w
            ctx.save_for_backward(x_TI, wq, w_inv)
        else:
            # the history is written in place by later forwards: kept on ctx, not saved (its
            # version would change); its past window stays fixed until the step ends
            ctx.g_hist = g_hist
            ctx.save_for_backward(xq, x_inv, wq, w_inv)
        return y_TO

    @staticmethod
    def backward(ctx, g_TO):
        dtype, native, group = ctx.dtype, ctx.native, ctx.group
        g_TO = g_TO.contiguous()
        if ctx.kind == "blockwise":
            x_TI, wq_OI, w_inv_OI = ctx.saved_tensors
            # dgrad contracts O: g in 1x128 tiles along it, the forward's float8 w and its blocks
            gq, g_inv = quantize_blocks(g_TO, E4M3, ROW_TILE)
            dx = scaled_mm(gq, wq_OI, g_inv, w_inv_OI, dtype, native, blocks=(ROW_TILE, WEIGHT_BLOCK))
            if not ctx.wgrad:
                return dx, (g_TO.t() @ x_TI).to(ctx.w_dtype), *(None,) * 11
            # wgrad contracts T: g.T and x.T in 1x128 tiles along it (x.T's read as x's 128x1)
            gTq, gT_inv = quantize_blocks(_pad_rows(g_TO).t(), E4M3, ROW_TILE)
            xTq, xT_inv = quantize_blocks(_pad_rows(x_TI).t(), E4M3, ROW_TILE)
            dw = scaled_mm(gTq, xTq.t(), gT_inv, xT_inv.t(), dtype, native, blocks=(ROW_TILE, ROW_TILE[::-1]))
            return (dx, dw.to(ctx.w_dtype)) + (None,) * 11
        if ctx.kind == "rowwise":
            x_TI, wq_OI, w_inv_O1 = ctx.saved_tensors
            # dgrad contracts O (split over TP in a column-parallel layer): see fold_row_scales
            reduce = group if not ctx.split else None
            gq, g_inv = fold_row_scales(g_TO, w_inv_O1.t(), reduce)
            dx = scaled_mm(gq, wq_OI, g_inv, w_inv_O1.new_ones(1, wq_OI.shape[1]), dtype, native)
            if not ctx.wgrad:
                return dx, (g_TO.t() @ x_TI).to(ctx.w_dtype), *(None,) * 11
            gT, xP = _pad_rows(g_TO).t(), _pad_rows(x_TI)  # wgrad contracts T
            gTq, gT_inv = quantize(gT, E4M3, amax_of(gT, -1))
            xq, x_inv = quantize(xP, E4M3, amax_of(xP, 0))
            dw = scaled_mm(gTq.contiguous(), xq, gT_inv, x_inv, dtype, native)
            return (dx, dw.to(ctx.w_dtype)) + (None,) * 11
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        if ctx.g_hist is None:
            g_amax = _reduce_max(amax_of(g_TO, None), group)
        else:
            g_amax = delayed_amax(g_TO, ctx.g_hist, 2, None if ctx.warm else group)
        gq, g_inv = quantize(g_TO, E5M2, g_amax)
        dx = scaled_mm(gq, wq, g_inv, w_inv, dtype, native)
        dw = scaled_mm(_pad_rows(gq).t().contiguous(), _pad_rows(xq), g_inv, x_inv, dtype, native)
        return (dx, dw) + (None,) * 11


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, site: FP8Site) -> torch.Tensor:
    """``x @ weight.T + bias`` with float8 operands (see module doc); any leading dims of ``x``.
    The forward operands are quantized here, in plain torch code that ``torch.compile`` fuses
    with what computed them (row-wise and block-wise; dynamo 2.11-2.14 fails to trace the
    per-tensor backward inside compiled layers, so per-tensor recipes run it outside the graph)."""
    if site.kind not in _TRACED and torch.compiler.is_compiling():
        return _fp8_linear_eager(x, weight, bias, site)
    return _fp8_linear(x, weight, bias, site)


_TRACED = ("rowwise", "blockwise")  # recipes whose products torch.compile traces into the graph


# torch.compiler.disable, its torch._dynamo imported on the first call (only ever made while
# compiling) rather than with this module: importing dynamo costs seconds in every process
@torch._disable_dynamo
def _fp8_linear_eager(x, weight, bias, site):
    return _fp8_linear(x, weight, bias, site)


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, site: FP8Site) -> torch.Tensor:
    lead = x.shape[:-1]
    x_TI = x.reshape(-1, x.shape[-1])
    split, hist = weight.fp8_split, site.history(weight)
    # the scales take no gradient: amaxes of detached operands keep them (and the TP all-reduce
    # of an amax) out of autograd, which would otherwise hold |x| for a backward never taken
    xd = x_TI.detach()
    if site.kind == "blockwise":  # tiles and blocks: no amax reduction (see the module doc)
        xq, x_inv = quantize_blocks(xd, E4M3, ROW_TILE)
    elif site.kind == "rowwise":
        xq, x_inv = quantize(xd, E4M3, site.amax(xd, -1, split))
    else:
        xq, x_inv = quantize(xd, E4M3, site.amax(xd) if hist is None else site.delayed_amax(xd, hist, 0))
    wq, w_inv = site.weight(weight)
    y = _Fp8Linear.apply(x_TI, weight, xq, x_inv, wq, w_inv, hist, site.kind, site.group, split, site.warm,
                         site.native(x_TI), site.wgrad)
    y = y.reshape(*lead, weight.shape[0])
    return y if bias is None else y + bias


def fp8_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product's sizes take FP8 (both of the weight's dims multiples of 16); others
    stay in the activations' dtype."""
    return weight.dim() >= 2 and weight.shape[-1] % 16 == 0 and weight.shape[-2] % 16 == 0 and x.is_floating_point()


# ---- grouped products (experts) -------------------------------------------------------------


def _grouped_scaled(aq_RK, a_inv_R, bq_EKN, b_inv_EN, ends_E, out_dtype, aligned: bool) -> torch.Tensor:
    """``out[group e rows] = (a * a_inv) @ (b[e] * b_inv[e])``: the grouped FP8 kernel (CUDA) on
    the rows as they are where every group starts at a multiple of 16 already (``aligned``: the
    dispatcher laid them out so), else on a copy padded so; off CUDA, dequantized products."""
    if aq_RK.is_cuda and hasattr(torch, "_scaled_grouped_mm") and aq_RK.shape[1] % 16 == 0 and bq_EKN.shape[2] % 16 == 0:
        if aligned:
            return _scaled_grouped(aq_RK, a_inv_R.reshape(-1), bq_EKN, b_inv_EN, ends_E).to(out_dtype)
        return _scaled_grouped_padded(aq_RK, a_inv_R, bq_EKN, b_inv_EN, ends_E).to(out_dtype)
    a = aq_RK.float() * a_inv_R.reshape(-1, 1)
    b = bq_EKN.float() * b_inv_EN.unsqueeze(1)
    return grouped_rows_op(a, b.transpose(-2, -1), ends_E).to(out_dtype)


def _scaled_grouped(aq_RK, a_inv_R, bq_EKN, b_inv_EN, ends_E) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` (bf16 out, fast accumulation) on rows whose groups start at
    multiples of 16; ``b`` laid out column-major per group, as the kernel wants."""
    return torch._scaled_grouped_mm(aq_RK, bq_EKN.transpose(-2, -1).contiguous().transpose(-2, -1), a_inv_R.float(),
                                    b_inv_EN.float().contiguous(), offs=ends_E.to(torch.int32), out_dtype=torch.bfloat16,
                                    use_fast_accum=True)


def _scaled_grouped_padded(aq_RK, a_inv_R, bq_EKN, b_inv_EN, ends_E) -> torch.Tensor:
    """``_scaled_grouped`` on the rows copied into a buffer where each group starts at a
    multiple of 16 (zero rows, scale 1, between groups), read back at their rows. The buffer is
    scattered as bytes (uint8), which every compiler backend lowers, unlike a float8
    ``index_put``; a zero byte is float8's +0, the same buffer as float8 zeros."""
    dest_R, pends_E, cap = padded_groups(ends_E, aq_RK.shape[0], GROUP_ALIGN)
    a_pad = aq_RK.new_zeros(cap, aq_RK.shape[1], dtype=torch.uint8)
    a_pad[dest_R] = aq_RK.view(torch.uint8)
    s_pad = a_inv_R.new_ones(cap)
    s_pad[dest_R] = a_inv_R.reshape(-1)
    return _scaled_grouped(a_pad.view(aq_RK.dtype), s_pad, bq_EKN, b_inv_EN, pends_E)[dest_R]


def quantize_group_columns(t_RC: torch.Tensor, expert_R: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [R, C]`` (rows sorted by group, ``expert_R`` each row's) quantized e4m3 with one scale
    per group and column: ``(q [R, C], inv [groups, C])``, ``t[r] ~ q[r] * inv[expert_R[r]]``.
    The scales of a weight gradient ``g.T @ x`` per expert: it contracts each group's rows."""
    amax_EC = torch.zeros(groups, t_RC.shape[1], dtype=torch.float32, device=t_RC.device)
    amax_EC.scatter_reduce_(0, expert_R[:, None].expand(-1, t_RC.shape[1]), t_RC.detach().abs().float(), "amax")
    scale_EC = FP8_MAX[E4M3] / amax_EC.clamp_min(_TINY)
    q = (t_RC.float() * scale_EC[expert_R]).clamp_(-FP8_MAX[E4M3], FP8_MAX[E4M3]).to(E4M3)
    return q, scale_EC.reciprocal()


def group_columns_t_reference(t_RC: torch.Tensor, ends_E: torch.Tensor, pends_E: torch.Tensor, width: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qT [C, width] e4m3, inv [E, C] fp32)``: ``t``'s rows of expert ``e`` (``ends_E``:
    cumulative row ends) scaled by its per-column scale, transposed, at the columns from
    ``pends_E[e-1]`` on (``pends_E``: the cumulative ends of each expert's block in the output,
    its rows first; ``ends_E`` itself where there is no padding), zeros elsewhere."""
    R = t_RC.shape[0]
    expert_R = rows_expert(ends_E, R)
    q, inv = quantize_group_columns(t_RC, expert_R, ends_E.shape[0])
    ends, pends = ends_E.to(torch.int64), pends_E.to(torch.int64)
    starts, pstarts = (torch.cat([v.new_zeros(1), v[:-1]]) for v in (ends, pends))
    dest_R = torch.arange(R, device=t_RC.device) + (pstarts - starts)[expert_R]
    out = torch.zeros(width, t_RC.shape[1], dtype=torch.uint8, device=t_RC.device)
    out[dest_R] = q.view(torch.uint8)
    return out.view(q.dtype).t().contiguous(), inv


@torch.library.custom_op("mimo::group_columns_t", mutates_args=())
def group_columns_t(t_RC: torch.Tensor, ends_E: torch.Tensor, pends_E: torch.Tensor, width: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s float8 transpose scaled per expert and column, written where each expert's block
    starts (``group_columns_t_reference``); the kernel on CUDA, the torch code elsewhere."""
    return (fp8_kernels.group_columns_t_fused if on_triton(t_RC) else group_columns_t_reference)(t_RC, ends_E, pends_E, width)


@group_columns_t.register_fake
def _(t_RC, ends_E, pends_E, width):
    return (t_RC.new_empty(t_RC.shape[1], width, dtype=torch.float8_e4m3fn),
            t_RC.new_empty(ends_E.shape[0], t_RC.shape[1], dtype=torch.float32))


# torch._scaled_grouped_mm's 2d x 2d form for the experts' FP8 weight gradient. Off until its GPU
# test passes: its first GPU run (H100, 2026-12-08) failed on the kernel's 16-byte stride rule
# (rows of R = 333 and 397 float8 columns), fixed since but not run again; meanwhile CUDA multiplies
# the same float8 operands dequantized (bf16 grouped GEMM), as the CPU does in fp32.
NATIVE_GROUPED_WGRAD = False


def grouped_weight_grad_fp8(g_RO: torch.Tensor, x_RI: torch.Tensor, ends_E: torch.Tensor, aligned: bool,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """``[E, O, I]``: each group's ``g.T @ x`` from their float8 forms, scaled per group and
    column (``quantize_group_columns``): on CUDA ``torch._scaled_grouped_mm``'s 2d x 2d form
    (``g.T`` row-major, ``x`` column-major, the groups along the contraction, each starting at a
    multiple of 16 rows: as they are where ``aligned``, else written so with zeros between; both
    quantized and transposed by ``fp8_kernels.group_columns_t``),
    fp32 accumulation (no fast accumulation: a group's contraction runs over all its tokens),
    where ``NATIVE_GROUPED_WGRAD``; elsewhere the dequantized product."""
    E, R = ends_E.shape[0], g_RO.shape[0]
    if (NATIVE_GROUPED_WGRAD and g_RO.is_cuda and hasattr(torch, "_scaled_grouped_mm") and g_RO.shape[1] % 16 == 0
            and x_RI.shape[1] % 16 == 0):
        # both operands transposed as the kernel wants them, in one pass each (mimo.parallel.fp8_kernels);
        # their rows (R long) padded to a multiple of 16 bytes, the kernel's stride rule
        pends_E, width = (ends_E, R) if aligned else padded_groups(ends_E, R, GROUP_ALIGN)[1:]
        width += -width % GROUP_ALIGN
        gT_OR, g_inv_EO = group_columns_t(g_RO, ends_E, pends_E, width)
        xT_IR, x_inv_EI = group_columns_t(x_RI, ends_E, pends_E, width)
        return torch._scaled_grouped_mm(gT_OR, xT_IR.t(), g_inv_EO.reshape(-1), x_inv_EI.reshape(-1),
                                        offs=pends_E.to(torch.int32), out_dtype=torch.bfloat16,
                                        use_fast_accum=False).to(out_dtype)
    expert_R = rows_expert(ends_E, R)
    (gq, g_inv_EO), (xq, x_inv_EI) = quantize_group_columns(g_RO, expert_R, E), quantize_group_columns(x_RI, expert_R, E)
    dq = torch.bfloat16 if g_RO.is_cuda else torch.float32  # (torch._grouped_mm on CUDA takes no fp32)
    g = (gq.float() * g_inv_EO[expert_R]).to(dq)
    x = (xq.float() * x_inv_EI[expert_R]).to(dq)
    return grouped_weight_grad_op(g, x, ends_E).to(out_dtype)


class _Fp8Grouped(torch.autograd.Function):
    """Grouped ``x [R, I] @ w[e] [O, I].T`` from their row-wise float8 forms (quantized by the
    caller, see ``fp8_grouped_linear``); backward quantizes along the other dimensions (see
    module doc). Every input is an argument, so that ``torch.compile`` traces it."""

    @staticmethod
    def forward(ctx, x_RI, w_EOI, ends_E, xq_RI, x_inv_R1, wq_EOI, w_inv_EO1, group, split, aligned, wgrad):
        y_RO = _grouped_scaled(xq_RI, x_inv_R1, wq_EOI.transpose(-2, -1), w_inv_EO1.squeeze(-1), ends_E, x_RI.dtype,
                               aligned)
        ctx.save_for_backward(x_RI, wq_EOI, w_inv_EO1, ends_E)
        ctx.group, ctx.split, ctx.w_dtype, ctx.aligned, ctx.wgrad = group, split, w_EOI.dtype, aligned, wgrad
        return y_RO

    @staticmethod
    def backward(ctx, g_RO):
        x_RI, wq_EOI, w_inv_EO1, ends_E = ctx.saved_tensors
        g_RO = g_RO.contiguous()
        reduce = ctx.group if not ctx.split else None  # dgrad contracts O: split over TP where I is not
        expert_R = rows_expert(ends_E, g_RO.shape[0])
        gq, g_inv = fold_row_scales(g_RO, w_inv_EO1.squeeze(-1)[expert_R], reduce)
        ones_EI = w_inv_EO1.new_ones(wq_EOI.shape[0], wq_EOI.shape[2])
        dx = _grouped_scaled(gq, g_inv, wq_EOI, ones_EI, ends_E, x_RI.dtype, ctx.aligned)
        if ctx.wgrad:
            dw = grouped_weight_grad_fp8(g_RO, x_RI, ends_E, ctx.aligned, ctx.w_dtype)
        else:
            dw = grouped_weight_grad_op(g_RO, x_RI, ends_E).to(ctx.w_dtype)
        return (dx, dw) + (None,) * 9


def _grouped_dequantized(a_RK, b_EKN, ends_E, out_dtype) -> torch.Tensor:
    """``out[group e rows] = a @ b[e]`` on dequantized operands (fp32; bf16 on CUDA, where
    ``torch._grouped_mm`` takes no fp32)."""
    return grouped_rows_op(a_RK, b_EKN.transpose(-2, -1), ends_E).to(out_dtype)


def _group_tiles(t_RC: torch.Tensor, ends_E: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [R, C]``'s columns quantized in 1 x 128 tiles along each group's rows, dequantized
    (``dtype``): ``(t_PC, padded_ends_E)``, the rows copied where every group starts at a
    multiple of 128 (zero rows between: ``padded_groups``), so that no tile straddles two groups."""
    dest_R, pends_E, cap = padded_groups(ends_E, t_RC.shape[0], TILE)
    cap += -cap % TILE
    pad = t_RC.new_zeros(cap, t_RC.shape[1], dtype=torch.float32)
    pad[dest_R] = t_RC.float()
    q, inv = quantize_blocks(pad.t(), E4M3, ROW_TILE)
    return dequantize_blocks(q, inv, ROW_TILE, dtype).t(), pends_E


class _Fp8GroupedBlocks(torch.autograd.Function):
    """Grouped ``x [R, I] @ w[e] [O, I].T`` from their block-wise float8 forms (rows in 1x128
    tiles, each expert's weight in 128x128 blocks; quantized by the caller), multiplied
    dequantized (torch has no block-scaled grouped kernel); backward quantizes each product
    along its contraction: ``g`` in tiles along ``O`` against the forward's float8 weight, and
    for the weight gradient ``g`` and the kept ``x`` in tiles along each expert's rows."""

    @staticmethod
    def forward(ctx, x_RI, w_EOI, ends_E, xq_RI, x_inv, wq_EOI, w_inv, wgrad):
        dq = torch.bfloat16 if x_RI.is_cuda else torch.float32
        ctx.save_for_backward(x_RI, wq_EOI, w_inv, ends_E)
        ctx.w_dtype, ctx.dq, ctx.wgrad = w_EOI.dtype, dq, wgrad
        x = dequantize_blocks(xq_RI, x_inv, ROW_TILE, dq)
        return _grouped_dequantized(x, dequantize_blocks(wq_EOI, w_inv, WEIGHT_BLOCK, dq).transpose(-2, -1), ends_E,
                                    x_RI.dtype)

    @staticmethod
    def backward(ctx, g_RO):
        x_RI, wq_EOI, w_inv, ends_E = ctx.saved_tensors
        g_RO, dq = g_RO.contiguous(), ctx.dq
        gq, g_inv = quantize_blocks(g_RO, E4M3, ROW_TILE)  # dgrad contracts O
        dx = _grouped_dequantized(dequantize_blocks(gq, g_inv, ROW_TILE, dq),
                                  dequantize_blocks(wq_EOI, w_inv, WEIGHT_BLOCK, dq), ends_E, x_RI.dtype)
        if not ctx.wgrad:
            return dx, grouped_weight_grad_op(g_RO, x_RI, ends_E).to(ctx.w_dtype), *(None,) * 6
        (g_PO, pends_E), (x_PI, _) = _group_tiles(g_RO, ends_E, dq), _group_tiles(x_RI, ends_E, dq)
        dw = grouped_weight_grad_op(g_PO, x_PI, pends_E).to(ctx.w_dtype)
        return (dx, dw) + (None,) * 6


def fp8_grouped_linear(x_RI: torch.Tensor, weight_EOI: torch.Tensor, ends_E: torch.Tensor, site: FP8Site,
                       aligned: bool = False) -> torch.Tensor:
    """``gemm.grouped_linear`` with row-wise float8 operands under every recipe but
    ``blockwise`` (block-wise ones; see module doc); the forward operands quantized here, in
    plain torch code, as ``fp8_linear`` does. ``aligned``: every group starts at a multiple of
    ``GROUP_ALIGN`` rows already."""
    if site.backend == "torchao":
        return torchao_grouped(x_RI, weight_EOI, ends_E, aligned)
    split = weight_EOI.fp8_split  # the down projection contracts the TP-split F
    x = x_RI.detach()  # the scales take no gradient
    if site.kind == "blockwise":
        xq, x_inv = quantize_blocks(x, E4M3, ROW_TILE)
        return _Fp8GroupedBlocks.apply(x_RI, weight_EOI, ends_E, xq, x_inv, *site.weight(weight_EOI), site.wgrad)
    xq, x_inv = quantize(x, E4M3, site.amax(x, -1, split))
    wq, w_inv = site.weight(weight_EOI)
    return _Fp8Grouped.apply(x_RI, weight_EOI, ends_E, xq, x_inv, wq, w_inv, site.group, split, aligned, site.wgrad)


def torchao_problem(device: torch.device) -> str | None:
    """Why torchao's grouped FP8 products cannot run on ``device`` here, or None."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao; 0.18 runs with torch 2.11 and later)"
    if device.type != "cuda":
        return f"its grouped FP8 GEMM runs on CUDA GPUs; this run is on {device.type} (use the mimo backend)"
    try:
        found = hasattr(importlib.import_module("torchao.prototype.moe_training"), "_to_fp8_rowwise_then_scaled_grouped_mm")
    except ImportError as e:
        return f"torchao's MoE training module does not import ({e})"
    return None if found else "this torchao has no FP8 row-wise grouped GEMM (0.18 has it)"


def torchao_grouped(x_RI: torch.Tensor, weight_EOI: torch.Tensor, ends_E: torch.Tensor, aligned: bool) -> torch.Tensor:
    """The grouped product by torchao's FP8 row-wise grouped GEMM (``train.fp8.backend: torchao``:
    its own fused quantization kernels, power-of-two scales, FP8 weight gradients; weights
    quantized in every call). It takes groups starting at multiples of 16 rows only: where the
    rows are not laid out so, they are copied into a buffer that is (zero rows between) and the
    output read back at theirs, both differentiable."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as grouped

    w_t = weight_EOI.transpose(-2, -1)  # [E, I, O], column-major per expert: as the kernel wants it
    if aligned:
        return grouped(x_RI, w_t, ends_E.to(torch.int32), out_dtype=x_RI.dtype, pad_token_groups_for_grouped_mm=False)
    dest_R, pends_E, cap = padded_groups(ends_E, x_RI.shape[0], GROUP_ALIGN)
    cap += -cap % GROUP_ALIGN  # its weight gradient's operands are [*, cap]: rows of 16-byte multiples
    x_pad = x_RI.new_zeros(cap, x_RI.shape[1]).index_copy(0, dest_R, x_RI)
    y_pad = grouped(x_pad, w_t, pends_E.to(torch.int32), out_dtype=x_RI.dtype, pad_token_groups_for_grouped_mm=False)
    return y_pad[dest_R]


# ---- the once-per-step history update (delayed) ---------------------------------------------


def history_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "fp8_history", None), torch.Tensor)]


@torch.no_grad()
def history_step(model: torch.nn.Module, groups=()) -> None:
    """Once per optimizer step (``delayed``): every ``fp8_history``'s current slot reduced (max)
    over ``groups`` (the module's TP group, then its gradient group: every rank that holds the
    same layers) in one all-reduce each, then the window rolled and the new slot zeroed."""
    mods = history_modules(model)
    if not mods:
        return
    flat = torch.cat([m.fp8_history[..., 0].reshape(-1) for m in mods])
    for group in groups:
        _reduce_max(flat, group)
    at = 0
    for m in mods:
        h = m.fp8_history
        n = h[..., 0].numel()
        cur = flat[at:at + n].view(h.shape[:-1])
        at += n
        h.copy_(torch.roll(h, 1, dims=-1))
        h[..., 1] = cur  # the step just done becomes the newest past entry
        h[..., 0] = 0
        m.recipe.warm = True


def fit_history(saved: torch.Tensor, shape) -> torch.Tensor | None:
    """A stored ``fp8_history`` fitted to a window of another length (``train.fp8.amax_history``
    changed across a resume): the current slot and the newest past steps kept (the oldest
    dropped), zeros (no history yet) where the new window is longer. None where more than the
    window's length differs (another model)."""
    if tuple(saved.shape[:-1]) != tuple(shape[:-1]):
        return None
    out = saved.new_zeros(shape)
    n = min(saved.shape[-1], shape[-1])
    out[..., :n] = saved[..., :n]  # slot 0: the current step, then the past, newest first
    return out


# ---- putting the recipe on a model -----------------------------------------------------------


def fp8_sites(root: torch.nn.Module) -> list[FP8Site]:
    return [m.recipe for m in root.modules() if isinstance(getattr(m, "recipe", None), FP8Site)]


def refresh_weights(root: torch.nn.Module) -> int:
    """Every weight cache of ``root``'s FP8 modules brought up to date (``FP8Site.refresh``):
    where a step or a forward-only pass begins, outside any compiled graph. Returns how many
    weights were quantized."""
    return sum(site.refresh() for site in fp8_sites(root) if site.cached is not None)


def invalidate_weights(root: torch.nn.Module, trainable_only: bool = False) -> None:
    """``FP8Site.invalidate`` on every FP8 module of ``root``: after an optimizer step (the
    weights that train), after a load (all); the next ``refresh_weights`` quantizes them."""
    for site in fp8_sites(root):
        site.invalidate(trainable_only)


def weight_cache_bytes(root: torch.nn.Module) -> int:
    """Bytes of the float8 weights and scales ``root``'s FP8 modules keep between steps."""
    return sum(site.cache_bytes() for site in fp8_sites(root))


def apply_fp8(root: torch.nn.Module, kind: str, ctx, amax_history: int = 16, keep=lambda name: True,
              cache: bool = False, wgrad: bool = True, backend: str = "mimo") -> int:
    """Give every GEMM-holding module of ``root`` (a ``recipe`` attribute and ``placements()``)
    whose name ``keep`` accepts an ``FP8Site`` of ``kind``: the TP group of its layout (ETP for
    experts on the expert view), the weights whose input dimension is split over it, and for
    ``delayed`` an ``fp8_history`` buffer (zeros, fp32) of ``amax_history`` steps. ``cache``:
    its weights quantized once per ``refresh_weights`` (here first), not in every product.
    ``wgrad``: weight gradients in FP8 (``FP8Site.wgrad``). ``backend``: ``torchao`` for the
    grouped products (``torchao_grouped``).
    Returns how many modules took it. ``blockwise``: warns once where a weight's TP-split
    dimension has shards that are not a multiple of 128 (``straddling_blocks``)."""
    n, straddle = 0, []
    for name, m in root.named_modules():
        if not hasattr(m, "recipe") or not hasattr(m, "placements") or not keep(name):
            continue
        weights = [(pn, p) for pn, p in m.named_parameters(recurse=False) if p.dim() >= 2]
        if not weights:
            continue
        folded = getattr(m, "folded", False)
        axis, group = ("etp", ctx.expert.group("etp")) if folded else ("tp", ctx.tp)
        placements = m.placements()
        split = [p for pn, p in weights if pn in placements and (axis, p.dim() - 1) in placements[pn].shards]
        if kind == "blockwise" and group is not None and dist.get_world_size(group) > 1:
            straddle += [f"{name}.{pn}" if name else pn for pn, _ in weights
                         if pn in placements and straddling_blocks(placements[pn], axis, dist.get_world_size(group))]
        owner = None
        if kind == "delayed":
            m.register_buffer("fp8_history", torch.zeros(len(weights), len(ROLES), amax_history + 1,
                                                         dtype=torch.float32, device=weights[0][1].device))
            owner = m
        m.recipe = FP8Site(kind, group, split, owner, [p for _, p in weights], cache, wgrad, backend)
        n += 1
    if straddle:
        log.warning("train.fp8 blockwise: %d weight(s) split over TP in shards that are not a multiple of 128 (%s): "
                    "their 128-blocks (and their activations' 1x128 tiles along that dimension) are laid on each "
                    "shard, so this layout quantizes them otherwise than one process does", len(straddle),
                    ", ".join(straddle[:4]) + (", ..." if len(straddle) > 4 else ""))
    refresh_weights(root)
    return n


def straddling_blocks(placement, axis: str, size: int) -> bool:
    """Whether a weight of ``placement`` split ``size`` ways over ``axis`` has a shard (of a
    fused part, each part split on its own) that is not a multiple of ``TILE``: there a
    one-process 128-block straddles two ranks' shards."""
    for a, d in placement.shards:
        if a == axis:
            parts = placement.parts if placement.parts and d == placement.parts_dim else (placement.full_shape[d],)
            if any(-(-part // size) % TILE for part in parts):
                return True
    return False


def clear_fp8(root: torch.nn.Module, default) -> None:
    """Undo ``apply_fp8``: every module's recipe back to a new ``default()``
    (``gemm.default_recipe``: one object per module), its history dropped."""
    for m in root.modules():
        if isinstance(getattr(m, "recipe", None), FP8Site):
            m.recipe = default()
            m._buffers.pop("fp8_history", None)
