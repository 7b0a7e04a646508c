"""The language-model task: one text corpus to windows of a token stream, perplexity to score.

The non-empty lines of ``config.data_file`` (or of a hub dataset's text column) are split in
order: the first ``1 - eval_fraction`` train, the rest are held out. Each line becomes its
tokens and EOS (a line break), all lines one stream, cut into ``config.max_len`` windows.
"""

from __future__ import annotations

import os
from typing import Any

from etils import epath

from flaxformer_lite.data.batching import Batch, lm_batches
from flaxformer_lite.data.encoding import lm_token_stream
from flaxformer_lite.data.reading import DataError, DataStats, load_text, normalize
from flaxformer_lite.data.stream import BatchStream
from flaxformer_lite.data.tasks.base import Task, vocabulary_ids
from flaxformer_lite.data.workdir import vocabulary

# Tokens of held-out text that open the sample printed at each evaluation (train.py).
PROMPT_LEN = 32


def check_prompt_fits(config: Any) -> None:
    """Raises DataError when ``config.decode_eval`` samples a continuation at each evaluation
    and the model's length (``config.model.max_len``, by default ``config.max_len``) leaves no
    room for it: the prompt (the first ``PROMPT_LEN`` tokens of a ``config.max_len`` window),
    BOS and at least one new token."""
    if not config.get("decode_eval"):
        return
    prompt_len = min(PROMPT_LEN, config.max_len)
    model_max_len = config.get("model", {}).get("max_len")
    if model_max_len is None:  # the model is as long as the windows: the prompt is PROMPT_LEN
        field, value, least = "config.max_len", config.max_len, PROMPT_LEN + 2
    else:
        field, value, least = "config.model.max_len", model_max_len, prompt_len + 2
    if value < least:
        raise DataError(
            f"{field}={value} leaves no room for the sample printed at each evaluation (a "
            f"{min(PROMPT_LEN, value if model_max_len is None else prompt_len)}-token prompt, "
            f"BOS and at least one new token): use {field} >= {least}, or "
            "config.decode_eval=False"
        )


def _read_lines(config: Any, stats: DataStats) -> tuple[list[str], str]:
    """Normalized non-empty lines of the corpus, and where they came from (for messages)."""
    if config.get("data_file"):
        return load_text(config.data_file, stats), f"config.data_file={config.data_file!r}"
    import datasets  # the hub copy; slow to import, so only here

    rows = datasets.load_dataset(config.dataset, split=config.train_split)["text"]
    lines = [normalize(t) for r in rows for t in r.splitlines()]
    stats.num_read = len(lines)
    lines = [t for t in lines if t]
    stats.num_empty_dropped = stats.num_read - len(lines)
    return lines, f"config.dataset={config.dataset!r} split {config.train_split!r}"


def build(config: Any, workdir: str, process_index: int, process_count: int) -> Task:
    """The LM :class:`Task`. Checked before any file is written: the eval sample fits the
    model (:func:`check_prompt_fits`) and both splits have a line; after tokenizing, both
    have at least one ``max_len`` window (else the vocabulary this call trained is removed
    again, in a one-process run)."""
    check_prompt_fits(config)
    stats = DataStats()
    lines, source = _read_lines(config, stats)
    split = int(len(lines) * (1 - config.eval_fraction))
    train_lines, eval_lines = lines[:split], lines[split:]
    counts = f"{len(lines)} non-empty lines ({stats.summary()})"
    if not train_lines:
        raise DataError(
            f"empty training split: {source} has {counts}, none left for training with "
            f"config.eval_fraction={config.eval_fraction}; give it more lines or a lower "
            "eval_fraction"
        )
    if not eval_lines:
        raise DataError(
            f"empty eval split: config.eval_fraction={config.eval_fraction} of {source}'s "
            f"{counts} is no line; raise eval_fraction or give it more lines"
        )
    path = os.path.join(workdir, "spm_lm.model")
    trained_now = not epath.Path(path).is_file()
    tokenizer = vocabulary(path, lambda: iter(train_lines), config)
    train_tokens = lm_token_stream(train_lines, tokenizer)
    eval_tokens = lm_token_stream(eval_lines, tokenizer)
    seq_len, rows = config.max_len, config.batch_size
    for name, tokens in (("training", train_tokens), ("eval", eval_tokens)):
        if len(tokens) < seq_len:
            if trained_now and process_count == 1:
                epath.Path(path).unlink()  # leave the workdir as it was
            raise DataError(
                f"the {name} split of {source} has {len(tokens)} tokens, fewer than one "
                f"window of config.max_len={seq_len}; lower max_len, or give the split more "
                f"text (config.eval_fraction={config.eval_fraction})"
            )

    def make_batches(epoch: int) -> list[Batch]:
        return lm_batches(
            train_tokens,
            seq_len=seq_len,
            batch_size=rows,
            pad_id=tokenizer.pad_id,
            seed=config.seed,
            epoch=epoch,
        )

    stream = BatchStream(make_batches, process_index=process_index, process_count=process_count)
    evals = lm_batches(
        eval_tokens, seq_len=seq_len, batch_size=rows, pad_id=tokenizer.pad_id, seed=0, epoch=0
    )
    return Task(
        kind="lm",
        train=stream,
        eval_batches=evals[: config.eval_batches] if config.eval_batches else evals,
        vocab_size=tokenizer.vocab_size,
        target_vocab_size=None,
        max_len=seq_len,
        detokenize=tokenizer.decode_lines,  # EOS marks line ends in the LM stream
        special_ids=vocabulary_ids(tokenizer),
        metric="perplexity",
        log_lines=[
            f"{stats.summary()}; {len(train_tokens)} training and {len(eval_tokens)} held-out "
            f"tokens, vocabulary {tokenizer.vocab_size}"
        ],
    )
