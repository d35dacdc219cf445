"""Vision encoders (tensor-parallel ViT), projectors and their weight import.

Modules (imported by name; this package imports nothing, so ``mimo.encoders.config`` stays
light for ``check-config``):

* ``config``       -- ``EncoderModuleConfig`` and its parts (``VitArch``, ``VitInit``, ``ProjectorConfig``);
                      ``NativeEncoderModuleConfig`` (``kind: qwen3_vl``: ``Qwen3VisionArch``, ``NativeInit``)
* ``vit``          -- ``VisionTransformer``: the TP (optionally sequence-parallel) tower
* ``projector``    -- ``build_projector`` / ``PROJECTORS``: ``mlp2x_gelu``, ``linear``
* ``model``        -- ``VisionEncoder``: tower + projector from a config, freezing, ``load_pretrained``;
                      ``NativeVisionEncoder`` (the Qwen3-VL tower), ``build_encoder`` (either kind)
* ``qwen3_vl``     -- ``Qwen3VisionTower``: the native-resolution Qwen3-VL tower; ``hf_qwen3_vl`` -- its HF weights
* ``weights``      -- mapping rules, ``ImportedWeights`` (import -> export is exact), lazy safetensors reads
* ``timm_import``  -- timm ViT / CLIP / SigLIP towers; ``hf_import`` -- HF CLIP / SigLIP checkpoints
* ``tp_state``     -- by placement: TP-invariant init, loading local slices, gathering full tensors
* ``verify``       -- ``mimo verify-encoder``: parity with the original model on N ranks
"""
