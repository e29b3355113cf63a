"""Integrations: every piece of knowledge of a third-party library by name.

Owns ``hf_conversion`` (transformers' checkpoint key conversions and renames). The runtime calls
this room through small functions; the aim (docs/architecture.md) is that no runtime module
names a transformers class, loss or kernel string itself.
"""
