"""Defaults shared by every config: the paper's optimizer and loss, loop cadence, mesh."""

import ml_collections


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.task = "synthetic"
    c.seed = 0

    # Optimizer: Adam(0.9, 0.98, 1e-9) and the paper's warmup / inverse-square-root schedule.
    c.optimizer = "adam"
    c.schedule = "noam"  # "noam" | "cosine" | "linear" | "constant"
    c.learning_rate = 1.0  # noam: multiplier of d_model^-0.5 * min(...); else the peak rate
    c.warmup_steps = 4000
    c.b1, c.b2, c.eps = 0.9, 0.98, 1e-9
    c.weight_decay = 0.0  # adamw and muon: matrices and embeddings (optim.decayed)
    c.grad_clip_norm = 0.0  # 0 = off
    c.grad_accum_steps = 1
    c.label_smoothing = 0.1
    # R-Drop (Liang et al., 2021): > 0 runs each training row twice under different dropout
    # masks (twice the compute per step) and adds rdrop_alpha / 2 x the symmetric KL between
    # the two predictions to the mean of their losses (train.loss_sums); 0 = off. The paper
    # uses 5 for translation.
    c.rdrop_alpha = 0.0
    c.skip_nonfinite_steps = False

    # Loop cadence.
    c.num_train_steps = 1000
    c.log_every = 50
    c.eval_every = 500
    c.checkpoint_every = 500
    c.keep_checkpoints = 3
    c.decode_eval = True  # exact match / BLEU by greedy decoding at each evaluation

    # Resuming a workdir: fields (comma-separated, as a resume error names them) that may differ
    # from the run's saved config.json besides the always-safe ones (preflight.SAFE_CHANGES).
    c.allow_changes = ""
    # Resume from this checkpoint step instead of the newest readable one (None: the newest);
    # the newer steps are moved to checkpoints-set-aside/ and trained again.
    c.restore_step = ml_collections.config_dict.placeholder(int)
    # A wall-clock budget in minutes instead of num_train_steps (None: off): the run measures
    # its own pace and decides its step count at its first evaluation, so the schedule anneals
    # to zero at the budget on any machine (flaxformer_lite/training/time_budget.py).
    c.time_budget_minutes = ml_collections.config_dict.placeholder(float)

    # Devices: (data, fsdp, tensor); -1 fills the remaining devices.
    c.mesh_shape = (-1, 1, 1)
    # A CPU host split into this many XLA devices before JAX starts (None: JAX's default, one):
    # the mesh runs the batch data-parallel over them, each on its own thread
    # (core/sharding.py: use_cpu_devices). GPUs and TPUs are unaffected.
    c.cpu_devices = ml_collections.config_dict.placeholder(int)
    # One device's peak FLOP/s, the denominator of the MFU a run logs (None: measured at start
    # by a jitted matmul in the compute dtype, about half a second on 2 CPU cores). Set it to
    # the vendor's figure to report MFU against the datasheet, as is usual on accelerators
    # (e.g. 197e12 for a TPU v5e in bfloat16, 989e12 for an H100 SXM in bfloat16).
    c.peak_flops = ml_collections.config_dict.placeholder(float)

    # Model: TransformerConfig fields (vocabulary sizes come from the data).
    c.model = ml_collections.ConfigDict(
        dict(
            d_model=512,
            num_heads=8,
            d_ff=2048,
            num_encoder_layers=6,
            num_decoder_layers=6,
            dropout_rate=0.1,
        )
    )
    return c
