"""Training and run directories: the Trainer, its config, run directories and their lock,
checkpoints, torch.distributed glue, classifier heads, model specs, and loading a task's model
back from a run.

:mod:`.rundir` also ships in the torch-free ``nwsconvert-runtime`` wheel: importing this package
must not import torch.
"""
