"""mimo: multimodal training with a parallel layout per module.

``mimo.generate`` / ``mimo.Generator``: a checkpoint's answers from Python
(``mimo.training.generation``; imported on first use, so ``import mimo`` stays light)."""


def __getattr__(name: str):
    if name in ("generate", "Generator"):
        from mimo.training import generation

        return getattr(generation, name)
    raise AttributeError(f"module 'mimo' has no attribute {name!r}")
