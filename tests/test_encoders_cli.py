"""`mimo verify-encoder` through the real entry point, and its user errors (exit 2, no traceback).

Each successful run starts tp local processes (torch + timm / transformers imports), so there
are two: a timm CLIP tower and a resampled HF SigLIP checkpoint. The rank function behind the
command (``mimo.encoders.verify.verify_case``) runs for every source kind, an HF config
included, in tests/test_encoders.py. User errors are found before any process starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mimo.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]
TIMM_KW = "depth=2,embed_dim=48,num_heads=6,img_size=32,patch_size=8"
HF_SMALL = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6,
            "image_size": 32, "patch_size": 8}


def run_cli(*args: str) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "-m", "mimo", *args], cwd=ROOT, capture_output=True, text=True, timeout=240)
    return p.returncode, p.stdout, p.stderr


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    clip = tmp_path_factory.mktemp("clip_config")
    transformers.CLIPVisionConfig(**HF_SMALL).save_pretrained(clip)  # config.json only
    siglip = tmp_path_factory.mktemp("siglip_ckpt")
    transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**HF_SMALL)).save_pretrained(siglip)
    # weights that do not fit their config.json (a narrower MLP declared)
    misfit = tmp_path_factory.mktemp("misfit_ckpt")
    transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**HF_SMALL)).save_pretrained(misfit)
    cfg = json.loads((misfit / "config.json").read_text())
    (misfit / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    return {"clip_config": str(clip), "siglip_checkpoint": str(siglip), "misfit": str(misfit)}


def test_verify_encoder_timm_clip():
    code, out, err = run_cli("verify-encoder", "--timm", "vit_base_patch16_clip_224.openai", "--timm-kwargs", TIMM_KW,
                             "--tp", "2", "--feature-layer", "-2")
    assert code == 0, err
    result = last_json(out)
    assert result["ok"] and not result["yardstick"]["failed"] and result["rows"] == 2 * 16
    assert "ok" in out.splitlines()[-2]


def test_verify_encoder_hf_checkpoint_resampled_with_grads(hf_dirs):
    code, out, err = run_cli("verify-encoder", "--hf-checkpoint", hf_dirs["siglip_checkpoint"], "--tp", "2",
                             "--feature-layer", "post_norm", "--image-size", "48", "--grads")
    assert code == 0, err
    result = last_json(out)
    assert result["ok"] and result["image_size"] == 48 and result["rows"] == 2 * 36
    assert "Traceback" not in err


@pytest.mark.parametrize("args,message", [
    (["--timm", "vit_does_not_exist"], "unknown timm model 'vit_does_not_exist'"),
    (["--timm", "vit_base_patch16_224", "--timm-kwargs", TIMM_KW, "--tp", "4"], "--tp 4 does not divide the model's heads (6)"),
    (["--timm", "vit_base_patch16_224", "--timm-kwargs", TIMM_KW, "--feature-layer", "3"], "feature_layer 3 is outside -2..2"),
    (["--timm", "vit_base_patch16_224", "--timm-kwargs", TIMM_KW, "--feature-layer", "last"], "--feature-layer must be an integer or post_norm"),
    (["--timm", "vit_base_patch16_224", "--timm-kwargs", TIMM_KW, "--image-size", "36"], "--image-size 36 must be a positive multiple"),
    (["--timm", "vit_base_patch16_224", "--weights", "/no/such.safetensors"], "weights file '/no/such.safetensors' not found"),
    (["--hf-config", "/no/such/dir"], "directory '/no/such/dir' not found"),
    (["--hf-checkpoint", "CLIP_CONFIG"], "has no model.safetensors"),
    (["--hf-checkpoint", "MISFIT"], "does not fit the config: tensor 'encoder.layers.0.mlp.fc1.weight' has shape (96, 48), "
                                    "the config expects (48, 48)"),
    (["--hf-config", "CLIP_CONFIG", "--weights", "w.pt"], "--timm-kwargs and --weights go with --timm"),
    ([], "one of the arguments --timm --hf-config --hf-checkpoint is required"),
])
def test_verify_encoder_user_errors(hf_dirs, capsys, args, message):
    args = [{"CLIP_CONFIG": hf_dirs["clip_config"], "MISFIT": hf_dirs["misfit"]}.get(a, a) for a in args]
    assert main(["verify-encoder", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    result = last_json(captured.out)
    assert result["ok"] is False and result["command"] in ("verify-encoder", None)
