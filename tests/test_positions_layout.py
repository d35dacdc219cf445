"""``layout_positions_3d`` (M-RoPE positions from a pack's layout, no token ids) against
``packed_positions_3d`` on a synthesized token stream of the same pack: random ragged packs with
0..4 images per sample (t = 1 and t > 1, h != w, merge 2 and 1), text-only samples, images right
after the sample's first token (its vision start), images back to back (only a vision start
between), images ending a sample, CP padding inside samples and an SP padding segment."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mimo.core.batch import PackedBatch
from mimo.core.errors import DataError
from mimo.data.positions import layout_positions_3d, packed_positions_3d
from mimo.parallel.layout import PackLayout

IMG, VID, VS, VE, PAD = 60, 61, 58, 59, 0


def random_sample(rng: np.random.Generator, merge: int, vision_start: bool):
    """(tokens, [(start, (t, h, w))]) of one sample: text runs and images, each image after a
    vision start (when ``vision_start``), sometimes with a vision end, sometimes back to back."""
    tokens, images = [], []
    for _ in range(rng.integers(0, 5)):
        if rng.random() < 0.3 and (vision_start or not tokens):
            pass  # back to back with what came before (first image: right at the sample start)
        else:
            tokens += rng.integers(1, 50, rng.integers(1, 12)).tolist()
        t = 1 if rng.random() < 0.7 else int(rng.integers(2, 4))
        h, w = (int(rng.integers(1, 6)) * merge for _ in range(2))
        if vision_start:
            tokens.append(VS)
        images.append((len(tokens), (t, h, w)))
        tokens += [IMG] * (t * (h // merge) * (w // merge))
        if rng.random() < 0.5:
            tokens.append(VE)
    if rng.random() < 0.6 or not tokens:
        tokens += rng.integers(1, 50, rng.integers(1, 15)).tolist()  # else the sample ends with an image
    return tokens, images


def random_pack(seed: int):
    """A pack as data/pack.py lays it out: (tokens_T, cu_S1, real_len_N, sample_U, start_U, grid_U3, merge, vs)."""
    rng = np.random.default_rng(seed)
    merge = int(rng.choice([1, 2]))
    vision_start = bool(rng.random() < 0.8)
    samples = [random_sample(rng, merge, vision_start) if rng.random() < 0.8
               else (rng.integers(1, 50, rng.integers(1, 30)).tolist(), [])  # text only
               for _ in range(rng.integers(1, 7))]
    cp = int(rng.choice([1, 1, 2, 4]))
    tp = int(rng.choice([1, 2, 4, 8]))
    layout = PackLayout(tuple(len(t) for t, _ in samples), tp, cp, bool(rng.random() < 0.7))
    seg_N1 = np.concatenate([[0], np.cumsum(layout.padded_lens)]).astype(np.int64)
    total = layout.total_len
    cu_S1 = np.append(seg_N1, total) if total > seg_N1[-1] else seg_N1
    tokens_T = np.full(total, PAD, dtype=np.int64)
    sample_U, start_U, grid_U3 = [], [], []
    for s, ((tokens, images), off) in enumerate(zip(samples, seg_N1.tolist())):
        tokens_T[off:off + len(tokens)] = tokens
        for start, grid in images:
            sample_U.append(s)
            start_U.append(start)
            grid_U3.append(grid)
    real_len_N = np.array([len(t) for t, _ in samples], dtype=np.int64)
    return (tokens_T, cu_S1, real_len_N, np.array(sample_U, dtype=np.int64), np.array(start_U, dtype=np.int64),
            np.array(grid_U3, dtype=np.int64).reshape(-1, 3), merge, VS if vision_start else None)


def reference(tokens_T, cu_S1, grid_U3, merge, vs) -> np.ndarray:
    return packed_positions_3d(torch.from_numpy(tokens_T), torch.from_numpy(cu_S1), torch.from_numpy(grid_U3), None,
                               merge, IMG, VID, vs).numpy()


def test_equals_packed_positions_3d_on_random_packs():
    seen = dict(images=0, t_gt_1=0, at_start=0, back_to_back=0, ends_sample=0, cp_pad=0, sp_tail=0, merge1=0,
                text_only=0)
    for seed in range(300):
        tokens_T, cu_S1, real_len_N, sample_U, start_U, grid_U3, merge, vs = random_pack(seed)
        got_3T = layout_positions_3d(cu_S1, real_len_N, sample_U, start_U, grid_U3, merge)
        want_3T = reference(tokens_T, cu_S1, grid_U3, merge, vs)
        assert got_3T.dtype == np.int64 and got_3T.shape == (3, int(cu_S1[-1]))
        bad = np.flatnonzero((got_3T != want_3T).any(0))
        assert bad.size == 0, f"seed {seed}: first mismatch at {bad[:5]}: {got_3T[:, bad[:5]]} vs {want_3T[:, bad[:5]]}"
        # a pack carrying them passes PackedBatch.validate (0 on every axis at each segment start)
        T = int(cu_S1[-1])
        PackedBatch(tokens=torch.from_numpy(tokens_T),
                    positions=torch.from_numpy(np.arange(T) - np.repeat(cu_S1[:-1], np.diff(cu_S1))),
                    cu_seqlens=torch.from_numpy(cu_S1.astype(np.int32)), labels=torch.zeros(T, dtype=torch.int64),
                    loss_mask=torch.zeros(T, dtype=torch.bool), positions_3d=torch.from_numpy(got_3T)).validate()
        n_U = grid_U3[:, 0] * (grid_U3[:, 1] // merge) * (grid_U3[:, 2] // merge)
        same = sample_U[1:] == sample_U[:-1]
        seen["images"] += len(sample_U)
        seen["t_gt_1"] += int((grid_U3[:, 0] > 1).sum())
        seen["at_start"] += int((start_U == (1 if vs else 0)).sum())
        seen["back_to_back"] += int((same & (start_U[1:] == start_U[:-1] + n_U[:-1] + (1 if vs else 0))).sum())
        seen["ends_sample"] += int((start_U + n_U == real_len_N[sample_U]).sum())
        seen["cp_pad"] += int((np.diff(cu_S1)[:len(real_len_N)] > real_len_N).sum())
        seen["sp_tail"] += int(len(cu_S1) - 1 > len(real_len_N))
        seen["merge1"] += int(merge == 1 and len(sample_U) > 0)
        seen["text_only"] += len(real_len_N) - len(np.unique(sample_U))
    assert min(seen.values()) >= 10, seen  # every case the generator is meant to make came up


def test_by_hand():
    """One sample: 2 text, VS, image 1x4x6 (merged 2x3) at 3, VE, 1 text, then 3 padding; an SP
    padding segment of 2. Text after the image resumes at 3 + max(2, 3) = 6 (the VE)."""
    cu = np.array([0, 13, 15])
    got = layout_positions_3d(cu, [10], [0], [3], [[1, 4, 6]], 2)
    assert got[:, :10].tolist() == [[0, 1, 2, 3, 3, 3, 3, 3, 3, 6],
                                    [0, 1, 2, 3, 3, 3, 4, 4, 4, 6],
                                    [0, 1, 2, 3, 4, 5, 3, 4, 5, 6]]
    # the sample's padding continues its text; the SP segment restarts at 0
    assert got[:, 10:].tolist() == [[7, 8, 9, 0, 1]] * 3


def test_text_only_and_empty():
    cu = np.array([0, 5, 5, 12, 16])
    got = layout_positions_3d(cu, [5, 0, 6], np.zeros(0), np.zeros(0), np.zeros((0, 3)), 2)
    want = np.concatenate([np.arange(5), np.arange(7), np.arange(4)])
    assert np.array_equal(got, np.broadcast_to(want, (3, 16)))
    assert layout_positions_3d(np.array([0]), [], [], [], np.zeros((0, 3)), 2).shape == (3, 0)


def test_bad_layouts_fail():
    cu = np.array([0, 10, 12])
    ok = dict(cu_S1=cu, real_len_N=[10], sample_U=[0], start_U=[3], grid_U3=[[1, 4, 6]], merge=2)
    layout_positions_3d(**ok)
    for bad in (dict(start_U=[5]),  # runs past the real tokens
                dict(grid_U3=[[1, 3, 6]]),  # not divisible by the merge
                dict(sample_U=[1]),  # no such sample
                dict(real_len_N=[11]),  # longer than its segment
                dict(cu_S1=np.array([0, 4, 10, 12])),  # two padding segments for one sample
                dict(sample_U=[0, 0], start_U=[1, 2], grid_U3=[[1, 2, 4], [1, 2, 2]])):  # overlap
        with pytest.raises(DataError):
            layout_positions_3d(**{**ok, **bad})
