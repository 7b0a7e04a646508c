"""Using a trained or pretrained model: ``translator`` (the batched ``Translator`` over a workdir
or a Hugging Face folder), ``export`` (a serving artifact of one jitted call) and
``serving_runtime`` (what loads that artifact, with no flaxformer_lite installed).

The translator names are re-exported here: they were ``flaxformer_lite.inference`` before the
package had subfolders.
"""

from flaxformer_lite.inference.translator import (
    BUCKET,
    SymbolVocabulary,
    Translator,
    Vocabulary,
    load_vocabularies,
    restore_params,
)

__all__ = [
    "BUCKET",
    "SymbolVocabulary",
    "Translator",
    "Vocabulary",
    "load_vocabularies",
    "restore_params",
]
