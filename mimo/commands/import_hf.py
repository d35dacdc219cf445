"""``mimo import-hf DIR [--yaml FILE] [--config CONFIG --out DIR] [key=value ...]``: a Hugging Face
multimodal checkpoint directory, or a text-only causal LM, by its architecture.

The architecture comes from ``DIR/config.json`` (``architectures``, else ``model_type``):

    LlavaForConditionalGeneration        mimo.commands.hf_llava  (what ``import-hf-llava`` runs)
    Qwen3VLForConditionalGeneration      mimo.commands.hf_qwen3_vl (a ``kind: qwen3_vl`` encoder
    Qwen3VLMoeForConditionalGeneration     and the LLM; Qwen3.5's tower has no deepstack, its LLM
    Qwen3_5ForConditionalGeneration        is Gated DeltaNet / gated attention with M-RoPE)
    Qwen3_5MoeForConditionalGeneration
    Kimi_K25ForConditionalGeneration       mimo.commands.hf_qwen3_vl (a ``kind: kimi_k25`` encoder: MoonViT
                                           and its projector; the LLM: DeepSeek-V3's, 1-D RoPE)
    LlamaForCausalLM, Qwen2ForCausalLM,  a text-only LLM: every family of ``mimo.llm.hf`` (Llama,
    Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen2 / Qwen3 (MoE), Mixtral, OLMoE, Nemotron-H, Qwen3-Next,
    NemotronHForCausalLM, ...               Qwen3.5 (MoE) text; here: ``describe_causal_lm``,
                                           ``causal_lm_to_checkpoint``)

Without ``--config``: every tensor checked against the config.json (safetensors headers only)
and the ``modules:`` section of a mimo config that loads the checkpoint (``init.hf``), printed or
written to ``--yaml``. With ``--config CONFIG --out DIR``: a mimo checkpoint (step 0, weights
only) at that config's layout. Any other architecture is an error naming the supported ones.
"""

from __future__ import annotations

import os

from mimo.core.errors import MimoError

__all__ = ["MULTIMODAL", "causal_lms", "supported", "detect_architecture", "describe", "import_to_checkpoint", "describe_causal_lm",
           "causal_lm_to_checkpoint", "run_ranks"]

# architecture -> config.json model_type: the multimodal models
MULTIMODAL = {"LlavaForConditionalGeneration": "llava", "Qwen3VLForConditionalGeneration": "qwen3_vl",
              "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe", "Qwen3_5ForConditionalGeneration": "qwen3_5",
              "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe", "Kimi_K25ForConditionalGeneration": "kimi_k25"}


def causal_lms() -> dict[str, str]:
    """The text-only causal LMs (architecture -> model_type): every family ``mimo.llm.hf`` reads
    and ``export-hf --llm-only`` writes; one ``kind: hybrid`` module."""
    from mimo.llm.hf import SUPPORTED as FAMILIES

    return {a: t for t, a in FAMILIES.items() if a.endswith("ForCausalLM")}


def supported() -> dict[str, str]:
    return {**MULTIMODAL, **causal_lms()}


def detect_architecture(path: str) -> str:
    """The supported architecture of the checkpoint directory ``path`` (MimoError otherwise,
    naming what it is and the supported ones)."""
    from mimo.encoders.hf_import import read_config_json

    config = read_config_json(path)
    listed = config.get("architectures") or []
    known = supported()
    for name in listed:
        if name in known:
            return name
    by_type = {t: a for a, t in known.items()}
    if config.get("model_type") in by_type and not listed:
        return by_type[config["model_type"]]
    what = ", ".join(map(repr, listed)) if listed else "no architectures"
    raise MimoError(f"{path!r}: config.json says {what} (model_type {config.get('model_type')!r}); mimo import-hf "
                    f"supports {', '.join(known)}")


def describe(path: str, out: str | None = None) -> dict:
    """Check the checkpoint and give (print, or write to ``out``) the mimo ``modules:`` section that loads it."""
    architecture = detect_architecture(path)
    if architecture in causal_lms():
        result = describe_causal_lm(path, out)
        if out is None:
            print(f"# import-hf {path}: {result['tensors']} tensors fit the config ({architecture})")
    elif architecture == "LlavaForConditionalGeneration":
        from mimo.commands.hf_llava import describe_llava

        result = describe_llava(path, out)
        if out is None:  # the YAML above; then what it says
            print(f"# import-hf {path}: {result['tensors']} tensors fit the config ({result['naming']} key names)")
    else:
        from mimo.commands.hf_qwen3_vl import describe_qwen3_vl

        result = describe_qwen3_vl(path, out)
        if out is None:
            print(f"# import-hf {path}: {result['tensors']} tensors fit the config ({architecture})")
    return {**result, "command": "import-hf", "architecture": architecture}


