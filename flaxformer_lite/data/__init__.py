"""Text in, fixed-shape batches out.

``reading`` (parallel text, TSV, JSON lines, hub datasets), ``tokenizer`` (SentencePiece),
``marian_tokenizer`` (a pretrained Marian model's) and ``hf_tokenizers`` (T5's, Llama's, BART's,
mBART's, any ``tokenizer.json``; ``hf_vocabulary``: an encoder-decoder's as the
pipeline's two vocabularies), ``encoding`` (text to ids), ``batching``
(length buckets, fixed shapes), ``packing`` (several examples per row), ``stream`` (the endless,
resumable training stream), ``workdir`` (vocabularies and the token cache a run keeps),
``tasks/`` (one module per kind of run, and the registry that picks one).

The reading names (``DataError``, ``load_pairs``, ...) are re-exported here: they were
``flaxformer_lite.data`` before the package had subfolders.
"""

from flaxformer_lite.data.reading import (
    DATA_FORMATS,
    DataError,
    DataStats,
    describe_pairs_source,
    iter_pairs,
    load_labeled,
    load_pairs,
    load_text,
    normalize,
    read_parallel_files,
)

__all__ = [
    "DATA_FORMATS",
    "DataError",
    "DataStats",
    "describe_pairs_source",
    "iter_pairs",
    "load_labeled",
    "load_pairs",
    "load_text",
    "normalize",
    "read_parallel_files",
]
