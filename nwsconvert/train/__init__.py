"""Training and run directories: the Trainer (:mod:`.trainer`) and its parts (:mod:`.stage`, a stage's
epochs; :mod:`.loop`, one epoch and one step; :mod:`.store`, the run's files; :mod:`.evaluation`),
its config, run directories (:mod:`.rundir`), their typed manifest (:mod:`.manifest`) and lock,
checkpoints, torch.distributed glue, classifier heads, model specs, and loading a task's model
back from a run.

:mod:`.rundir` and :mod:`.manifest` also ship in the torch-free ``nwsconvert-runtime`` wheel: importing this package
must not import torch.
"""
