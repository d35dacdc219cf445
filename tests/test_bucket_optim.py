"""The distributed optimizer and optimizer-state offload (``mimo.training.bucket_optim``; the
optimizer in each precision at world 1: tests/test_optim.py).

* ``mimo verify-train`` with ``train.distributed_optimizer`` against the one-process run (whole
  buckets, the degenerate case of the same optimizer; tests/test_optim.py: torch's AdamW): dp 2 (with tied embeddings over two pipeline stages), dp 3 and dp 4 (buckets
  that do not split evenly: padded shards), experts sharded over EDP; with offload;
* optimizer bytes per rank fall by dp (up to the padding);
* bf16-pure sharded updates the weights as whole (to a bf16 step); its offload is refused;
* resume with the distributed optimizer reproduces the uninterrupted run bit for bit, and a
  checkpoint written with it also loads without it (tests/test_reshard.py: and trains on the same).
(A shard not gathered back, or every copy counted in the norm, fails the verification above.)
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

LANG = "modules.language."
STEPS = 3
LAYOUTS = {  # tests/configs/cp.yaml (Mamba-2, attention, GDN, MLP, MoE), world 4 unless said
    "dp2, pp2, tied embeddings": ["train.distributed_optimizer=true", LANG + "parallel.cp=1", LANG + "parallel.pp=2",
                                  LANG + "arch.tie_embeddings=true", "train.weight_decay=0.1"],
    "dp3 (uneven shards), world 3": ["train.distributed_optimizer=true", "world_size=3", "modules.vision.parallel.dp=3",
                                     "modules.vision.parallel.ranks=0:3", LANG + "parallel.cp=1", LANG + "parallel.dp=3",
                                     LANG + "parallel.ranks=0:3", "train.weight_decay=0.1"],
    "dp4": ["train.distributed_optimizer=true", LANG + "parallel.cp=1", LANG + "parallel.dp=4"],
    "cp2 dp2, experts ep2 etp1 over edp 2": ["train.distributed_optimizer=true", LANG + "arch.moe.experts=8",
                                             LANG + "parallel.ep=2", LANG + "parallel.etp=1"],
    "offload, not sharded, cp2 dp2": ["train.optimizer_offload=true"],
    "offload and sharded, dp4": ["train.optimizer_offload=true", "train.distributed_optimizer=true",
                                 LANG + "parallel.cp=1", LANG + "parallel.dp=4"],
}


@pytest.fixture(scope="module")
def cp_config(tmp_path_factory, write_moe_configs):
    return write_moe_configs(tmp_path_factory.mktemp("bucket_optim"), train_samples=160, seed=11, names=("cp",))["cp"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_verify_train_with_a_bucketed_optimizer(pools, cp_config, name, verify_layout):
    overrides = LAYOUTS[name]
    report = verify_layout(pools, cp_config, overrides, STEPS, world=3 if "world_size=3" in overrides else 4)
    assert report["ok"], report


def _bytes_case(config_path, overrides):
    from mimo.compose.config import load_config
    from mimo.training.run import build_run

    run = build_run(load_config(config_path, overrides), dist.get_rank())
    opt_bytes = sum(opt.state_bytes() for opt in run.optimizers.values())
    params = sum(p.numel() for opt in run.optimizers.values() for s in opt.states for p in s.bucket.params)
    run.pipeline.close()
    return opt_bytes, params


def test_optimizer_bytes_fall_by_dp(pools, cp_config):
    """8 bytes (two fp32 moments; fp32 weights are their own masters) per parameter at dp 1 ...
    and a quarter of it at dp 4, up to the padding of each bucket to a multiple of 4 elements."""
    base = ["train.distributed_optimizer=true", LANG + "parallel.cp=1"]
    one = pools(1).run(_bytes_case, cp_config, base + ["world_size=1", "modules.vision.parallel.dp=1",
                                                       "modules.vision.parallel.ranks=0:1", LANG + "parallel.dp=1",
                                                       LANG + "parallel.ranks=0:1"])[0]
    four = pools(4).run(_bytes_case, cp_config, base + [LANG + "parallel.dp=4"])
    opt1, params1 = one
    assert opt1 == 8 * params1
    for opt4, params4 in four:
        assert params4 == params1
        buckets = 64  # a generous bound on the count of buckets: each pads by less than 4 elements
        assert opt1 / 4 <= opt4 <= opt1 / 4 + 8 * 4 * buckets, (opt1, opt4)


def test_resume_with_the_distributed_optimizer_is_bit_exact(pools, cp_config, tmp_path, resume_case):
    from safetensors.torch import load_file

    overrides = ["train.distributed_optimizer=true", LANG + "parallel.cp=1", LANG + "parallel.dp=4", "train.weight_decay=0.1"]
    plain = [o for o in overrides if "distributed_optimizer" not in o]
    results = pools(4).run(resume_case, cp_config, overrides, str(tmp_path), plain)
    for r in results:
        assert r["resumed"] == r["straight"], r
        assert r["refused"] == "", r["refused"]  # without it, the same checkpoint loads (its shards joined)
    a, b = tmp_path / "straight" / "step-00000004", tmp_path / "cut" / "step-00000004"
    files = sorted(f for f in os.listdir(a) if f.endswith((".model.safetensors", ".dopt.safetensors")))
    assert sum(f.endswith(".dopt.safetensors") for f in files) == 8  # every rank's shard, of both modules
    assert files == sorted(f for f in os.listdir(b) if f.endswith((".model.safetensors", ".dopt.safetensors")))
    for f in files:
        want, got = load_file(a / f), load_file(b / f)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), f


def _pure_case(config_path: str, overrides: list[str]) -> dict:
    """bf16-pure trained 2 steps with the whole optimizer and with it sharded: this rank's
    losses and each LLM weight's change (full tensors, fp32)."""
    from mimo.compose.config import load_config
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    out = {}
    for sharded in (False, True):
        run = build_run(load_config(config_path, overrides + [f"train.distributed_optimizer={str(sharded).lower()}"]),
                        dist.get_rank())
        before = {n: t.float() for n, t in run.model.full_params()["language"].items()}
        losses = [train_step(run.model, run.pipeline, s, run.optimizers, run.policy).loss for s in (1, 2)]
        after = run.model.full_params()["language"]
        out[sharded] = {"losses": losses, "delta": {n: after[n].float() - before[n] for n in before}}
        run.close()
    return out


