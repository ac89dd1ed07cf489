"""What the benchmark scripts share. The scripts import from here and from ``cl_streamkl``,
never from one another.

* :mod:`_harness.measure`: waiting for the device, timing a call, its memory, errors.
* :mod:`_harness.options`: command-line values (dtypes, shapes, the teacher's compile mode).
* :mod:`_harness.report`: the environment header, aligned table cells, ``--json`` and the JSON
  file (by default under ``benchmarks/results/``).
* :mod:`_harness.kl_workloads`, :mod:`_harness.kl_checks`: the kernel benchmark's problems,
  implementations and its check against float64.
* :mod:`_harness.vit_training`: timm ViT training steps with and without distillation;
  :mod:`_harness.penalty_check` and :mod:`_harness.batch_search`: the end-to-end benchmark's
  penalty check and largest-batch search.
* :mod:`_harness.distributed`: the process group of a run under torchrun.
* :mod:`_harness.efficacy_tables`: the project study's own Markdown views (the generic tables live in
  :mod:`cl_streamkl.experiment.study.tables`).
"""
