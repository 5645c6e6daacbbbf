"""Models larger than one device: tensor parallelism (tensor_parallel.py), weight-only int8
(quantize.py), and the memory plan that says whether a pair fits (memory.py, entry point
:func:`~model.scale.memory.plan`)."""
