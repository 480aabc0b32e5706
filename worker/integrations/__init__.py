"""Integrations of other projects' trainers with the runtime. Each is imported only by its users: the core package
(``worker``, ``tmd``) imports none of them, nor the projects they integrate.

``torchtitan`` (with ``torchtitan_cpu``, its CPU shims): torchtitan's own ``Trainer`` under ``tmd local`` and
``tmd slurm``.
"""
