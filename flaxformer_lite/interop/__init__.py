"""Other formats in and out: Hugging Face checkpoints (``hf``: load, convert, save, dispatching
on ``model_type`` to one module per family - ``marian``, ``bart`` (BART and mBART), ``llama``
(Llama, Qwen2), ``t5`` - which share ``naming``'s one name map read both ways) and the
parameters of a pretrained source for fine-tuning (``init_from``: a workdir or a Hugging Face
folder, restored into any layer layout).
"""
