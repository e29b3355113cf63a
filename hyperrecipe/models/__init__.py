"""Model libraries: the floor below the runtime, answering what the runtime asks of a model's
library (transformers today).

Owns ``transformers`` (attention dispatch, the causal-LM loss, initializers, checkpoint
conventions, the experts kernels' flag), ``hf_conversion`` (its checkpoint key conversions and
renames), ``hf_kernels`` (its compute kernels validate mode cannot run on DTensors, named before
apply), ``hf_plans`` (its models' own tensor-parallel plans, which ``suggest`` reads), ``hf_tiny``
(tiny configs of its families for ``suggest``) and ``torchtitan`` (torchtitan's model code built
as its flavors build it).
"""
