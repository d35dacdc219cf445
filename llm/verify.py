"""``mimo verify-llm``: our LLM at a TP / PP (/ EP) layout against the Hugging Face original.

The main process builds the Hugging Face model (the checkpoint's weights, or random weights
for ``config.json`` at a scale where every path shows: ``randomize_``), runs it on each random sample alone, and writes the
weights to a directory unless they are already there. ``tp * pp`` gloo workers then import
that directory exactly as ``init: {hf: DIR}`` does, run one packed batch of all samples
(``--ep``: ``tp * pp * ep`` workers, ep data-parallel ranks each with its pack, the experts split
over them) through the pipeline and return the logits (full vocab) and their stages' full weights (a
LLaVA directory: its language model, the text config and the language-model tensors). We
report the largest per-sample ``‖ours − hf‖ / ‖hf‖`` of the logits, the loss against the
Hugging Face per-token loss, and whether exporting our weights gives back the Hugging Face
state dict bit for bit.

The verdict is the yardstick of ``mimo.core.testing`` (docs/design.md §9): the Hugging Face model also
runs in fp64 (a ``.double()`` copy), and our fp32 logits and loss must be within
``max(tol, k * e1)`` of it, where ``e1`` is the *Hugging Face fp32 run's* error against its fp64
run: the rounding floor of the same function in fp32, measured in this process, with no second
mimo run. ``max_rel_err`` and ``loss_rel_err`` stay our errors against the fp32 original.
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import torch

from mimo.core.batch import PackedBatch
from mimo.core.errors import ConfigError, MimoError
from mimo.core.testing import Yardstick, rel_err
from mimo.core.weights import load_exactly_
from mimo.parallel.context import ParallelContext
from mimo.parallel.grid import ParallelConfig, ParallelGrid
from mimo.llm.config import LLMModuleConfig
from mimo.llm.hf import (
    IGNORED,
    TIED_HEAD,
    HFCheckpoint,
    arch_from_hf_config,
    check_hf_tensors,
    checkpoint_tensors,
    export_hf_state,
    family,
    language_model_of,
    llava_text_config,
    load_hf_checkpoint,
    read_config_json,
)
from mimo.llm.model import build_stage, count_loss_tokens
from mimo.llm.stage_runner import run_pipeline


# ---------------------------------------------------------------- packs


def pack_samples(samples: list[torch.Tensor], pad_multiple: int = 1) -> PackedBatch:
    """One pack of token samples: next-token labels within each sample (the last token of a
    sample has none), padded at the end to ``pad_multiple`` as its own masked segment."""
    lens = [int(s.numel()) for s in samples]
    total = sum(lens)
    pad = -total % pad_multiple
    tokens = torch.cat([*samples, torch.zeros(pad, dtype=torch.long)]).long()
    seg = lens + ([pad] if pad else [])
    positions = torch.cat([torch.arange(n) for n in seg]) if seg else torch.zeros(0, dtype=torch.long)
    cu = torch.tensor([0, *torch.tensor(seg).cumsum(0).tolist()], dtype=torch.int32)
    labels = torch.full((total + pad,), -100, dtype=torch.long)
    for s, start in zip(samples, cu[:-1].tolist()):
        labels[start : start + s.numel() - 1] = s[1:]
    loss_mask = labels >= 0
    batch = PackedBatch(tokens, positions, cu, labels, loss_mask, sample_ids=torch.arange(len(samples)))
    batch.validate()
    return batch


def random_samples(vocab: int, count: int, max_len: int, generator: torch.Generator) -> list[torch.Tensor]:
    """``count`` samples of random tokens, ragged lengths in 1..max_len; one has length 1."""
    lens = torch.randint(1, max_len + 1, (count,), generator=generator).tolist()
    lens[min(1, count - 1)] = 1
    return [torch.randint(0, vocab, (n,), generator=generator) for n in lens]


# ---------------------------------------------------------------- worker side


def verify_llm_worker(path: str, tp: int, pp: int, sequence_parallel: bool, batches: list[PackedBatch], ep: int = 1
                      ) -> dict | None:
    """On every rank of the pool: import ``path`` at tp x pp x dp = ep (ranks 0..tp*pp*ep-1; the
    experts over ep), run this data-parallel rank's pack of ``batches``."""
    import torch.distributed as dist

    arch = arch_from_hf_config(language_model_of(HFCheckpoint(path))[0])
    grid = ParallelGrid({"tp": tp, "cp": 1, "dp": ep, "pp": pp})
    ctx = ParallelContext(grid, dist.get_rank(), grid.registry, sequence_parallel=sequence_parallel,
                          **({"expert": (tp, ep)} if ep > 1 else {}))
    stage = build_stage(arch, ctx)
    if stage is None:  # a pool larger than the layout
        return None
    load_hf_checkpoint(stage, path)
    dp = ctx.dense.coord("dp")
    res = run_pipeline(stage, grid, batches[dp], num_loss_tokens=max(1, sum(count_loss_tokens(b) for b in batches)))
    logits = stage.gather_logits(res.logits) if stage.is_last else None
    buffers = dict(stage.named_buffers())  # persistent ones a family maps (router.expert_bias), replicated over TP
    state = {**stage.full_state(), **{k: v for k, v in stage.state_dict().items() if k in buffers}}
    if stage.tp_rank != 0:
        return None
    return {"rank": dist.get_rank(), "stage": stage.stage, "dp": dp, "logits": logits,
            "loss": None if res.loss is None else float(res.loss), "state": state if dp == 0 else {}}


