"""The training loop and its state.

    loop.py        runs steps: accumulation windows, token-normalised loss, clipping, the throughput window,
                   when a step saves (cadence, clock, SIGTERM); takes (Run, state, hooks, log)
    hooks.py       what runs between steps, one protocol: metrics line, replica check, evaluation, samples,
                   checkpoint, lm-eval on it, progress
    optim.py       AdamW (or 8-bit) parameter groups and the LR schedules
    checkpoint.py  atomic checkpoints, manifests, the run shape, auto-resume, full disks
    accelerator_state.py  accelerate's save_state/load_state, tensor-parallel weights and optimizer through DCP
    samples.py     greedy sample generations at each evaluation (every rank in step)
    handover.py    what a finished run hands the user: sample, export, card and plots, Hub upload
"""
