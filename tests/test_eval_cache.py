"""Greedy generation with a cache (``mimo.llm.cache``, ``eval.cache``) against generation without
one: the one-process stage token by token (logits at 1e-5, tokens equal) for attention,
multi-latent attention, Mamba-2, Gated DeltaNet and MoE layers, samples leaving the cache as they finish; ``mimo eval``'s
generation at tp2 dp2 (SP), tp2 pp2 and a non-colocated pp2 layout with cache and without (the
same tokens, counts and loss); the decode pack; bench/eval_cache.py on the CPU.

fp32 on the CPU: the cached path computes the same function by other sums (one step of each
recurrence, attention over the cache) than the whole-sequence forward, so logits agree to
float rounding (~1e-6 here), and the argmax tokens are equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mimo.core.testing import rel_err
from mimo.data.pack import PackItem, pack
from mimo.llm.cache import GenerationCache, decode_pack
from mimo.llm.config import HybridArch, MoEArch
from mimo.llm.model import LLMStage

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
PROMPTS = [37, 8, 3, 1, 13]  # chunks of 8: a sample over several chunks, one ending inside one, shorter than the conv


# ---------------------------------------------------------------- one process, token by token


def tiny_arch(pattern: str) -> HybridArch:
    return HybridArch(pattern=pattern, hidden=24, heads=6, kv_heads=2, vocab=50, ffn=32, init_std=0.5,
                      moe=MoEArch(experts=6, topk=2, ffn=8, shared_ffn=8),
                      mamba_heads=4, mamba_head_dim=6, mamba_state=5, mamba_groups=2, mamba_chunk=8,
                      gdn_heads=2, gdn_v_heads=4, gdn_head_dim=6, gdn_v_head_dim=5, gdn_chunk=8, conv_kernel=4,
                      mla_q_lora_rank=12, mla_kv_lora_rank=10, mla_qk_rope_head_dim=4, mla_qk_nope_head_dim=4, mla_v_head_dim=3)


def greedy(stage: LLMStage, prompts: list[list[int]], steps: int, cached: bool, finish: set) -> tuple[list, dict]:
    """Tokens and each step's logits; sample i stops after step s when (s, i) is in ``finish``.
    Without a cache every step packs prompt + generated tokens and runs them whole."""
    seqs, active = [list(p) for p in prompts], list(range(len(prompts)))
    logits: dict[int, list] = {i: [] for i in active}
    cache = GenerationCache(extra=2) if cached else None  # little room: the buffers grow too
    for step in range(steps):
        if cache is not None and cache.decoding:
            batch = decode_pack([seqs[i][-1] for i in active], [len(seqs[i]) - 1 for i in active], active, 1, False, 0)
            last = list(range(len(active)))
        else:
            batch = pack([PackItem(i, seqs[i], [False] * len(seqs[i]), {}) for i in active], {}, 1, 1, False, 0)
            last = (batch.cu_seqlens[1 : len(active) + 1] - 1).tolist()
        out = stage(batch, cache=cache)[last, : stage.arch.vocab]
        for j, i in enumerate(active):
            logits[i].append(out[j])
            seqs[i].append(int(out[j].argmax()))
        still = [i for i in active if (step, i) not in finish]
        if cache is not None:
            cache.keep([j for j, i in enumerate(active) if i in still])
        active = still
    return seqs, logits


@pytest.mark.parametrize("pattern", ["*-", "MG", "*E", "M*G-E", "+-+E"])
def test_cached_greedy_equals_whole_sequence_greedy(pattern):
    stage = LLMStage(tiny_arch(pattern))
    stage.init_weights(3)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 50, (n,), generator=gen).tolist() for n in PROMPTS]
    finish = {(1, 1), (4, 0)}  # rows leave the cache mid-batch and at its start
    with torch.no_grad():
        ref, ref_logits = greedy(stage, prompts, 8, False, finish)
        got, got_logits = greedy(stage, prompts, 8, True, finish)
    assert got == ref
    assert len({tuple(s[-4:]) for s in ref}) > 2  # the answers depend on the prompt
    err = max(rel_err(a, b) for i in ref_logits for a, b in zip(got_logits[i], ref_logits[i]))
    assert err <= TOL, f"logits of the cached steps differ by {err:.2e}"


def test_decode_pack_pads_as_pack_does():
    b = decode_pack([5, 6, 7], [10, 0, 3], [40, 41, 42], tp=2, sequence_parallel=True, pad_id=0)
    assert b.tokens.tolist() == [5, 6, 7, 0] and b.positions.tolist() == [10, 0, 3, 0]
    assert b.cu_seqlens.tolist() == [0, 1, 2, 3, 4] and b.num_real_tokens == 3
    assert decode_pack([5], [2], [9], tp=2, sequence_parallel=False, pad_id=0).num_tokens == 1


def test_a_decode_step_needs_one_token_per_row():
    stage = LLMStage(tiny_arch("*"))
    cache = GenerationCache()
    with torch.no_grad():
        stage(pack([PackItem(i, [1, 2, 3], [False] * 3, {}) for i in range(2)], {}, 1, 1, False, 0), cache=cache)
        with pytest.raises(ValueError, match="one token for each of the cache's 2 rows"):
            stage(decode_pack([4], [3], [0], 1, False, 0), cache=cache)


# ---------------------------------------------------------------- mimo eval through layouts


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    from mimo.compose.inputs import ensure_index
    from mimo.compose.config import load_config
    from mimo.data.demo import make_demo_data

    root = tmp_path_factory.mktemp("eval_cache")
    make_demo_data(str(root), train_samples=20, heldout_samples=16, shard_size=20, seed=4)
    with open(ROOT / "configs" / "demo.yaml") as f:
        cfg = yaml.safe_load(f)
    cfg["data"].update(shards=str(root / "train-{000000..000000}.tar"), tokenizer=str(root / "tokenizer"),
                       tokens_per_microbatch=400, max_sample_tokens=200)
    cfg["eval"] = {"shards": str(root / "heldout-{000000..000000}.tar"), "samples": 10, "max_new_tokens": 5}
    cfg["train"]["checkpoint"] = {"dir": str(root / "ckpt")}
    arch = cfg["modules"]["language"]["arch"]  # every cached layer kind, sizes tp=2 divides
    arch.update(pattern="MG*E-", init_std=0.5, gdn_head_dim=16, gdn_v_head_dim=16, mamba_groups=2,
                moe={"experts": 4, "topk": 2, "ffn": 32, "shared_ffn": 16})
    path = root / "eval_cache.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    config = load_config(str(path))
    ensure_index(config, shards=config.eval.shards)
    return str(path)


def cache_rank(config_path: str, overrides: list[str]) -> dict:
    """One rank: the held-out generation without the cache, then, stopping at a token the model
    emits for some samples only (so samples leave the cache at different steps), without and with it."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.compose.model import MimoModel
    from mimo.data.text import load_tokenizer
    from mimo.training.evaluation import EvalRequest, Evaluator, end_marker

    config = load_config(config_path, overrides)
    marker, _ = end_marker(config, load_tokenizer(config.data.tokenizer))
    req = EvalRequest(None, config.eval.shards, config.eval.samples, config.eval.max_new_tokens, marker, None)
    evaluator = Evaluator(config, MimoModel(config, dist.get_rank()), req)
    out = {"cache_on": evaluator.cache}  # off under context parallelism
    try:
        evaluator.cache = False
        first = [None] * dist.get_world_size()
        dist.all_gather_object(first, evaluator.run()["generated"])
        runs = [g for r in first for g in r.values()]
        req.stop_id = next(t for g in runs for t in g if 0 < sum(t in h for h in runs) < len(runs))
        for cached in (False, True):
            evaluator.cache = cached and out["cache_on"]
            out[cached] = evaluator.run()
        return out
    finally:
        evaluator.close()