# ---------------------------------------------------------------- main side


def _read_config(path: str) -> tuple[str, dict]:
    if os.path.isfile(path) and os.path.basename(path) == "config.json":
        path = os.path.dirname(path) or "."
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise MimoError(f"{path!r}: no config.json")
    return path, read_config_json(config_file)


def _hf_model(path: str, cfg: dict, from_checkpoint: bool, seed: int):
    """The Hugging Face causal LM of ``cfg`` (a causal LM's config, or the language model's
    inside LLaVA): every weight from the checkpoint (``load_exactly_``: a missing or unexpected
    tensor is an error, never a random weight; per-expert tensors stacked as the import does),
    or ``randomize_``'d. Eager attention and experts (a loop over the experts): the plainest
    Hugging Face paths, which also run in fp64."""
    import transformers

    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager",
                                                          experts_implementation="eager")
    if not from_checkpoint:
        randomize_(model, seed)
        return model.eval()
    _, rename, shapes, get = checkpoint_tensors(HFCheckpoint(path))
    ours = {rename(k): k for k in model.state_dict()}  # checkpoint name -> the model's
    full = lambda k: tuple(slice(0, n) for n in shapes[k])  # noqa: E731
    state = {k: get(k)[full(k)].float() for k in shapes if not k.endswith(IGNORED)}
    state = family(cfg.get("model_type")).export_view(state, arch_from_hf_config(cfg))  # e.g. Qwen3-Next's grouped GDN
    state = {ours.get(k, k): t for k, t in state.items()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    load_exactly_(model, state, f"checkpoint {path!r}", lambda k: rename(k) if k in model.state_dict() else k,
                  may_miss=(TIED_HEAD,) if tied else ())
    return model.eval()


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights at which every path shows in the logits: matrices ~ N(0, 1/fan_in), norm
    weights 1 + N(0, 0.2²), biases N(0, 0.2²). (A fresh Hugging Face init, std 0.02 with unit
    norms and zero biases, leaves attention almost invisible: doubling the RoPE base moves the
    logits by ~1e-4 — too close to the tolerance to catch a bug reliably.) MoE routers
    (``mlp.gate.weight``) ~ N(0, 4/fan_in): router logits of spread ~2, so the top-k is decided
    by clear margins (not near-ties that rounding could flip) and the gates differ visibly;
    some experts get no token at these sizes, as in real models."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("mlp.gate.weight"):
            p.copy_(2 * noise / p.shape[-1] ** 0.5)
        elif p.dim() >= 2:
            p.copy_(noise / p.shape[-1] ** 0.5)
        elif "norm" in name:
            p.copy_(1 + 0.2 * noise)
        else:
            p.copy_(0.2 * noise)


def check_layout(path: str, tp: int, pp: int, sequence_parallel: bool = False,
                 from_checkpoint: bool = False, ep: int = 1) -> tuple[str, dict]:
    """(directory, the causal LM's config: config.json, or a LLaVA config's language model) if
    ``path`` holds a supported model that fits tp x pp x ep (and, for a checkpoint, whose tensors
    fit it); else MimoError / ConfigError, before any process starts."""
    path, cfg = _read_config(path)
    if cfg.get("model_type") == "llava":  # its language model
        cfg = llava_text_config(cfg)
    arch = arch_from_hf_config(cfg)
    if ep > 1 and arch.moe is None:
        raise ConfigError(f"--ep {ep}: {cfg.get('model_type')} here has no MoE layers (expert parallelism splits experts)")
    par = ParallelConfig(tp=tp, pp=pp, dp=ep, ep=ep, sequence_parallel=sequence_parallel)
    module = LLMModuleConfig(kind="hybrid", arch=arch, parallel=par)
    problems = arch.validate("arch") + module.validate("")
    if problems:
        raise ConfigError(problems)
    if from_checkpoint:
        _, rename, shapes, _ = checkpoint_tensors(HFCheckpoint(path))
        check_hf_tensors(arch, shapes, path, rename, cfg.get("model_type"))
    return path, cfg


def verify_llm(path: str, pool, *, from_checkpoint: bool, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
               ep: int = 1, samples: int = 6, max_len: int = 20, seed: int = 0, tol: float = 1e-5) -> dict[str, Any]:
    """Compare our logits at tp x pp with Hugging Face's (see module doc); ``ep`` > 1: on ep
    data-parallel ranks with the experts split over them, the samples dealt round-robin, each
    rank its own pack (tokens dispatched between them). ``pool``: a worker pool
    (``mimo.training.launch.WorkerPool``) of at least tp*pp*ep ranks; ranks past those idle."""
    path, cfg = check_layout(path, tp, pp, sequence_parallel, from_checkpoint, ep)
    arch = arch_from_hf_config(cfg)
    hf = _hf_model(path, cfg, from_checkpoint, seed)

    gen = torch.Generator().manual_seed(seed + 2)
    toks = random_samples(arch.vocab, max(samples, ep), min(max_len, arch.max_seq_len), gen)
    dealt = [list(range(d, len(toks), ep)) for d in range(ep)]
    batches = [pack_samples([toks[i] for i in idx], tp if sequence_parallel else 1) for idx in dealt]
    hf64 = copy.deepcopy(hf).double()
    with torch.no_grad():
        ref, ref64 = ([m(input_ids=t[None]).logits[0] for t in toks] for m in (hf, hf64))

    def per_token_loss(logits: list[torch.Tensor]) -> float:
        total = sum(torch.nn.functional.cross_entropy(r[:-1], t[1:], reduction="sum") for r, t in zip(logits, toks) if t.numel() > 1)
        return float(total) / max(1, sum(count_loss_tokens(b) for b in batches))

    ref_loss, ref64_loss = per_token_loss(ref), per_token_loss(ref64)

    with tempfile.TemporaryDirectory(prefix="mimo-verify-llm-") as tmp:
        weights = path
        if not from_checkpoint:
            hf.save_pretrained(tmp)
            weights = tmp
        results = pool.run(verify_llm_worker, weights, tp, pp, sequence_parallel, batches, ep)

    results = [r for r in results if r is not None]
    ours: dict[int, torch.Tensor] = {}  # sample -> our logits
    for r in results:
        if r["logits"] is not None:
            cu = batches[r["dp"]].cu_seqlens.tolist()
            ours.update({i: r["logits"][cu[j] : cu[j + 1]] for j, i in enumerate(dealt[r["dp"]])})
    loss = sum(r["loss"] for r in results if r["loss"] is not None)  # (each rank's share of the global sum)
    errs = [rel_err(ours[i], ref[i]) for i in range(len(toks))]
    worst = max(range(len(errs)), key=errs.__getitem__)
    ys = Yardstick(tol)
    for i in range(len(toks)):
        ys.check(f"logits of sample {i}", ours[i], ref[i], ref64[i])

    state = {}
    for r in results:
        state.update(r["state"])
    ours_hf = export_hf_state(state, arch, model_type=cfg.get("model_type"))
    theirs = hf.state_dict()
    mismatched = sorted(set(ours_hf) ^ set(theirs)) or [k for k in theirs if not torch.equal(ours_hf[k], theirs[k])]

    max_err = max(errs)
    loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    ys.check("loss", loss, ref_loss, ref64_loss)
    ok = ys.ok and not mismatched
    return {
        "command": "verify-llm",
        "model_type": cfg.get("model_type"),
        "tp": tp, "pp": pp, "ep": ep, "sequence_parallel": sequence_parallel,
        "samples": [int(t.numel()) for t in toks],
        "pack_tokens": sum(b.num_tokens for b in batches),
        "worst_sample": worst,
        "loss": loss, "hf_loss": ref_loss, "loss_rel_err": loss_err,
        "export_exact": not mismatched,
        **({"export_mismatch": mismatched[:5]} if mismatched else {}),
        "tol": tol,
        "max_rel_err": max_err,
        "max_rel_err_vs_fp64": max(m.err for m in ys.measures),
        "hf_fp32_rel_err_vs_fp64": max(m.e1 for m in ys.measures),
        "yardstick": ys.summary(5),
        "ok": ok,
    }
