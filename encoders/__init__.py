"""Vision encoders (tensor-parallel ViT), projectors and their weight import."""
