"""The training loop and its state.

    loop.py        accumulation windows, token-normalised loss, clipping, logging, evaluation, SIGTERM
    optim.py       AdamW (or 8-bit) parameter groups and the LR schedules
    checkpoint.py  atomic checkpoints, manifests, the run shape, auto-resume, full disks
    accelerator_state.py  accelerate's save_state/load_state, tensor-parallel weights and optimizer through DCP
    samples.py     greedy sample generations at each evaluation (every rank in step)
    handover.py    what a finished run hands the user: sample, export, card and plots, Hub upload
"""
