"""Integrations: every piece of knowledge of a third-party library by name.

Owns ``hf_conversion`` (transformers' checkpoint key conversions and renames) and ``hf_kernels``
(transformers' compute kernels validate mode cannot run on DTensors, named before apply). The runtime calls
this room through small functions; the aim (docs/architecture.md) is that no runtime module
names a transformers class, loss or kernel string itself.
"""
