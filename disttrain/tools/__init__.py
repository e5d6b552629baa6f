"""Tools for users, each `python -m disttrain.tools.<name>` and a Make target.

    doctor.py     `make doctor`: the machine before a run (commbench.py: the torchrun'd all_reduce sweep)
    diagnose.py   `make diagnose`: the failure class of a finished or dead run, from its logs
    cost.py       `make cost`: FLOPs, time, money and memory fit per strategy
    preflight.py  `make preflight`: a recipe on a shrunk model of its architecture, on CPU processes
    tiny.py       the tiny local model, tokenizer and synthetic data of the default run
"""
