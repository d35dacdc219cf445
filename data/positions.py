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

import numpy as np
import torch

from mimo.core.errors import DataError

__all__ = ["TEXT", "IMAGE", "VIDEO", "positions_3d", "packed_positions_3d", "layout_positions_3d"]

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


def layout_positions_3d(cu_S1: np.ndarray, real_len_N: np.ndarray, sample_U: np.ndarray, start_U: np.ndarray,
                        grid_U3: np.ndarray, merge: int) -> np.ndarray:
    """``[3, T]`` int64 M-RoPE positions of a pack from its layout alone, no token ids
    (``T = cu_S1[-1]``): what ``packed_positions_3d`` gives for the same pack, so every rank can
    compute them from the data plan. numpy over tokens and images, no Python loop.

    ``cu_S1``: the pack's segment bounds (``data/pack.py``'s ``cu_S1``, 0 .. T). Segment s < N is
    sample s: its ``real_len_N[s]`` real tokens, then the padding inside its segment (CP pads
    every sample); one more segment than samples is the pack's trailing (SP) padding.
    Image u (``sample_U`` non-decreasing, ``start_U`` ascending and disjoint within a sample)
    is ``t*h*w/merge**2`` consecutive tokens of sample ``sample_U[u]`` from its position
    ``start_U[u]``, grid ``grid_U3[u] = (t, h, w)`` in patches before the merge (a video frame:
    an image with t = 1). Every token outside an image is text.

    Text takes the running position p on all three axes, p rising by 1 per token and starting
    at 0 in every segment. An image starting at running position p gets ``p + (t_idx, h_idx,
    w_idx)`` over its merged ``(t, h/merge, w/merge)`` grid, row-major; after it p resumes at
    ``p + max(h, w)/merge`` whatever t (as ``packed_positions_3d``). So the text token at
    position i of its segment sits at ``i - sum(tokens - max(h, w)/merge)`` over the segment's
    images that end at or before it.

    Padding is text: the padding inside a sample's segment continues the sample's running
    position (one past its last real token's text position, or past its last image's advance
    when the sample ends with an image); the trailing padding segment counts 0, 1, 2, ... on
    every axis: what ``packed_positions_3d`` gives with pad-token (text) ids there. Every
    non-empty segment thus starts at 0 on every axis (an image at a sample's position 0 starts
    at (0, 0, 0)), as ``PackedBatch.validate`` requires. ``real_len_N`` only bounds the images
    (they must lie within the real tokens): the positions themselves do not depend on it.
    Raises DataError for a layout that is not one (images out of their sample, overlapping or
    out of order, grids not divisible by ``merge``, more than one padding segment).
    """
    cu_S1 = np.asarray(cu_S1, dtype=np.int64).reshape(-1)
    real_len_N = np.asarray(real_len_N, dtype=np.int64).reshape(-1)
    sample_U = np.asarray(sample_U, dtype=np.int64).reshape(-1)
    start_U = np.asarray(start_U, dtype=np.int64).reshape(-1)
    grid_U3 = np.asarray(grid_U3, dtype=np.int64).reshape(-1, 3)
    n_samples, n_images = len(real_len_N), len(sample_U)
    if merge < 1:
        raise DataError(f"the spatial merge must be >= 1, got {merge}")
    if cu_S1.size == 0 or cu_S1[0] != 0 or np.any(np.diff(cu_S1) < 0):
        raise DataError(f"cu_S1 must rise from 0, got {cu_S1.tolist()}")
    seg_len_S = np.diff(cu_S1)
    if len(seg_len_S) not in (n_samples, n_samples + 1):
        raise DataError(f"{len(seg_len_S)} segments for {n_samples} samples: want the samples and at most a padding one")
    if np.any(real_len_N < 0) or np.any(real_len_N > seg_len_S[:n_samples]):
        raise DataError("every sample's real length must fit its segment")
    if len(start_U) != n_images or len(grid_U3) != n_images:
        raise DataError(f"{n_images} images but {len(start_U)} starts and {len(grid_U3)} grids")
    T = int(cu_S1[-1])
    if n_images == 0:  # every token at its place in its segment
        return np.broadcast_to(np.arange(T, dtype=np.int64) - np.repeat(cu_S1[:-1], seg_len_S), (3, T)).copy()

    if np.any(grid_U3 < 1):
        raise DataError("image grids must be positive (t, h, w) triples")
    if np.any(grid_U3[:, 1:] % merge):
        raise DataError(f"image grids must be divisible by the spatial merge {merge}")
    t_U, gh_U, gw_U = grid_U3[:, 0], grid_U3[:, 1] // merge, grid_U3[:, 2] // merge
    n_U = t_U * gh_U * gw_U  # tokens
    end_U = start_U + n_U
    if np.any(sample_U < 0) or np.any(sample_U >= n_samples) or np.any(np.diff(sample_U) < 0):
        raise DataError("image samples must be non-decreasing sample indices")
    if np.any(start_U < 0) or np.any(end_U > real_len_N[sample_U]):
        raise DataError("every image must lie within its sample's real tokens")
    same = sample_U[1:] == sample_U[:-1]
    if np.any(same & (start_U[1:] < end_U[:-1])):
        raise DataError("a sample's images must be in order and must not overlap")

    # text position of pack token g in segment s: g - cu[s] minus what the images of s that end
    # at or before g saved (tokens - advance): saved[g] - saved[cu[s]], saved the running sum
    # over the pack (an image's own tokens see only the images before it; an image ending
    # exactly at its segment's end counts in saved[cu[s+1]], so the next segment restarts)
    g_end_U = cu_S1[sample_U] + end_U  # at most T; distinct (images are disjoint, non-empty)
    saved_T1 = np.zeros(T + 1, dtype=np.int64)
    saved_T1[g_end_U] = n_U - np.maximum(gh_U, gw_U)
    np.cumsum(saved_T1, out=saved_T1)
    base_T = np.arange(T, dtype=np.int64) - saved_T1[:T]
    base_T -= np.repeat(cu_S1[:-1] - saved_T1[cu_S1[:-1]], seg_len_S)
    out_3T = np.broadcast_to(base_T, (3, T)).copy()

    # image tokens, row by row of the merged grid (a row: gw tokens of one frame's grid row),
    # so that only repeats and one subtraction run over the tokens: the image's start position
    # p (its first token's text position), then p + (frame, row, column)
    g0_U = cu_S1[sample_U] + start_U  # the image's first token in the pack
    p_U = base_T[g0_U]
    rows_U = t_U * gh_U
    u_R = np.repeat(np.arange(n_images), rows_U)
    r_R = np.arange(len(u_R), dtype=np.int64) - np.repeat(np.cumsum(rows_U) - rows_U, rows_U)  # row in the image
    gh_R, gw_R, p_R = gh_U[u_R], gw_U[u_R], p_U[u_R]
    g_K = np.repeat(g0_U - (np.cumsum(n_U) - n_U), n_U) + np.arange(int(n_U.sum()), dtype=np.int64)
    out_3T[0, g_K] = np.repeat(p_R + r_R // gh_R, gw_R)
    out_3T[1, g_K] = np.repeat(p_R + r_R % gh_R, gw_R)
    row_first_R = np.cumsum(gw_R) - gw_R  # the row's first token among all image tokens
    out_3T[2, g_K] = np.arange(len(g_K), dtype=np.int64) - np.repeat(row_first_R - p_R, gw_R)
    return out_3T