def import_to_checkpoint(path: str, config_path: str, overrides: list[str], out: str, timeout_s: float = 900.0) -> dict:
    """The checkpoint as a mimo checkpoint at the config's layout (step 0, weights only)."""
    architecture = detect_architecture(path)
    if architecture in causal_lms():
        return causal_lm_to_checkpoint(path, config_path, overrides, out, timeout_s)
    if architecture == "LlavaForConditionalGeneration":
        from mimo.commands.hf_llava import import_to_checkpoint as llava

        return {**llava(path, config_path, overrides, out, timeout_s), "command": "import-hf", "architecture": architecture}
    from mimo.commands.hf_qwen3_vl import import_to_checkpoint as qwen3_vl

    return qwen3_vl(path, config_path, overrides, out, timeout_s)


# ---------------------------------------------------------------- a text-only causal LM


def _causal_lm_tensors(arch, path: str, source: str) -> int:
    """MimoError unless every tensor of the directory fits ``arch`` (names and shapes, the
    config's soft fields alike); the tensor count."""
    from mimo.llm.hf import HFCheckpoint, check_hf_checkpoint

    checked = check_hf_checkpoint(arch, path, source=source)
    if checked.differences:
        raise MimoError(f"{source}: the tensors fit, but " + "; ".join(checked.differences))
    return len(HFCheckpoint(path).keys())


def describe_causal_lm(path: str, out: str | None = None, language: str = "language") -> dict:
    """A text-only causal LM (``causal_lms``): every tensor checked against its config.json
    (headers only), and the ``modules:`` section of one ``kind: hybrid`` module that loads it
    (``init.hf``), printed or written to ``out``."""
    import yaml

    from mimo.commands.hf_llava import _plain, emit_modules
    from mimo.llm.hf import HFCheckpoint, arch_from_hf_config, read_config_json, with_checkpoint_mtp

    config = read_config_json(os.path.join(path, "config.json"))
    arch = with_checkpoint_mtp(arch_from_hf_config(config), HFCheckpoint(path).keys())  # MTP as its tensors say
    tensors = _causal_lm_tensors(arch, path, f"checkpoint {path!r}")
    architecture = detect_architecture(path)
    modules = {language: {"kind": "hybrid", "arch": _plain(arch), "init": {"hf": path}}}
    text = (f"# the LLM of the checkpoint {path} ({architecture}); add parallel:, the data and train sections (and\n"
            f"# encoders, if any). As a mimo checkpoint: mimo import-hf {path} --config CONFIG --out DIR;\n"
            f"# mimo export-hf CKPT --out DIR --llm-only writes it back.\n"
            + yaml.safe_dump({"modules": modules}, sort_keys=False))
    emit_modules(text, out)
    return {"ok": True, "command": "import-hf", "checkpoint": path, "architecture": architecture, "tensors": tensors,
            "modules": modules, "out": out}


def run_ranks(world_size: int, args: tuple, pool=None, timeout_s: float = 900.0):
    """Rank 0's result of ``fn(*rest)`` (``args``: fn, rest...) run on every rank of ``pool`` (a
    ``WorkerPool`` of ``world_size`` ranks), or of one started here for the call."""
    from mimo.training.launch import WorkerPool

    if pool is None:
        with WorkerPool(world_size, timeout_s=timeout_s) as started:
            return started.run(*args)[0]
    if pool.world_size != world_size:
        raise MimoError(f"a pool of {pool.world_size} ranks cannot write the config's layout (world_size={world_size})")
    return pool.run(*args)[0]


def _causal_lm_rank(path: str, config_path: str, overrides: list[str], out: str) -> str:
    """One rank of ``causal_lm_to_checkpoint``: its part of the model, the LLM loaded (``init.hf``), saved."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.compose.model import MimoModel
    from mimo.training.checkpoint import save_checkpoint

    config = load_config(config_path, overrides).without_adapters()  # (the base)
    config.llm.init.hf = path  # what the run loads: recorded with the checkpoint's config
    model = MimoModel(config, dist.get_rank())
    return save_checkpoint(model, {}, 0, out, extra_meta={"imported_from": path})


def causal_lm_to_checkpoint(path: str, config_path: str, overrides: list[str], out: str, timeout_s: float = 900.0,
                            pool=None) -> dict:
    """The causal LM as the config's LLM in a mimo checkpoint (step 0, weights only; other
    modules at their init) at the config's layout, written by the config's ranks on local
    processes (``pool``: a ``WorkerPool`` of its world size; default one started here). The
    LLM's arch and every tensor are checked before any process starts."""
    from mimo.compose.config import load_config
    from mimo.training.checkpoint import layout_of

    config = load_config(config_path, overrides)
    try:
        _causal_lm_tensors(config.llm.arch, path, f"checkpoint {path!r}")
    except MimoError as e:
        raise MimoError(f"modules.{config.llm_name}: {e}") from None
    written = run_ranks(config.world_size, (_causal_lm_rank, os.path.abspath(path), config_path, list(overrides), out),
                        pool, timeout_s)
    print(f"wrote {written} (layout {layout_of(config)}); start a run from it with train.init_from: {out}, or write it "
          f"back with mimo export-hf {written} --out DIR --llm-only")
    return {"ok": True, "command": "import-hf", "checkpoint": path, "architecture": detect_architecture(path),
            "out": written, "layout": layout_of(config)}
