"""M-RoPE (data/positions.py, llm/mrope.py) against Hugging Face's Qwen3-VL: ``Qwen3VLModel.get_rope_index`` on a
tiny model for the 3-D positions, ``Qwen3VLTextRotaryEmbedding`` and ``apply_rotary_pos_emb``
for the tables and the rotation. Non-default, uneven mrope sections; images with h != w and
t > 1; a video of two frames; a pack of samples each checked against HF run alone."""

from __future__ import annotations

import pytest
import torch

from mimo.core.errors import ConfigError, DataError
from mimo.data.positions import packed_positions_3d, positions_3d
from mimo.llm.mrope import apply_mrope, mrope_axes, mrope_cos_sin
from mimo.llm.rope import RopeConfig, inv_freq, rope_tables

IMG, VID, VS, VE = 60, 61, 58, 59
MERGE = 2
THETA = 5e6


def hf_config(head_dim: int = 16, sections=(2, 3, 3)):
    from transformers import Qwen3VLConfig

    rope = dict(rope_type="default", rope_theta=THETA, mrope_section=list(sections), mrope_interleaved=True)
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=head_dim, rope_parameters=rope)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                  spatial_merge_size=MERGE, deepstack_visual_indexes=[0], num_position_embeddings=16)
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
                         vision_start_token_id=VS, vision_end_token_id=VE)


@pytest.fixture(scope="module")
def hf_model():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    torch.manual_seed(0)
    return Qwen3VLModel(hf_config()).eval()


def text(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (n,), generator=g).tolist()


