"""PackedBatch: one rank's pack of samples in THD form (docs/design.md §2 "Packed batches")."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from mimo.core.errors import DataError


@dataclass(frozen=True)
class CPSlice:
    """What a context-parallel pack needs beyond its tensors (``mimo.parallel.layout.PackLayout``):
    ``cp`` ranks, ``rank`` (the CP rank whose local share this pack is; None: the whole pack,
    before slicing), each sample's chunk length (its padded length / 2cp) and real length."""

    cp: int
    rank: int | None
    chunk_lens: tuple[int, ...]
    real_lens: tuple[int, ...]

    def real_tokens(self) -> int:
        """Real (non-padding) positions of this share (of the whole pack when ``rank`` is None)."""
        if self.rank is None:
            return sum(self.real_lens)
        own = (self.rank, 2 * self.cp - 1 - self.rank)
        return sum(min(max(n - j * c, 0), c) for n, c in zip(self.real_lens, self.chunk_lens) for j in own)


@dataclass
class PackedBatch:
    """Samples laid end to end, ``T`` positions in all (padding included).

    tokens, positions, labels, loss_mask: ``[T]``; positions restart at 0 per sample.
    cu_seqlens: ``[N+1]`` int32 sample boundaries (padding, if any, forms its own
    trailing segment so no sequence-mixing layer reads across into it).
    image_slots: per encoder placeholder, the positions ``[R]`` (int64, ascending in row
    order) where that encoder's rows are scattered into the sequence.
    sample_ids: ``[N]`` global ids of the samples, for bookkeeping and exact resume.
    positions_3d: ``[3, T]`` int64 (time, height, width) positions of a multimodal-RoPE LLM
    (``mimo.llm.mrope``: Qwen3-VL), each sample's restarting at 0, moved and sliced with the
    tokens; None (the default, every 1-D model): every axis is ``positions``.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    image_slots: dict[str, torch.Tensor] = field(default_factory=dict)
    sample_ids: torch.Tensor | None = None
    # cp > 1: chunk and real lengths; on a CP rank's share (``mimo.data.pack.cp_share``) the
    # tensors hold its local sequence: each sample's two chunks, every chunk a segment of
    # cu_seqlens, positions those of the whole sample (RoPE), padding inside the last chunks
    cp: CPSlice | None = None
    # M-RoPE positions beside ``positions`` (see the class doc); on a CP rank's share, its
    # positions' columns (``mimo.data.pack.cp_share``), as ``positions`` are
    positions_3d: torch.Tensor | None = None
    # host copy of the sample lengths, taken while cu_seqlens is on the CPU, so that a pack
    # moved to a GPU answers seqlens / max_seqlen without waiting for the device
    _host_seqlens: list[int] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._host_seqlens is None and self.cu_seqlens.device.type == "cpu":
            self._host_seqlens = torch.diff(self.cu_seqlens).tolist()

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_samples(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def seqlens(self) -> list[int]:
        if self._host_seqlens is not None:
            return list(self._host_seqlens)
        return torch.diff(self.cu_seqlens).tolist()

    @property
    def num_loss_tokens(self) -> int:
        """Positions that count in the loss (loss mask on, label >= 0)."""
        return int(((self.labels >= 0) & self.loss_mask.bool()).sum())

    @property
    def num_real_tokens(self) -> int | None:
        """Positions before the trailing padding segment (known on the host), or None when
        the pack has no such segment (or no ``sample_ids`` to tell it by). Under context
        parallelism: the real positions of this share, padding being inside samples."""
        if self.cp is not None:
            return self.cp.real_tokens()
        if self.sample_ids is None:
            return None
        n = int(self.sample_ids.numel())
        lens = self.seqlens
        return sum(lens[:n]) if n < len(lens) else None

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens, default=0)

    def to(self, device: torch.device | str) -> "PackedBatch":
        """The pack on ``device``. From the CPU to a GPU the copies are asynchronous: the
        tensors are pinned first (a copy from pageable memory would wait for the device)."""
        pin = torch.device(device).type == "cuda"
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                moved[f.name] = to_device(v, device, pin)
            elif isinstance(v, dict):
                moved[f.name] = {k: to_device(t, device, pin) for k, t in v.items()}
        return replace(self, **moved)

    def validate(self) -> None:
        """Raise DataError if the fields disagree with each other."""
        t = self.num_tokens
        for name in ("positions", "labels", "loss_mask"):
            if getattr(self, name).shape != (t,):
                raise DataError(f"PackedBatch.{name} has shape {tuple(getattr(self, name).shape)}, want ({t},)")
        cu = self.cu_seqlens
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1 or cu[0].item() != 0 or cu[-1].item() != t:
            raise DataError(f"PackedBatch.cu_seqlens must be int32, start at 0 and end at {t}")
        if (torch.diff(cu) < 0).any():
            raise DataError("PackedBatch.cu_seqlens must be non-decreasing")
        starts = torch.zeros(t, dtype=torch.bool)
        starts[cu[:-1][torch.diff(cu) > 0].long()] = True
        if t and self.cp is None and ((self.positions == 0) != starts).any():
            raise DataError("PackedBatch.positions must restart at 0 exactly at each sample start")
        p3 = self.positions_3d
        if p3 is not None:
            if p3.shape != (3, t) or p3.dtype != torch.int64:
                raise DataError(f"PackedBatch.positions_3d must be int64 [3, {t}], got {p3.dtype} {tuple(p3.shape)}")
            if t and self.cp is None and (p3[:, starts] != 0).any():
                raise DataError("PackedBatch.positions_3d must be 0 on every axis at each sample start")
        for key, slots in self.image_slots.items():
            if slots.numel() and (slots.min() < 0 or slots.max() >= t or (torch.diff(slots) <= 0).any()):
                raise DataError(f"PackedBatch.image_slots[{key!r}] must be ascending positions inside the pack")
        if self.sample_ids is not None and self.sample_ids.numel() > self.num_samples:
            raise DataError("PackedBatch.sample_ids has more ids than samples")


def to_device(t: torch.Tensor, device: torch.device | str, pin: bool) -> torch.Tensor:
    """``t`` on ``device``; ``pin``: a CPU tensor goes through pinned memory so the copy is
    asynchronous (torch's pinned-memory cache keeps the buffer until the copy is done)."""
    if pin and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


@dataclass
class PatchBatch:
    """A native-resolution tower's input on one rank: the patch rows of its images, image after
    image (``[P, C*tp*p*p]``, as ``mimo.data.native_images.preprocess`` lays them out), and
    each image's grid ``[N, 3]`` (t, h, w in patches)."""

    pixels_PJ: torch.Tensor
    grids_N3: torch.Tensor
