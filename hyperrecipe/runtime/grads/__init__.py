"""The trainer's side of the backward: gradients after the model's own autograd.

Owns ``grad_buckets`` (the plan's gradient buckets, one flat collective each, from
post-accumulate-grad hooks), ``grad_norm`` (the norm of the full gradients and clipping by it,
equal to one process on every rank), ``torch_clip_guard`` (torch's own ``clip_grad_norm_`` /
``get_total_norm`` handed that norm while an installation lives: the replacements, which
:mod:`hyperrecipe.process_patches` holds), ``scaler_guard`` (torch's ``GradScaler`` over the
shards: every rank skips the same steps), ``ddp_guard`` (refusing data parallel over ranks that
hold different shards), ``data_parallel`` (the DDP a trainer wraps with, leaving the buckets'
parameters to the buckets) and ``optimizer_kernels`` (validate mode's refusal of torch's multi-tensor
kernels over mixed DTensor / plain parameters). It installs no forward.
"""
