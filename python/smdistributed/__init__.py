"""An alias package shipped with smp so SMP v1 scripts run unchanged.

`import smdistributed.modelparallel.torch as smp` gives smp itself, and every submodule
`smdistributed.modelparallel.torch.X` is `smp.X` (e.g. `.nn.FusedLayerNorm`,
`.nn.huggingface.gpt2`). transformers' Trainer takes its SMP path only when this package
is importable (and SageMaker's SM_HP_MP_PARAMETERS / SM_FRAMEWORK_PARAMS are set).
"""
