"""What a process that forks torchtitan ranks imports once, before it forks them: ``TM_FORK_PRELOAD=
worker.integrations.torchtitan_image`` for ``tmd local``'s fork server (worker/fork_server.py), and the tests'
launcher of torchtitan's plain ``torchrun``-style runs (tests/support/forked.py).

On a host whose torch has no accelerator compiled in: the CPU shims (worker.integrations.torchtitan_cpu, which must
come before torchtitan), torchtitan's attention module (it imports torch's Dynamo and Inductor: 3.6 s of its ~7 s
of imports here), FSDP2 and tensor parallel. A rank forked from that image skips those imports: a local job of 4
ranks and 2 standbys paid them 6 times over on 2 cores before its first step. (A driver's own modules can be named
after it: ``TM_FORK_PRELOAD=worker.integrations.torchtitan_image,examples.train_gpt``.)

Not imported: ``datasets`` (torchtitan's data loading), because it imports pyarrow, whose jemalloc starts a
background thread, and no thread may exist when a rank is forked. Nothing at all where torch was built with an
accelerator: finding out whether one is present initialises its driver, which a forked child cannot use.
"""
import torch

if not (torch.version.cuda or torch.version.hip or getattr(torch.version, "xpu", None)):
    from worker.integrations import torchtitan_cpu

    torchtitan_cpu.apply()

    import torch.distributed.fsdp  # noqa: E402,F401
    import torch.distributed.tensor.parallel  # noqa: E402,F401
    import torchtitan.models.common.attention  # noqa: E402,F401
