"""Trainers: the floor above the runtime, one module per trainer, each applying a plan at its
trainer's own seams.

Owns ``hf_trainer`` (``HyperrecipeTrainer``: the Hugging Face Trainer over an applied plan),
``trl`` (TRL's SFT and DPO trainers), ``accelerate`` (``HyperrecipeAccelerator``), ``lightning``
(``HyperrecipeStrategy``: Lightning's model-parallel strategy), ``torchtitan`` (torchtitan's
parallelize step) and ``trainer_mesh`` (which mesh dims a trainer may split batches and average
gradients over, read from the plan). They use the runtime's public entry points only; nothing in
the runtime or below imports them. Each imports its library at its top, so it is imported only by
the user who trains with it (``pip install 'hyperrecipe[trainers]'``).
"""
