"""What every layer of an LLM stage sees about the pack it runs on."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqContext:
    """Sample boundaries of one rank's pack (THD), shared by all layers of a stage.

    Layers get hidden states ``[T_local, D]`` (with sequence parallelism ``T_local = T / tp``)
    and gather to the full local sequence ``[T, ...]`` before any sequence mixing; the fields
    below describe that full sequence. Padding, when present, is its own trailing segment in
    ``cu_seqlens`` so that no attention, state or convolution crosses into it.
    """

    cu_seqlens: torch.Tensor  # int32 [N+1], 0 .. T
    positions: torch.Tensor  # int64 [T], restarting at 0 per segment (RoPE)
    max_seqlen: int
    # real tokens are positions 0 .. num_real - 1 (the rest: the trailing padding segment);
    # None: every position is real. Known on the host (MoE routing excludes padding).
    num_real: int | None = None
    # the step's global loss-token count, in a training forward (aux losses are divided by it
    # as the LM loss is); None: no aux losses join (eval, verification forwards)
    loss_norm: float | None = None
    # context parallelism: this rank's chunks of the pack (``mimo.llm.cp.CPChunks``): every
    # segment of cu_seqlens is a chunk of a sample whose other chunks live on other CP ranks,
    # positions are the sample's, padding sits inside samples (``num_real`` counts the real
    # tokens, ``real_mask`` says where they are)
    cp: object = None
    # greedy generation: the stage's ``mimo.llm.cache.GenerationCache`` (a prefill, or a decode
    # step of one token per sample); None: a plain forward
    cache: object = None
    # M-RoPE: ``[3, T]`` int64 (time, height, width) positions of the same tokens as
    # ``positions`` (``PackedBatch.positions_3d``; under CP this rank's columns); None: every axis
    # is ``positions``. Read only by attention of an arch with ``mrope_section``
    positions_3d: torch.Tensor | None = None
    # ``train.attention: flex``: the pack's causal document ``BlockMask``
    # (``mimo.llm.attention.document_block_mask``), built once by ``LLMStage.context`` and read by
    # every attention layer; None: no flex (and never under CP or a generation cache)
    block_mask: object = None

    def real_mask(self) -> torch.Tensor | None:
        """``[T]`` bool, True at real tokens; None when every position is real."""
        if self.cp is not None:
            return self.cp.real_T
        t = self.positions.numel()
        if self.num_real is None or self.num_real >= t:
            return None
        return torch.arange(t, device=self.positions.device) < self.num_real

    @classmethod
    def from_seqlens(cls, seqlens: list[int], device: torch.device | str = "cpu") -> "SeqContext":
        cu = torch.tensor([0, *torch.tensor(seqlens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32, device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in seqlens]) if seqlens else torch.zeros(0, dtype=torch.int64, device=device)
        return cls(cu, positions, max(seqlens, default=0))

    @property
    def seqlens(self) -> list[int]:
        return torch.diff(self.cu_seqlens).tolist()

    @property
    def num_samples(self) -> int:
        """Samples of the pack (segments, the padding's included; under CP a sample's two
        chunks count once)."""
        n = len(self.cu_seqlens) - 1
        return n // 2 if self.cp is not None else n

    def sample_ids(self) -> torch.Tensor:
        """``[T]`` index of the sample each position belongs to (``segment_ids``; under CP a
        chunk's sample)."""
        if self.cp is not None:
            return torch.div(self.cp.chunk_T, 2, rounding_mode="floor")
        return self.segment_ids()

    def segment_ids(self) -> torch.Tensor:
        """``[T]`` index of the segment each position belongs to."""
        return segment_index(self.cu_seqlens, self.positions.numel())


def segment_index(cu_seqlens: torch.Tensor, t: int) -> torch.Tensor:
    """``[t]`` int64 segment of each position (positions past ``cu_seqlens[-1]``: one more
    trailing segment). A search, not ``repeat_interleave``: nothing is read on the host (no
    device sync, nothing for torch.compile to break at)."""
    cu = cu_seqlens.to(torch.int64)
    return torch.searchsorted(cu[1:], torch.arange(t, device=cu.device), right=True)
