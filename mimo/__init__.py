"""mimo: multimodal training with a parallel layout per module."""
