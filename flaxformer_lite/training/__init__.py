"""The pieces of the train loop (``train.py`` reads top to bottom and calls them).

``optim`` (Optax schedules, optimizers, frozen parameters), ``losses`` (cross entropy with label
smoothing, z-loss), ``metrics`` (TensorBoard and JSON-lines writers), ``flops`` (model FLOPs and
MFU), ``preflight`` (every config check that can run before a workdir is written).
"""
