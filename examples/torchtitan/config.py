"""torchtitan configs of the runtime's torchtitan example and tests, for ``--module examples.torchtitan.config``.

``llama3_tiny``: torchtitan's own ``llama3_debugmodel`` (dim 256, vocab 2048, flex attention) with a step
small enough for a CPU: the first 2 of its 6 layers, sequence 64, batch 2 per data-parallel rank, 32 steps,
warm-up 2, seed 0 and deterministic algorithms, float32 parameters (not bfloat16), activation checkpointing off.
The dataset is ``c4_test``'s format (``{"text": ...}`` JSON lines) read from ``--dataloader.dataset-path``
(``python -m examples.torchtitan.make_data DIR`` writes one; the hub is never asked), the tokenizer torchtitan's
test tokenizer shipped beside this file. The SPMD backend is ``partial_dtensor`` (docs/limits.md: ``spmd_types``
under FSDP). torchtitan's checkpoints (``--checkpoint.enable``) and validation are off, metrics logged every 8
steps, unless the command line says otherwise.
"""
from __future__ import annotations

import os

from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

HERE = os.path.dirname(os.path.abspath(__file__))


def llama3_tiny() -> Trainer.Config:
    config = llama3_debugmodel()
    config.model_spec.model.layers = config.model_spec.model.layers[:2]
    config.hf_assets_path = os.path.join(HERE, "tokenizer")
    config.training.seq_len = 64
    config.training.local_batch_size = 2
    config.training.steps = 32
    config.parallelism.spmd_backend = "partial_dtensor"
    config.debug.seed = 0
    config.debug.deterministic = True
    config.activation_checkpoint = None  # no recomputation: a CPU step is short enough without it
    # float32 parameters in FSDP's compute, not the debug model's bfloat16: a CPU without bfloat16 matrix units
    # multiplies bfloat16 on a slow path (aten::mm was 70 % of a step). 1.7 -> 0.46 s per step here (4 ranks, 2 cores)
    config.training.mixed_precision_param = "float32"
    config.checkpoint.enable = False
    config.validator.enable = False
    config.metrics.log_freq = 8
    return config
