"""Vision encoders (tensor-parallel ViT), projectors and their weight import.

Modules (imported by name; this package imports nothing, so ``mimo.encoders.config`` stays
light for ``check-config``):

* ``config``       -- ``EncoderModuleConfig`` and its parts (``VitArch``, ``VitInit``, ``ProjectorConfig``);
                      ``NativeEncoderModuleConfig`` (``kind: qwen3_vl``: ``Qwen3VisionArch``, ``NativeInit``),
                      ``KimiEncoderModuleConfig`` (``kind: kimi_k25``: ``MoonViTArch``); ``NATIVE_TOWERS``
* ``vit``          -- ``VisionTransformer``: the TP (optionally sequence-parallel) tower
* ``projector``    -- ``build_projector`` / ``PROJECTORS``: ``mlp2x_gelu``, ``linear``
* ``model``        -- ``VisionEncoder``: tower + projector from a config, freezing, ``load_pretrained``;
                      ``NativeVisionEncoder`` (a native tower of any kind), ``build_encoder`` (any kind)
* ``qwen3_vl``     -- ``NativeTower`` (what native towers share), ``Qwen3VisionTower``: the Qwen3-VL tower;
                      ``hf_qwen3_vl`` -- its HF weights
* ``moonvit``      -- ``MoonViTTower``: Kimi-K2.5's tower and projector; ``hf_kimi_k25`` -- its HF weights
* ``weights``      -- mapping rules, ``ImportedWeights`` (import -> export is exact), lazy safetensors reads
* ``timm_import``  -- timm ViT / CLIP / SigLIP towers; ``hf_import`` -- HF CLIP / SigLIP checkpoints
* ``tp_state``     -- by placement: TP-invariant init, loading local slices, gathering full tensors
* ``verify``       -- ``mimo verify-encoder``: parity with the original model on N ranks
"""
