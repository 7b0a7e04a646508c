"""Pure JAX functions: no Flax state, safe under ``jit``, ``vmap`` and ``grad``.

``attention`` (dot-product attention and its kernel switch), ``blockwise`` (the memory-efficient
kernel), ``shapes`` (the operand checks every kernel shares), ``masks``, ``positions``
(sinusoidal, rotary, relative buckets), ``activations``, ``quantize`` (int8 weights and matmul),
``kv_cache`` (the decoding key/value cache: full or ring buffer), ``beam_cache`` (attention over
a beam cache that never moves), ``beam_top_k`` (beam search's candidates from raw logits),
``argmax`` (the row argmax greedy decoding and the accuracy metric take).
"""
