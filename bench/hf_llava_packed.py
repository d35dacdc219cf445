"""The Hugging Face LLaVA anchors, padding-free: the models and samples of
``../shared/bench/hf_llava_baseline.py`` (dense: CLIP ViT-L/14-224 + a 16-layer Llama) and
``hf_llava_moe_baseline.py`` (the same tower + a 16-layer Qwen3-MoE of 64 experts, top 8), each
batch packed into one row instead of padded (issue 49, item 2: HF's strongest configuration).

The sample stream is the anchors' own, draw for draw (generator seeded 1: per batch the ``B``
text lengths in 32..1535, each sample's ids, then the pixels): sample ``i`` is 256 image tokens
and its text. Packed, the batch is one row ``[1, sum(256 + L_i)]`` with ``position_ids``
restarting at 0 in every sample and no attention mask, which transformers reads as packed
sequences (``masking_utils.find_packed_sequence_indices``: attention never crosses a sample);
labels are the ids with image tokens ignored, so the loss is the padded batch's (every sample
starts with image tokens: no prediction crosses a boundary) and so are the real tokens (the
row has no padding). ``tests/test_bench_llava.py`` checks both equalities on the CPU.

    python bench/hf_llava_packed.py dense|moe [ATTN] [EXPERTS]   # env: B, STEPS, COMPILE=1
                                                                 # (each decoder layer compiled)

ATTN: sdpa (default) | flex_attention | eager; EXPERTS (moe): grouped_mm (default) | eager.
Prints one JSON line with the padded anchors' keys (``padded_fraction`` 0). ``DEVICE=cpu
TINY=1``: tiny models, fp32, for the suite.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

VOCAB = 32000
IMG_TOK = VOCAB - 1


def build(kind: str, attn: str, experts: str, tiny: bool):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen3MoeConfig

    if tiny:
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=28, patch_size=14)
    else:
        vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                  num_attention_heads=16, image_size=224, patch_size=14)
    if kind == "dense":
        text = (LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096) if tiny else
                LlamaConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                            num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096))
    else:
        shape = (dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
                 if tiny else
                 dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8))
        text = Qwen3MoeConfig(vocab_size=VOCAB, norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=4096,
                              router_aux_loss_coef=0.001, output_router_logits=False, **shape)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMG_TOK,
                      vision_feature_select_strategy="default", vision_feature_layer=-2)
    cfg._attn_implementation = attn
    model = LlavaForConditionalGeneration(cfg)
    set_on = 0
    for m in model.modules():  # as the MoE anchor: the experts' implementation on their config
        if hasattr(m, "_apply_gate") and experts != "eager":
            m.config._experts_implementation = experts
            set_on += 1
    return model, (vision.image_size // vision.patch_size) ** 2, set_on


def draw(g: torch.Generator, b: int, n_img: int, image_size: int):
    """One batch of the anchors' stream: (each sample's text ids, pixels)."""
    lens = torch.randint(32, 1536, (b,), generator=g)
    texts = [torch.randint(1, VOCAB - 2, (n,), generator=g) for n in lens.tolist()]
    return texts, torch.randn(b, 3, image_size, image_size, generator=g)


def padded(texts, n_img: int):
    """The anchors' padded batch: ids, mask, labels."""
    L = n_img + max(len(t) for t in texts)
    ids = torch.zeros(len(texts), L, dtype=torch.long)
    mask = torch.zeros(len(texts), L, dtype=torch.long)
    for i, t in enumerate(texts):
        ids[i, :n_img] = IMG_TOK
        ids[i, n_img:n_img + len(t)] = t
        mask[i, :n_img + len(t)] = 1
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[ids == IMG_TOK] = -100
    return ids, mask, labels


def packed(texts, n_img: int):
    """The same samples as one row: ids, restarting positions, labels (image tokens ignored)."""
    ids = torch.cat([torch.cat((torch.full((n_img,), IMG_TOK), t)) for t in texts])[None]
    pos = torch.cat([torch.arange(n_img + len(t)) for t in texts])[None]
    labels = ids.clone()
    labels[ids == IMG_TOK] = -100
    return ids, pos, labels


def packed_loss(model, ids, pos, px, labels) -> torch.Tensor:
    """The training forward on a packed row: no attention mask, restarting ``position_ids``, and no
    cache (transformers turns packed-sequence masking off where a cache is passed or made, and a
    training forward makes one unless told not to: every sample would then attend to the ones
    before it)."""
    return model(input_ids=ids, position_ids=pos, pixel_values=px, labels=labels, use_cache=False).loss


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    kind = argv[0] if argv else "dense"
    attn = argv[1] if len(argv) > 1 else "sdpa"
    experts = argv[2] if len(argv) > 2 else "grouped_mm"
    if kind not in ("dense", "moe"):
        raise SystemExit(f"model kind {kind!r}: dense or moe")
    dev = os.environ.get("DEVICE", "cuda")
    tiny = os.environ.get("TINY") == "1"
    b, steps, compiled = int(os.environ.get("B", 8 if kind == "dense" else 4)), int(os.environ.get("STEPS", 13)), \
        os.environ.get("COMPILE") == "1"
    torch.manual_seed(0)
    model, n_img, set_on = build(kind, attn, experts, tiny)
    dtype = torch.float32 if tiny else torch.bfloat16
    model = model.to(dev, dtype)
    model.train()
    if compiled:  # each decoder layer, for the packed row's changing length (torchtitan's way)
        for layer in model.model.language_model.layers:
            layer.compile(dynamic=True)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    n_vis, n_all = count(model.model.vision_tower), count(model)
    n_exp = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    k_of_e = (model.config.text_config.num_experts_per_tok, model.config.text_config.num_experts) if kind == "moe" else (1, 1)
    n_llm_active = n_all - n_vis - n_exp + n_exp * k_of_e[0] // k_of_e[1]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
    g = torch.Generator().manual_seed(1)
    image_size = model.config.vision_config.image_size
    batches = []
    for _ in range(steps):
        texts, px = draw(g, b, n_img, image_size)
        ids, pos, labels = packed(texts, n_img)
        batches.append((ids.to(dev), pos.to(dev), labels.to(dev), px.to(dev, dtype), ids.shape[1]))

    def step(batch):
        ids, pos, labels, px, _ = batch
        loss = packed_loss(model, ids, pos, px, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    losses = [float(step(x)) for x in batches[:3]]
    sync()
    real = 0
    t0 = time.perf_counter()
    for x in batches[3:]:
        losses.append(step(x))
        real += x[4]
    sync()
    dt = time.perf_counter() - t0
    timed = len(batches) - 3
    flops = 6 * n_llm_active * real + 6 * n_vis * timed * b * (n_img + 1)
    res = dict(anchor=f"hf LlavaForConditionalGeneration ({'Llama' if kind == 'dense' else 'Qwen3MoE'}) {dtype} packed",
               model=kind, attn=attn, experts_impl=experts if kind == "moe" else None, experts_modules_set=set_on,
               compiled_layers=compiled, batch=b, params_total=n_all, params_vision=n_vis, params_llm_active=n_llm_active,
               step_s=dt / timed, real_tokens_per_s=real / dt, padded_fraction=0.0, model_tflops_per_s=flops / dt / 1e12,
               peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None, torch=torch.__version__,
               losses=[float(x) for x in losses])
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
