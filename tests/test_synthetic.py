"""``data.source: synthetic`` (mimo.data.synthetic): the baseline's exact sample stream, packed
by mimo's own packing, layout-independent and seekable; its config checks; a CPU training step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mimo.compose.config import load_config
from mimo.core.errors import ConfigError
from mimo.compose.inputs import data_plan, sample_reader
from mimo.data.pack import pack
from mimo.llm.model import count_loss_tokens

ROOT = Path(__file__).resolve().parents[1]
LLAVA = ROOT / "configs/llava-1.3b.yaml"
SMALL = ["modules.vision.arch.image_size=28", "modules.vision.arch.hidden=32", "modules.vision.arch.layers=2",
         "modules.vision.arch.heads=2", "modules.vision.arch.mlp=64", "modules.language.arch.pattern='*-'",
         "modules.language.arch.hidden=64", "modules.language.arch.heads=4", "modules.language.arch.kv_heads=4",
         "modules.language.arch.ffn=128", "modules.language.arch.vocab=512", "data.synthetic.text_tokens=[8,60]",
         "data.tokens_per_microbatch=1024", "data.max_sample_tokens=128", "train.precision=fp32"]


def _baseline_batches(n: int, samples=8, vocab=32000, img_tok=256, seed=1):
    """What ../shared/bench/hf_llava_baseline.py's batch() draws, in its order (text ids, pixels)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lens = torch.randint(32, 1536, (samples,), generator=g)
        ids = [torch.randint(1, vocab - 2, (int(n_),), generator=g).tolist() for n_ in lens]
        out.append((ids, torch.randn(samples, 3, 224, 224, generator=g)))
    return out


def test_llava_config_draws_the_baselines_samples():
    config = load_config(LLAVA)
    plan = data_plan(config, None)
    reader = sample_reader(config, plan)
    for k, (ids, pixels) in enumerate(_baseline_batches(3)):
        samples = plan.microbatch(k)
        assert [s.tokens for s in samples] == [256 + len(t) for t in ids]
        for s, text, px in zip(samples, ids, pixels):
            got = reader.read(s)
            assert got.item.tokens == [31999] * 256 + text
            assert torch.equal(got.pixels["vision"], px.reshape(1, -1))


def test_stream_is_seekable_and_packs_with_loss_on_text_only():
    config = load_config(LLAVA, SMALL)
    plan = data_plan(config, None)
    seq = [plan.microbatch(k) for k in range(6)]
    again = data_plan(config, None)  # a fresh stream, asked out of order
    assert again.microbatch(4) == seq[4] and again.microbatch(1) == seq[1]
    reader = sample_reader(config, again)
    items = [reader.read(s).item for s in seq[4]]
    batch = pack(items, {"<image>": 4}, 1, 1, False, reader.pad_id)
    batch.validate()
    rows = 4  # (28 / 14)^2 patches, [CLS] dropped
    assert count_loss_tokens(batch) == sum(s.tokens - rows for s in seq[4])
    starts = batch.cu_seqlens[:-1].tolist()
    assert batch.image_slots["<image>"].tolist() == [s + r for s in starts for r in range(rows)]
    # an image row carries loss only where it predicts its sample's first text token (as in HF)
    assert batch.loss_mask[batch.image_slots["<image>"]].nonzero().flatten().tolist() == [i * rows + rows - 1 for i in range(len(starts))]


@pytest.mark.parametrize("override,message", [
    ("data.synthetic.text_tokens=[32,1900]", "data.synthetic.text_tokens: the longest sample"),
    ("data.synthetic.samples_per_microbatch=10", "data.synthetic.samples_per_microbatch: 10 samples"),
    ("data.synthetic.text_tokens=[9,3]", "data.synthetic.text_tokens: must be [lo, hi]"),
    ("data.synthetic.samples_per_microbatch=0", "data.synthetic.samples_per_microbatch: must be >= 1"),
])
def test_synthetic_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(LLAVA, [override])
    assert any(p.startswith(message) for p in e.value.problems), e.value.problems


def test_one_cpu_training_step_on_synthetic_data():
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    config = load_config(LLAVA, SMALL)
    run = build_run(config, 0)
    try:
        first = train_step(run.model, run.pipeline, 1, run.optimizers, run.policy)
        assert abs(first.loss - torch.log(torch.tensor(512.0)).item()) < 0.5  # near-uniform at init
        assert first.loss_tokens == sum(s.tokens - 4 for s in run.pipeline.plan.microbatch(0))
    finally:
        run.close()
