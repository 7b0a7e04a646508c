"""Other formats in and out: Hugging Face Marian checkpoints (``hf``: load, convert, save) and
the parameters of a pretrained source for fine-tuning (``init_from``: a workdir or a Hugging
Face folder, restored into any layer layout).
"""
