"""``mimo verify-hf``: a whole Qwen3-VL / Qwen3-VL-MoE (tower, deepstack, M-RoPE, LLM, head) at a
TP / EP layout against transformers' model, fp64 yardstick (docs/design.md §9.7).

Tiny models with odd sizes, built with transformers' config classes and saved with
``save_pretrained``: dense with 6 vision heads of 8 (3 per rank at tp 2), deepstack after
vision blocks 1 and 2 of 4, mrope sections [2, 1, 1], vocab 97 (padded at tp 2), an untied
head; MoE with 3 vision heads, deepstack after blocks 0 and 3, 6 experts (top 2, one dense
layer), sections [1, 2, 1], a tied head. Samples: a video of 4 frames (2 temporal patches),
two images of other sizes, text. Layouts: dense tp 1 and tp 2 (config only: random weights),
MoE tp 1 (a directory with weights: transformers' ``from_pretrained`` and mimo's importers read
it) and ep 2 (two data-parallel packs, tokens dispatched to the experts across ranks).
Planted bugs (deepstack scaled, two tower tensors swapped as a wrong mapping would, the
tower's rows in Hugging Face's images-then-videos order instead of token order, vision tokens
at 1-D positions) each fail by more than 100x their bound. The video rows' layout equals the
video processor's ``patchify``. A config that is not Qwen3-VL fails the command with exit 2.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mimo.commands.cli import main
from mimo.commands.verify_hf import randomize_vlm_, verify_hf

TOL = 1e-5
WORLD = 2  # one pool for every case: a tp 1 layout runs on rank 0, rank 1 idles
IDS = dict(image_token_id=93, video_token_id=94, vision_start_token_id=95, vision_end_token_id=96)
VISION = dict(depth=4, hidden_size=48, intermediate_size=40, num_heads=6, out_hidden_size=32, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[1, 2], num_position_embeddings=16)
TEXT = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8,
            rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 1, 1], mrope_interleaved=True))
MODELS = {
    "dense": ("Qwen3VLConfig", TEXT, VISION, False),
    "moe": ("Qwen3VLMoeConfig",
            dict(TEXT, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12, mlp_only_layers=[1],
                 rope_parameters=dict(rope_type="default", rope_theta=5e5, mrope_section=[1, 2, 1])),
            dict(VISION, hidden_size=24, num_heads=3, deepstack_visual_indexes=[0, 3]), True),
}


def hf_config(name: str):
    import transformers

    cls, text, vision, tied = MODELS[name]
    return getattr(transformers, cls)(text_config=text, vision_config=vision, tie_word_embeddings=tied, **IDS)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """{name: directory}: dense and moe as config.json only; "moe weights": a randomised MoE
    saved with its weights."""
    import transformers

    out = {}
    for name in MODELS:
        out[name] = str(tmp_path_factory.mktemp(name))
        hf_config(name).save_pretrained(out[name])
    model = transformers.Qwen3VLMoeForConditionalGeneration(hf_config("moe"))
    randomize_vlm_(model, 5)
    out["moe weights"] = str(tmp_path_factory.mktemp("moe_weights"))
    model.save_pretrained(out["moe weights"])
    return out


def summary(r: dict) -> str:
    worst = r["yardstick"]["worst"][0]
    return (f"logits {r['max_logits_rel_err']:.2e}, loss {r['loss_rel_err']:.2e}, grads {r['max_grad_rel_err']:.2e} "
            f"({r['worst_grad']}); tightest {worst['name']}: {worst['err_vs_fp64']:.2e} vs bound {worst['bound']:.2e}")


CASES = {"dense tp1": ("dense", 1, 1), "dense tp2": ("dense", 2, 1), "moe tp1 (weights)": ("moe weights", 1, 1),
         "moe ep2": ("moe", 1, 2)}


@pytest.mark.parametrize("case", list(CASES))
def test_layout_equals_hugging_face(pools, dirs, case):
    name, tp, ep = CASES[case]
    r = verify_hf(dirs[name], pools(WORLD), tp=tp, ep=ep, seed=1)
    print(f"{case}: {summary(r)}")
    assert r["ok"], json.dumps(r["yardstick"], indent=1)
    assert r["labels_agree"] and r["grads_checked"] > 50
    assert r["weights"] == ("checkpoint" if name == "moe weights" else "random (seed 1)")
    kinds = [(bool(s["image_grids"]), bool(s["video_grids"])) for s in r["samples"]]
    assert kinds == [(False, True), (True, False), (False, False)]
    images, video = r["samples"][1]["image_grids"], r["samples"][0]["video_grids"]
    assert len(images) == 2 and images[0] != images[1] and video[0][0] == 2
    assert r["layout"]["llm"]["dp"] == ep and r["layout"]["tower"]["tp"] == tp
    # worst-case margins: at least a few times below the bound, far above exact (something ran)
    assert max(m["err_vs_fp64"] / m["bound"] for m in r["yardstick"]["worst"]) < 0.5
    assert r["max_logits_rel_err"] > 0 and r["max_grad_rel_err"] > 0


# ---------------------------------------------------------------- planted bugs (run on the worker)


def scaled_deepstack(vlm):
    """Deepstack levels arrive doubled (a wrong scale on the way to the LLM)."""
    forward, d = vlm.tower.forward, vlm.tower.arch.out_hidden

    def doubled(pixels, grids):
        rows = forward(pixels, grids)
        return torch.cat([rows[:, :d], 2 * rows[:, d:]], dim=1)

    vlm.tower.forward = doubled


def swapped_tower_tensors(vlm):
    """The mapping swapped two tensors of one shape: blocks 0 and 1's fused qkv weights."""
    a, b = (vlm.tower.blocks[i].attn.qkv.weight for i in (0, 1))
    with torch.no_grad():
        tmp = a.clone()
        a.copy_(b)
        b.copy_(tmp)


