"""Command-line tools, one module each, run as ``python -m flaxformer_lite.cli.NAME``:
``translate``, ``evaluate`` (BLEU), ``attention_maps`` (plots), ``plot_metrics``.
"""
