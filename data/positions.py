"""Multimodal rotary positions (M-RoPE) of Qwen3-VL's language model: the 3-D position of every token.

Every token gets three positions (time, height, width) instead of one. Text tokens carry the
same value on all three axes, so a text-only sample is positioned exactly like plain RoPE. The
tokens of one image (or one video frame) share a start position ``p``: their time axis is
``p + frame``, their height axis ``p + row`` and their width axis ``p + column`` of the merged
patch grid. The text after it resumes at ``p + max(rows, columns)``, i.e. one past the largest
spatial position, not after the image's token count: an image costs as many positions as its
longer side, however many tokens it has.

Positions are data (docs/design.md §10): the data pipeline computes them from the token stream
and the grids and carries them in the pack (``PackedBatch.positions_3d``); the LLM turns them into
rotary tables (``mimo.llm.mrope``). The results match Hugging Face's
``Qwen3VLModel.get_rope_index`` (transformers 5.x) exactly; tests/test_mrope.py checks it.

Grids are given as Hugging Face gives them (``image_grid_thw`` / ``video_grid_thw``): ``(t, h, w)``
in vision patches, before the ``merge x merge`` spatial merge. A video of ``t`` temporal patches
is laid out frame by frame (each frame's tokens after its own vision-start token, a timestamp
between frames), and each frame is placed as an image of one time step.
"""

from __future__ import annotations

import torch

from mimo.core.errors import DataError

__all__ = ["TEXT", "IMAGE", "VIDEO", "positions_3d", "packed_positions_3d"]

TEXT, IMAGE, VIDEO = 0, 1, 2


def _grid_list(grids, what: str) -> list[tuple[int, int, int]]:
    if grids is None:
        return []
    rows = grids.tolist() if isinstance(grids, torch.Tensor) else [list(g) for g in grids]
    out = []
    for g in rows:
        if len(g) != 3 or min(int(v) for v in g) < 1:
            raise DataError(f"{what} grids must be positive (t, h, w) triples, got {g}")
        out.append((int(g[0]), int(g[1]), int(g[2])))
    return out


class _Grids:
    """The pack's image grids and video frames, consumed in order as their tokens appear (a
    video of ``t`` temporal patches becomes ``t`` one-step frames, one token block each)."""

    def __init__(self, image_grids, video_grids):
        self.images = _grid_list(image_grids, "image")
        self.frames = [(1, h, w) for t, h, w in _grid_list(video_grids, "video") for _ in range(t)]
        self.next = {IMAGE: 0, VIDEO: 0}

    def take(self, kind: int) -> tuple[int, int, int]:
        pool = self.images if kind == IMAGE else self.frames
        i = self.next[kind]
        if i >= len(pool):
            name = "image" if kind == IMAGE else "video frame"
            raise DataError(f"more {name} token blocks in the tokens than {name} grids given ({len(pool)})")
        self.next[kind] = i + 1
        return pool[i]

    def check_all_used(self) -> None:
        if self.next[IMAGE] != len(self.images) or self.next[VIDEO] != len(self.frames):
            raise DataError(f"grids left unused: {len(self.images) - self.next[IMAGE]} image(s), "
                            f"{len(self.frames) - self.next[VIDEO]} video frame(s); the tokens have fewer blocks")


def _vision_ids(t: int, h: int, w: int, start: int) -> torch.Tensor:
    """``[3, t*h*w]`` positions of one merged grid (row-major, as the vision tower emits)."""
    t_ids, h_ids, w_ids = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack((t_ids, h_ids, w_ids)).reshape(3, -1) + start


def _sample_positions(tokens_T: torch.Tensor, grids: _Grids, merge: int, image_token: int, video_token: int,
                      vision_start_token: int | None) -> torch.Tensor:
    n = int(tokens_T.numel())
    out_3T = torch.empty(3, n, dtype=torch.int64)
    if n == 0:
        return out_3T
    kind_T = torch.zeros(n, dtype=torch.int64)
    kind_T[tokens_T == image_token] = IMAGE
    kind_T[tokens_T == video_token] = VIDEO
    # runs of one kind: a text run, one image, or one video frame (frames are split by timestamps)
    bounds = [0] + (torch.nonzero(kind_T[1:] != kind_T[:-1]).flatten() + 1).tolist() + [n]
    pos = 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        kind = int(kind_T[a])
        if kind == TEXT:
            out_3T[:, a:b] = torch.arange(pos, pos + b - a)
            pos += b - a
            continue
        t, h, w = grids.take(kind)
        if h % merge or w % merge:
            raise DataError(f"grid {(t, h, w)} is not divisible by the spatial merge {merge}")
        gh, gw = h // merge, w // merge
        if b - a != t * gh * gw:
            raise DataError(f"a block of {b - a} vision tokens at {a} does not match its grid {(t, h, w)} "
                            f"({t * gh * gw} tokens after the {merge}x{merge} merge)")
        if vision_start_token is not None and (a == 0 or int(tokens_T[a - 1]) != vision_start_token):
            raise DataError(f"the vision block at token {a} does not follow a vision-start token")
        out_3T[:, a:b] = _vision_ids(t, gh, gw, pos)
        pos += max(gh, gw)
    return out_3T


def positions_3d(tokens_T, image_grids, video_grids, merge: int, image_token: int, video_token: int,
                 vision_start_token: int | None) -> torch.Tensor:
    """``[3, T]`` int64 (time, height, width) positions of ONE sample, starting at 0.

    ``tokens_T``: the sample's token ids (1-D tensor or list). ``image_grids`` / ``video_grids``:
    ``[N, 3]`` (t, h, w) per image / video in order of appearance, or None. ``merge``: the
    vision tower's spatial merge size. ``vision_start_token``: every vision block must follow
    one (as Qwen3-VL's processor writes them), so that tokens and grids that drifted apart
    fail here rather than train on misplaced positions; None skips that check. Every grid
    must be used by exactly one token block.
    """
    tokens_T = torch.as_tensor(tokens_T).flatten().cpu()
    grids = _Grids(image_grids, video_grids)
    out_3T = _sample_positions(tokens_T, grids, merge, image_token, video_token, vision_start_token)
    grids.check_all_used()
    return out_3T


def packed_positions_3d(tokens_T, cu_seqlens, image_grids, video_grids, merge: int, image_token: int,
                        video_token: int, vision_start_token: int | None) -> torch.Tensor:
    """``[3, T]`` positions of a packed THD batch, each sample (``cu_seqlens`` segment, as in
    ``PackedBatch``) restarting at 0 as if it ran alone, the 3-D analogue of
    ``PackedBatch.positions``. Grids are the whole pack's, in order of appearance; no image may
    straddle a sample boundary. Call it on the full pack, before context-parallel slicing (the
    slices keep each sample's whole-sample positions). Padding segments are text."""
    tokens_T = torch.as_tensor(tokens_T).flatten().cpu()
    cu = torch.as_tensor(cu_seqlens).cpu().tolist()
    if not cu or cu[0] != 0 or cu[-1] != tokens_T.numel() or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise DataError(f"cu_seqlens must rise from 0 to the token count {tokens_T.numel()}, got {cu}")
    grids = _Grids(image_grids, video_grids)
    parts = [_sample_positions(tokens_T[a:b], grids, merge, image_token, video_token, vision_start_token)
             for a, b in zip(cu[:-1], cu[1:])]
    grids.check_all_used()
    return torch.cat(parts, dim=1) if parts else torch.empty(3, 0, dtype=torch.int64)