TP2_DP2 = []  # the demo's layout: vision dp4, the LLM tp2 dp2 with sequence parallelism
TP2_PP2 = ["modules.language.parallel.dp=1", "modules.language.parallel.pp=2"]
NON_COLOCATED_PP2 = [
    "modules.vision.parallel.dp=2", "modules.vision.parallel.ranks=0:2", "modules.language.parallel.tp=1",
    "modules.language.parallel.dp=1", "modules.language.parallel.pp=2", "modules.language.parallel.ranks=2:4",
    "modules.language.parallel.sequence_parallel=false",
]


CP2 = ["modules.language.parallel.dp=1", "modules.language.parallel.cp=2"]  # the cache stays off: both runs uncached


@pytest.mark.parametrize("layout", [TP2_DP2, TP2_PP2, NON_COLOCATED_PP2, CP2],
                         ids=["tp2-dp2-sp", "tp2-pp2-sp", "noncolocated-pp2", "cp2-tp2-no-cache"])
def test_eval_generation_with_cache_equals_without(pools, config_path, layout):
    results = pools(4).run(cache_rank, config_path, layout)
    assert all(r["cache_on"] == (layout is not CP2) for r in results)
    plain = {k: v for r in results for k, v in r[False]["generated"].items()}
    cached = {k: v for r in results for k, v in r[True]["generated"].items()}
    assert cached == plain and len(plain) >= 5
    lengths = {len(g) for g in plain.values()}
    assert min(lengths) < 5 == max(lengths)  # some samples stopped early, some ran to max_new_tokens
    for r in results:
        for key in ("loss", "matched", "scored", "captions", "generated_tokens", "examples"):
            assert r[True][key] == r[False][key], key


