"""Integrations: every piece of knowledge of a third-party library by name.

Owns ``transformers`` (what the runtime asks of a transformers model: attention dispatch, the
causal-LM loss, initializers, checkpoint conventions, the experts kernels' flag),
``hf_conversion`` (its checkpoint key conversions and renames), ``hf_kernels``
(its compute kernels validate mode cannot run on DTensors, named before apply), ``hf_trainer``
(``HyperrecipeTrainer``: the Hugging Face Trainer over an applied plan), ``lightning``
(``HyperrecipeStrategy``: Lightning's model-parallel strategy applying a plan) and
``trainer_mesh`` (which mesh dims a trainer may split batches and average gradients over, read
from the plan). The runtime calls this room through small functions and never imports the
trainer modules; those import their library (``transformers.Trainer`` and accelerate,
``lightning``) at their top, so they are imported only by the user who trains with them
(``pip install 'hyperrecipe[trainers]'``). No runtime module names a transformers class, loss,
private attribute or module, or a trainer, itself (tests/test_layering.py keeps it so).
"""
