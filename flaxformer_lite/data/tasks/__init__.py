"""What each kind of run feeds the train loop: the :class:`Task` and :func:`build_task`.

``build_task`` turns a training config into a ``Task``: the endless training stream, fixed
evaluation batches, the vocabulary sizes the model needs, and what to decode for exact-match or
BLEU. Four kinds, chosen by ``config.task``, each assembled by its own module::

  "synthetic"       generated seq2seq problems, the embedded default (synthetic.py)
  "translation"     parallel text from the hub or local files: Multi30k, WMT14
                    (translation.py)
  "lm"              a plain-text file for a decoder-only language model: Tiny Shakespeare
                    (lm.py)
  "classification"  labelled sentences in TSV for the encoder classifier: SST-2
                    (classification.py)

Bad data (an empty split, a synthetic task with every input held out, an LM ``max_len`` too
short for its eval sample) raises :class:`~flaxformer_lite.data.reading.DataError` naming the config
field or file, before any compilation.
"""

from __future__ import annotations

from typing import Any

from flaxformer_lite.core import paths
from flaxformer_lite.data.tasks.base import TASKS, Task


def build_task(
    config: Any, workdir: str, *, process_index: int = 0, process_count: int = 1
) -> Task:
    """The data side of a run, as described by ``config.task``. ``workdir`` (where vocabularies
    are saved) and local data paths in ``config`` may be ``gs://`` URIs."""
    if config.task not in TASKS:
        raise ValueError(f"config.task must be one of {TASKS}; got {config.task!r}")
    # Imported here: a run loads only its own task module (and its dependencies).
    if config.task == "synthetic":
        from flaxformer_lite.data.tasks import synthetic as task_module
    elif config.task == "translation":
        from flaxformer_lite.data.tasks import translation as task_module
    elif config.task == "lm":
        from flaxformer_lite.data.tasks import lm as task_module
    else:
        from flaxformer_lite.data.tasks import classification as task_module
    paths.makedirs(workdir)
    return task_module.build(config, workdir, process_index, process_count)