# ---------------------------------------------------------------- the benchmark, tiny on the CPU


def test_bench_eval_cache_runs_tiny_on_cpu():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "eval_cache.py"), "--device", "cpu", "--tiny"],
                          capture_output=True, text=True, timeout=120, cwd="/tmp")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens_equal"] and result["cached_tokens_per_s"] > 0 and result["speedup"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU evaluation needs CUDA (this machine has none)")
def test_gpu_eval_gives_the_cpu_eval_exact_match(tmp_path):
    """``configs/demo.yaml`` trained 80 steps at its own layout (4 CPU ranks), evaluated at world 1
    (resharded) on the CPU and on the GPU (fp32; torch's defaults: no TF32 in matmuls, TF32 in
    cuDNN's patch convolution), with and without the cache: the same exact match and counts,
    the loss within 5e-3 relative (the convolution's TF32 rounding)."""
    from mimo.data.demo import make_demo_data

    make_demo_data(str(tmp_path / "demo-data"), seed=3)
    config = str(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml")
    one = ["world_size=1", "modules.vision.parallel.dp=1", "modules.vision.parallel.ranks=0:1",
           "modules.language.parallel.tp=1", "modules.language.parallel.dp=1", "modules.language.parallel.ranks=0:1",
           "modules.language.parallel.sequence_parallel=false", "eval.samples=100"]

    def mimo(*args):
        proc = subprocess.run([sys.executable, "-m", "mimo", *args], cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    mimo("train", config, "train.steps=80", "--device", "cpu")
    ckpt = str(tmp_path / "runs" / "demo" / "ckpt")
    cpu = mimo("eval", config, *one, "--checkpoint", ckpt, "--device", "cpu")
    assert cpu["scored"] > 0
    for cache in ("true", "false"):
        gpu = mimo("eval", config, *one, f"eval.cache={cache}", "--checkpoint", ckpt, "--device", "cuda")
        print("cpu", cpu, "gpu", cache, gpu)
        assert (gpu["matched"], gpu["scored"], gpu["generated_tokens"]) == (cpu["matched"], cpu["scored"], cpu["generated_tokens"])
        assert gpu["exact_match"] == cpu["exact_match"] and abs(gpu["loss"] - cpu["loss"]) <= 5e-3 * cpu["loss"], (gpu, cpu)
