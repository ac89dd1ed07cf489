"""What the benchmark scripts share. The scripts import from here and from ``cl_streamkl``,
never from one another.

* :mod:`_harness.measure`: waiting for the device, timing a call, its memory, errors.
* :mod:`_harness.options`: command-line values (dtypes, shapes, the teacher's compile mode).
* :mod:`_harness.report`: the environment header, aligned table cells, the JSON file.
* :mod:`_harness.vit_training`: timm ViT training steps with and without distillation.
"""
