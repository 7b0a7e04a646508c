"""What several test modules share; no test module imports another test module
(tests/test_layout.py checks).

  tiny_configs           train.py configs: ``load_config`` and the tiny runs built on it
  runs                   train.py runs in subprocesses and what they leave: commands, checkpoints,
                         losses, free ports
  hf_models              tiny random Hugging Face Marian models and folders (torch, transformers)
  random_weights         one NumPy parameter draw over a model's initialised shapes
  numpy_reference        an independent float64 NumPy forward pass of the three models
  exact_match_reference  an independent greedy decoding and exact-match score of a run
  layout_reference       parameter trees flattened and re-laid out (unrolled <-> scanned) by NumPy
  hlo                    the instructions of a compiled XLA program that run on their own
                         (checks that a program holds no copy of a large array)
  tensorboard            the scalars of TensorBoard event files (local or gs://)
  sharded_decode         a script: decoding on 8 simulated devices (test_generate)
  multihost_worker       a script: one process of the multi-host input tests (test_multihost_data)
"""
