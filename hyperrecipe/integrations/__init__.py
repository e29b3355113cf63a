"""Integrations: every piece of knowledge of a third-party library by name.

Owns ``transformers`` (what the runtime asks of a transformers model: attention dispatch, the
causal-LM loss, initializers, checkpoint conventions, the experts kernels' flag) and
``hf_conversion`` (its checkpoint key conversions and renames). The runtime calls this room
through small functions; no runtime module names a transformers class, loss, private attribute
or module itself (tests/test_layering.py keeps it so). Trainer integrations (Lightning, the
Hugging Face Trainer, accelerate, torchtitan) belong here too, each in its own module, imported
only by the user who uses that trainer.
"""