def hf_concat_order(vlm):
    """The tower run on the pack's images, then its videos (Hugging Face's concatenation),
    while the rows land on the slots in token order."""
    rows = vlm.rows

    def reordered(pack):
        sizes = (pack.grids_N3.prod(1)).tolist()
        pieces = list(torch.split(pack.pixels_PJ, sizes))
        order = [i for i, k in enumerate(pack.kinds) if k == "image"] + [i for i, k in enumerate(pack.kinds) if k == "video"]
        moved = type(pack)(pack.batch, torch.cat([pieces[i] for i in order]), pack.grids_N3[order],
                           [pack.kinds[i] for i in order])
        return rows(moved)

    vlm.rows = reordered


def one_d_positions(vlm):
    """Vision tokens rotated at their 1-D positions (the pack's M-RoPE positions dropped)."""
    forward = vlm.forward

    def plain(pack):
        pack.batch.positions_3d = None
        return forward(pack)

    vlm.forward = plain


MUTATIONS = {"scaled deepstack": scaled_deepstack, "swapped tower tensors": swapped_tower_tensors,
             "HF concat order": hf_concat_order, "1-D positions": one_d_positions}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_planted_bugs_fail(pools, dirs, mutation):
    r = verify_hf(dirs["dense"], pools(WORLD), seed=1, mutate=MUTATIONS[mutation])
    worst = r["yardstick"]["worst"][0]
    ratio = worst["err_vs_fp64"] / worst["bound"]
    print(f"{mutation}: {worst['name']} {worst['err_vs_fp64']:.2e} = {ratio:.0f}x its bound")
    assert not r["ok"] and ratio > 100, summary(r)


# ---------------------------------------------------------------- pieces


def test_video_rows_are_the_video_processors():
    """``video_patches`` lays frames out as transformers' Qwen3-VL video processor's ``patchify``
    (frames already at a valid size, so no resize; 3 frames: the last repeated to 4)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from mimo.compose.native_vlm import image_spec, video_patches
    from mimo.encoders.qwen3_vl import Qwen3VisionArch

    spec = image_spec(Qwen3VisionArch.from_hf_config(VISION))
    frames = [np.random.default_rng(i).integers(0, 256, (16, 24, 3), dtype=np.uint8) for i in range(3)]
    rows, grid = video_patches(frames, spec)
    video = torch.stack([(torch.from_numpy(f).permute(2, 0, 1).float() - 127.5) / 127.5 for f in frames])[None]
    want, t, h, w = Qwen3VLVideoProcessor().patchify(video, patch_size=4, merge_size=2, temporal_patch_size=2)
    assert grid == (t, h, w) == (2, 4, 6)
    assert torch.equal(rows, want[0])


def test_not_qwen3_vl_is_a_clear_error(tmp_path, capsys, dirs):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    cases = [([str(tmp_path)], "model_type 'gpt2' is not supported by verify-hf"),
             ([dirs["moe"], "--tp", "2"], "tp=2 does not divide the Qwen3-VL tower's heads (3)"),
             ([dirs["dense"], "--ep", "2"], "qwen3_vl has no experts")]
    for argv, message in cases:
        code = main(["verify-hf", *argv])
        out, err = capsys.readouterr()
        assert code == 2 and "Traceback" not in err and message in err, (code, err)
        result = json.loads(out.strip().splitlines()[-1])
        assert result["ok"] is False and message in result["errors"][0]