def test_bf16_pure_sharded_is_the_whole_optimizer(pools, cp_config):
    """``train.precision: bf16-pure`` (bf16 weights and moments, no masters) with the distributed
    optimizer at dp 4: the same losses and the same weight updates as the whole optimizer (the
    gradients' fp32 sums may round differently once reduce-scattered, so updates agree to a
    bf16 step, not bit for bit; an lr large enough that nearly every weight moves)."""
    overrides = ["train.precision=bf16-pure", "train.lr=1e-2", LANG + "parallel.cp=1", LANG + "parallel.dp=4"]
    for r in pools(4).run(_pure_case, cp_config, overrides):
        whole, sharded = r[False], r[True]
        assert sharded["losses"] == pytest.approx(whole["losses"], rel=1e-3)
        still = sorted(n for n, d in whole["delta"].items() if not d.abs().sum())
        assert still == sorted(n for n, d in sharded["delta"].items() if not d.abs().sum())
        assert len(still) <= len(whole["delta"]) // 10, still  # (else the case proves little)
        for name, want in whole["delta"].items():
            assert (sharded["delta"][name] - want).norm() <= 0.02 * want.norm(), name


def _offload_case(config_path: str, overrides: list[str]) -> dict:
    from mimo.compose.config import load_config
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    out = {}
    for offload in (False, True):
        run = build_run(load_config(config_path, overrides + [f"train.optimizer_offload={str(offload).lower()}"]), 0,
                        device=torch.device("cuda", torch.cuda.current_device()))
        losses = [train_step(run.model, run.pipeline, s, run.optimizers, run.policy).loss for s in (1, 2, 3)]
        where = {(s.exp_avg.device.type, s.exp_avg.is_pinned()) for opt in run.optimizers.values() for s in opt.states}
        out[offload] = {"losses": losses, "where": sorted(where),
                        "params": {n: p.detach().float().cpu() for n, p in run.model.llm.module.named_parameters()}}
        run.close()
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload to pinned host memory needs a GPU (this machine has none)")
def test_offloaded_optimizer_state_on_the_gpu(cp_config):
    """One rank on the GPU: the masters and moments in pinned host memory, the update there; the
    same losses and weights as the state on the device (fp32, AdamW's CPU and GPU kernels)."""
    from mimo.core.testing import rel_err
    from mimo.training.launch import WorkerPool

    one = ["world_size=1", "modules.vision.parallel.dp=1", "modules.vision.parallel.ranks=0:1", LANG + "parallel.cp=1",
           LANG + "parallel.dp=1", LANG + "parallel.ranks=0:1", "train.distributed_optimizer=true"]
    with WorkerPool(1, device="cuda") as pool:
        (got,) = pool.run(_offload_case, cp_config, one)
    assert got[True]["where"] == [("cpu", True)] and got[False]["where"] == [("cuda", False)]
    for a, b in zip(got[True]["losses"], got[False]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert max(rel_err(got[True]["params"][n], p) for n, p in got[False]["params"].items()) <= 1e-5


def test_bf16_pure_takes_the_distributed_optimizer_not_offload_yet(cp_config):
    """The config check lets bf16-pure shard its optimizer (the case above) and refuses its
    offload by name."""
    from mimo.compose.config import load_config
    from mimo.core.errors import ConfigError

    load_config(cp_config, ["train.precision=bf16-pure", "train.distributed_optimizer=true"])
    with pytest.raises(ConfigError, match="optimizer_offload: bf16-pure"):
        load_config(cp_config, ["train.precision=bf16-pure", "train.optimizer_offload=true"])
