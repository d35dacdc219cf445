"""GTP (``parallel.gtp``, ``mimo.parallel.gtp``): large weights split further inside TP over
gtp data replicas, gathered just in time with the next gather in flight; ``parallel.egtp`` the
same for the routed experts inside ETP over their data replicas.

* ``mimo verify-train`` against the one-process run: the LLM (Mamba-2, attention, GDN, MLP, MoE
  with a shared expert) at gtp 2 and 4, with TP and sequence parallelism, with CP, and the ViT
  and projector at gtp 2;
* parameter bytes of the split weights fall by gtp; norms, biases, convolutions, routers, the
  embedding and the head stay whole;
* the second forward's trace shows each weight's gather starting before the previous weight's
  GEMM ends (the prefetch chain), backward gathering in reverse order, and each weight's
  gradient reduce-scatter finished only after the next weight's backward began;
* check-config names the sizes tp x gtp must divide.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

LANG, VIS = "modules.language.parallel.", "modules.vision.parallel."
STEPS = 2
LAYOUTS = {  # tests/configs/cp.yaml, world 4
    "llm gtp2 dp2, vision gtp2 dp2": [LANG + "cp=1", LANG + "gtp=2", VIS + "gtp=2", VIS + "dp=2"],
    "llm gtp4": [LANG + "cp=1", LANG + "gtp=4", LANG + "dp=1"],
    "llm tp2 gtp2 sp": [LANG + "cp=1", LANG + "tp=2", LANG + "gtp=2", LANG + "dp=1", LANG + "sequence_parallel=true"],
    "llm cp2 gtp2": [LANG + "gtp=2", LANG + "dp=1"],
    "llm gtp2 dp2, full recompute (gathers again inside backward)": [LANG + "cp=1", LANG + "gtp=2", "train.recompute=full"],
    # experts split over egtp inside ETP (their own view: etp x ep x egtp x edp)
    "llm dp4, experts egtp2": [LANG + "cp=1", LANG + "dp=4", LANG + "egtp=2"],
    "llm cp2 dp2, experts ep2 etp1 egtp2, gtp2": [LANG + "gtp=2", LANG + "dp=1", "modules.language.arch.moe.experts=8",
                                                  LANG + "ep=2", LANG + "etp=1", LANG + "egtp=2"],
}
CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


@pytest.fixture(scope="module")
def cp_config(tmp_path_factory, write_moe_configs):
    return write_moe_configs(tmp_path_factory.mktemp("gtp"), train_samples=120, seed=13, names=("cp",))["cp"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_verify_train_with_gtp(pools, cp_config, name, verify_layout):
    report = verify_layout(pools, cp_config, LAYOUTS[name], STEPS)
    assert report["ok"], report


def _stage_case(config_path: str, overrides: list[str]) -> dict:
    """The LLM stage's parameters on this rank, and a trace of two forward + backward passes."""
    from mimo.compose.config import load_config
    from mimo.compose.model import MimoModel
    from mimo.data.pack import PackItem, pack

    model = MimoModel(load_config(config_path, overrides), dist.get_rank())
    stage, chain = model.llm.module, model.llm.ctx.gtp_chain
    sizes = {n: p.numel() for n, p in stage.named_parameters()}
    split = sorted(n for n, p in stage.named_parameters() if getattr(p, "gtp", None) is not None)
    traces = []
    if chain is not None:
        batch = pack([PackItem(0, list(range(1, 40)), [True] * 39, {})], {}, 1, 1, False, 0)
        for _ in range(2):
            chain.trace = []
            stage(batch).float().square().mean().backward()
            traces.append(chain.trace)
    return {"sizes": sizes, "split": split, "traces": traces, "order": len(chain.order) if chain else 0}


def test_split_weights_fall_by_gtp_and_the_rest_stays_whole(pools, cp_config):
    base = [LANG + "cp=1"]
    plain = pools(4).run(_stage_case, cp_config, base + [LANG + "dp=4"])[0]
    for gtp in (2, 4):
        got = pools(4).run(_stage_case, cp_config, base + [LANG + f"gtp={gtp}", LANG + f"dp={4 // gtp}"])[0]
        assert got["split"], "GTP split nothing"
        for name, n in plain["sizes"].items():
            want = n // gtp if name in got["split"] else n
            assert got["sizes"][name] == want, (gtp, name, got["sizes"][name], n)
        kinds = {n.split(".")[2] if n.startswith("layers.") else n for n in got["split"]}
        assert {"mixer", "qkv", "o_proj", "up_proj", "down_proj", "shared"} <= kinds, kinds
        whole = [n for n in plain["sizes"] if n not in got["split"]]
        assert all(k in " ".join(whole) for k in ("norm", "router", "embed", "head", "A_log", "conv_", "experts"))


def test_the_prefetch_chain_overlaps_each_gemm_with_the_next_gather(pools, cp_config):
    got = pools(4).run(_stage_case, cp_config, [LANG + "cp=1", LANG + "gtp=2"])
    for r in got:
        second = r["traces"][1]  # the first forward learns the order
        n = r["order"]
        assert n >= 8
        starts = {}
        for e, i, t in second:  # the first of each event kind per weight: the forward's
            starts.setdefault((e, i), t)
        for i in range(n - 1):  # forward: weight i+1's gather starts before weight i's GEMM ends
            assert starts[("gather_start", i + 1)] < starts[("gemm_end", i)], i
        backward_gathers = [i for e, i, _ in second if e == "gather_end"][n:]
        assert backward_gathers == list(range(n - 1, -1, -1))  # backward: the reverse order
        # each weight's gradient reduce-scatter is finished only once the next weight's backward
        # has begun (it travels meanwhile): start < next backward's start < end
        at = {(e, i): t for e, i, t in second if e in ("scatter_start", "scatter_end", "backward_start")}
        for i in range(1, n):
            assert at[("scatter_start", i)] < at[("backward_start", i - 1)] < at[("scatter_end", i)], i


def test_check_config_names_what_tp_times_gtp_must_divide(capsys, monkeypatch):
    from mimo.commands.cli import main

    monkeypatch.chdir(CONFIGS)
    main(["check-config", "cp.yaml", LANG + "cp=1", LANG + "gtp=4", LANG + "dp=1", "modules.language.arch.moe.shared_ffn=6"])
    errors = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["errors"]
    assert any("modules.language.parallel.gtp: tp*gtp = 4 must divide arch.moe.shared_ffn=6" in e for e in errors), errors
    main(["check-config", "cp.yaml", LANG + "cp=1", LANG + "gtp=3"])
    errors = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["errors"]
    assert any("tp*gtp*cp*dp*pp = 1*3*1*2*1 = 6" in e for e in errors), errors
