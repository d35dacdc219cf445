"""``mimo import-hf DIR [--yaml FILE] [--config CONFIG --out DIR] [key=value ...]``: a Hugging Face
multimodal checkpoint directory, by its architecture.

The architecture comes from ``DIR/config.json`` (``architectures``, else ``model_type``):

    LlavaForConditionalGeneration        mimo.commands.hf_llava  (what ``import-hf-llava`` runs)
    Qwen3VLForConditionalGeneration      mimo.commands.hf_qwen3_vl (a ``kind: qwen3_vl`` encoder
    Qwen3VLMoeForConditionalGeneration     and the LLM)

Without ``--config``: every tensor checked against the config.json (safetensors headers only)
and the ``modules:`` section of a mimo config that loads the checkpoint (``init.hf``), printed or
written to ``--yaml``. With ``--config CONFIG --out DIR``: a mimo checkpoint (step 0, weights
only) at that config's layout. Any other architecture is an error naming the supported ones.
"""

from __future__ import annotations

from mimo.core.errors import MimoError

__all__ = ["SUPPORTED", "detect_architecture", "describe", "import_to_checkpoint"]

# architecture -> config.json model_type
SUPPORTED = {"LlavaForConditionalGeneration": "llava", "Qwen3VLForConditionalGeneration": "qwen3_vl",
             "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe"}


def detect_architecture(path: str) -> str:
    """The supported architecture of the checkpoint directory ``path`` (MimoError otherwise,
    naming what it is and the supported ones)."""
    from mimo.encoders.hf_import import read_config_json

    config = read_config_json(path)
    listed = config.get("architectures") or []
    for name in listed:
        if name in SUPPORTED:
            return name
    by_type = {t: a for a, t in SUPPORTED.items()}
    if config.get("model_type") in by_type and not listed:
        return by_type[config["model_type"]]
    what = ", ".join(map(repr, listed)) if listed else "no architectures"
    raise MimoError(f"{path!r}: config.json says {what} (model_type {config.get('model_type')!r}); mimo import-hf "
                    f"supports {', '.join(SUPPORTED)}")


def describe(path: str, out: str | None = None) -> dict:
    """Check the checkpoint and give (print, or write to ``out``) the mimo ``modules:`` section that loads it."""
    architecture = detect_architecture(path)
    if architecture == "LlavaForConditionalGeneration":
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
    if architecture == "LlavaForConditionalGeneration":
        from mimo.commands.hf_llava import import_to_checkpoint as llava

        return {**llava(path, config_path, overrides, out, timeout_s), "command": "import-hf", "architecture": architecture}
    from mimo.commands.hf_qwen3_vl import import_to_checkpoint as qwen3_vl

    return qwen3_vl(path, config_path, overrides, out, timeout_s)
