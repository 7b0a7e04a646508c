"""The special token ids and pieces of every vocabulary in the project, defined here only.

``PAD_ID`` pads every token array (zero loss weight, masked out of attention), ``EOS_ID``
ends every sequence, ``BOS_ID`` is the first decoder input (targets are shifted right behind
it) and ``UNK_ID`` stands for anything outside the vocabulary. Real symbols start at
``len(SPECIAL_PIECES)``.

Every user imports them from here: the tokenizer (which trains SentencePiece models with
exactly these ids and refuses models without them), the synthetic vocabulary, the data
pipeline, the searches of ``decoding`` and the defaults of ``TransformerConfig.pad_id`` and
``bos_id``.
"""

from __future__ import annotations

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3

# Piece string of each special id, in id order.
SPECIAL_PIECES = ("<pad>", "</s>", "<s>", "<unk>")

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "SPECIAL_PIECES", "UNK_ID"]
