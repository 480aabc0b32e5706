"""What the test launcher (tests.support.forked) of torchtitan's plain ``torchrun``-style runs imports once, before it
forks the ranks (tests/e2e/test_torchtitan.py): the CPU shims (worker.integrations.torchtitan_cpu, which must come
before torchtitan), torchtitan's attention module (it imports torch's Dynamo and Inductor: 3.6 s of its ~7 s of
imports here), FSDP2 and tensor parallel, and the driver's helpers. Not ``datasets`` (torchtitan's data loading):
it imports pyarrow, whose jemalloc starts a background thread, and no thread may exist when a rank is forked."""
from worker.integrations import torchtitan_cpu

torchtitan_cpu.apply()

import torch.distributed.fsdp  # noqa: E402,F401
import torch.distributed.tensor.parallel  # noqa: E402,F401
import torchtitan.models.common.attention  # noqa: E402,F401

import examples.state_hash  # noqa: E402,F401
import examples.train_gpt  # noqa: E402,F401
