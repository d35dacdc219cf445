"""torchtitan's dense Qwen3 at the llava-1.3b text model's shapes: the dense anchor of
``bench/moe_llm_step.py --model dense`` (issue 55, item 1).

The harness is the MoE anchor's, ``torchtitan_moe_baseline.py`` (``--base``; by default where
``bench/moe_llm_step.py`` finds it): the same replay of mimo's synthetic documents, the same
build (meta device under bf16, ``init_weights``), per-block compile, compiled loss, FlexAttention
with document masks, fused AdamW, timing, profile and JSON line. Only the model differs:
torchtitan's own dense Qwen3 layers (``torchtitan.models.qwen3._build_qwen3_layers``, the builder
of its 0.6B-32B flavors: per-head QK-norm, SwiGLU) at 16 layers, hidden 2048, 16 heads / 16 kv
heads of 128, ffn 5632, vocab 32000, RMSNorm eps 1e-6, RoPE theta 1e4, untied head
(``configs/llava-1.3b-llm.yaml`` is mimo's side). Every parameter is active.

    python bench/torchtitan_dense_anchor.py [--base PATH] [the MoE anchor's arguments]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

# llava-1.3b's text model (the dense shapes the MoE anchor's arguments take)
DENSE_ARGS = ["--heads", "16", "--kv-heads", "16", "--head-dim", "128", "--ffn", "5632"]


def build_dense_config(a):
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, Qwen3Model, _build_qwen3_layers, _qwen3_norm

    return Qwen3Model.Config(
        vocab_size=a.vocab, dim=a.hidden, norm=_qwen3_norm(a.hidden), enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=a.vocab, embedding_dim=a.hidden, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=a.hidden, out_features=a.vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_layers(
            fuse_qkv=True, n_layers=a.layers, dim=a.hidden, n_heads=a.heads, n_kv_heads=a.kv_heads, head_dim=a.head_dim,
            hidden_dim=a.ffn, attn_backend=a.attn,
            rope=CosSinRoPE.Config(dim=a.head_dim, max_seq_len=a.max_seq_len, theta=a.rope_theta)),
    )


def all_params(model, experts: int, topk: int) -> tuple[int, int]:
    n = sum(p.numel() for p in model.parameters())
    return n, n


def load_base(path: Path):
    spec = importlib.util.spec_from_file_location("torchtitan_moe_baseline", path)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    base.build_config, base.active_params = build_dense_config, all_params
    return base


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("--base", help="path of torchtitan_moe_baseline.py")
    a, rest = p.parse_known_args(argv)
    if a.base is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from moe_llm_step import ANCHORS

        a.base = next((str(x) for x in ANCHORS if x.is_file()), None)
    if a.base is None or not Path(a.base).is_file():
        p.error(f"no torchtitan_moe_baseline.py at {a.base}; pass --base")
    tiny = "--tiny" in rest  # the MoE anchor's tiny model (its --tiny overrides the shapes)
    return load_base(Path(a.base)).main(([] if tiny else DENSE_ARGS) + rest)


if __name__ == "__main__":
    main()