def image(t: int, h: int, w: int, tok: int = IMG) -> list[int]:
    return [VS] + [tok] * (t * (h // MERGE) * (w // MERGE)) + [VE]


def video(t: int, h: int, w: int, seed: int) -> list[int]:
    """Qwen3-VL's video layout: per temporal patch a timestamp (text), then its own vision block."""
    out = []
    for f in range(t):
        out += text(3, seed + f) + image(1, h, w, VID)
    return out


# (tokens, image grids, video grids): 0, 1 and 2 images, a video, an image and a video together
SAMPLES = {
    "text_only": (text(7, 1), [], []),
    "one_image_h_ne_w": (text(4, 2) + image(1, 4, 6) + text(5, 3), [(1, 4, 6)], []),
    "two_images_t2": (text(3, 4) + image(2, 6, 4) + text(2, 5) + image(1, 2, 2) + text(4, 6),
                      [(2, 6, 4), (1, 2, 2)], []),
    "image_first_last": (image(1, 8, 4) + text(2, 7) + image(1, 2, 6),
                         [(1, 8, 4), (1, 2, 6)], []),
    "video": (text(5, 8) + video(2, 4, 6, 9) + text(3, 10), [], [(2, 4, 6)]),
    "image_and_video": (text(2, 11) + image(1, 6, 2) + text(2, 12) + video(3, 2, 4, 13) + text(2, 14),
                        [(1, 6, 2)], [(3, 2, 4)]),
}


def hf_positions(model, tokens, images, videos) -> torch.Tensor:
    ids = torch.tensor([tokens])
    kinds = torch.zeros_like(ids, dtype=torch.int32)
    kinds[ids == IMG] = 1
    kinds[ids == VID] = 2
    pos, _ = model.get_rope_index(ids, mm_token_type_ids=kinds,
                                  image_grid_thw=torch.tensor(images) if images else None,
                                  video_grid_thw=torch.tensor(videos) if videos else None)
    return pos[:, 0]


def ours(tokens, images, videos) -> torch.Tensor:
    return positions_3d(tokens, images or None, videos or None, MERGE, IMG, VID, VS)


@pytest.mark.parametrize("name", list(SAMPLES))
def test_positions_equal_hf(hf_model, name):
    tokens, images, videos = SAMPLES[name]
    got_3T = ours(tokens, images, videos)
    want_3T = hf_positions(hf_model, tokens, images, videos)
    assert got_3T.dtype == torch.int64 and got_3T.shape == (3, len(tokens))
    assert torch.equal(got_3T, want_3T), f"{name}:\n{got_3T}\n{want_3T}"


def test_positions_by_hand():
    """Independent of HF: the image (grid 1x4x6, merged 2x3) starts where its text left off,
    and the text after it resumes at start + max(2, 3), not start + its 6 tokens."""
    tokens = [1, 2, VS] + [IMG] * 6 + [VE, 3]
    got_3T = positions_3d(tokens, [(1, 4, 6)], None, MERGE, IMG, VID, VS)
    s = 3
    want = [[0, 1, 2] + [s] * 6 + [s + 3, s + 4],
            [0, 1, 2] + [s, s, s, s + 1, s + 1, s + 1] + [s + 3, s + 4],
            [0, 1, 2] + [s, s + 1, s + 2] * 2 + [s + 3, s + 4]]
    assert got_3T.tolist() == want
    only_text = positions_3d(list(range(9)), None, None, MERGE, IMG, VID, VS)
    assert torch.equal(only_text, torch.arange(9).expand(3, 9))


def test_packed_each_sample_as_alone(hf_model):
    names = ["two_images_t2", "text_only", "image_and_video"]
    tokens, images, videos, lens = [], [], [], []
    for n in names:
        t, i, v = SAMPLES[n]
        tokens += t
        images += i
        videos += v
        lens.append(len(t))
    tokens += [0] * 5  # padding segment
    lens.append(5)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    got_3T = packed_positions_3d(torch.tensor(tokens), cu, torch.tensor(images), torch.tensor(videos), MERGE, IMG,
                                 VID, VS)
    assert got_3T.shape == (3, len(tokens))
    for k, n in enumerate(names):
        a, b = int(cu[k]), int(cu[k + 1])
        assert torch.equal(got_3T[:, a:b], hf_positions(hf_model, *SAMPLES[n])), n
    assert torch.equal(got_3T[:, -5:], torch.arange(5).expand(3, 5))


def test_mismatched_tokens_and_grids_fail():
    tokens, images, _ = SAMPLES["two_images_t2"]
    with pytest.raises(DataError, match="does not match"):
        positions_3d(tokens, [(1, 6, 4), (1, 2, 2)], None, MERGE, IMG, VID, VS)
    with pytest.raises(DataError, match="left unused"):
        positions_3d(tokens, images + [(1, 2, 2)], None, MERGE, IMG, VID, VS)
    with pytest.raises(DataError, match="more image"):
        positions_3d(tokens, images[:1], None, MERGE, IMG, VID, VS)
    with pytest.raises(DataError, match="vision-start"):
        positions_3d([1, IMG, 2], [(1, 2, 2)], None, MERGE, IMG, VID, VS)
    # an image split across two samples of a pack
    toks = [VS] + [IMG] * 4
    with pytest.raises(DataError):
        packed_positions_3d(toks, [0, 3, 5], [(1, 4, 4)], None, MERGE, IMG, VID, VS)


def test_axes_layout():
    """Real Qwen3-VL (head_dim 128, sections 24/20/20): h and w interleave over the first 60."""
    axes = mrope_axes(128, [24, 20, 20]).tolist()
    assert axes[:6] == [0, 1, 2, 0, 1, 2] and axes[57:] == [0, 1, 2, 0, 0, 0, 0]
    assert [axes.count(a) for a in range(3)] == [24, 20, 20]
    with pytest.raises(ConfigError):
        mrope_axes(16, [3, 3, 3])


@pytest.mark.parametrize("head_dim,sections", [(16, (2, 3, 3)), (32, (6, 5, 5)), (24, (4, 4, 4))])
def test_cos_sin_and_rotation_equal_hf(head_dim, sections):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding, apply_rotary_pos_emb

    cfg = hf_config(head_dim, sections).text_config
    rot = Qwen3VLTextRotaryEmbedding(cfg)
    tokens, images, videos = SAMPLES["image_and_video"]
    pos_3T = ours(tokens, images, videos)
    T, H = pos_3T.shape[1], 3
    g = torch.Generator().manual_seed(head_dim)
    q_THd = torch.randn(T, H, head_dim, generator=g) * 3
    k_THd = torch.randn(T, 1, head_dim, generator=g) * 3
    worst = 0.0
    for scaling in (1.0, 0.75):
        rot.attention_scaling = scaling
        cos_TD, sin_TD = mrope_cos_sin(pos_3T, head_dim, THETA, sections, attention_scaling=scaling)
        assert cos_TD.shape == (T, head_dim) and cos_TD.dtype == torch.float32
        for dtype in (torch.float32, torch.bfloat16):
            hf_cos, hf_sin = rot(q_THd.to(dtype), pos_3T[:, None, :])
            q, k = q_THd.to(dtype), k_THd.to(dtype)
            hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
            mq, mk = apply_mrope(q, k, cos_TD, sin_TD)
            diffs = [(cos_TD.to(dtype) - hf_cos[0]).abs().max(), (sin_TD.to(dtype) - hf_sin[0]).abs().max(),
                     (mq - hq[0].transpose(0, 1)).abs().max(), (mk - hk[0].transpose(0, 1)).abs().max()]
            worst = max(worst, max(float(d) for d in diffs))
            assert mq.dtype == dtype
            tol = 1e-6 if dtype == torch.float32 else 0.0
            for d in diffs:
                assert float(d) <= tol * 10, (dtype, scaling, diffs)
    print(f"head_dim {head_dim} sections {sections}: max |mimo - HF| over cos/sin/q/k = {worst:.3g}")


def test_text_only_is_plain_rope():
    """Equal positions on all axes make M-RoPE plain RoPE: the tables equal mimo's 1-D ones."""
    pos_T = torch.arange(40)
    cos_TD, sin_TD = mrope_cos_sin(pos_T.expand(3, -1), 16, THETA, (2, 3, 3))
    c, s = rope_tables(pos_T, inv_freq(RopeConfig(16, THETA)))
    assert torch.equal(cos_TD, c) and torch.equal(sin_TD, s)
