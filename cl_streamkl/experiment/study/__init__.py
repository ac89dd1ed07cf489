"""``cl-streamkl study``: equal-effort tuning, paired and Holm-corrected comparisons, and
pre-registered confirmation, driven by a plan file.

* :mod:`~cl_streamkl.experiment.study.plan`: the plan file, its checks, fingerprint and units;
  :mod:`~cl_streamkl.experiment.study.plan_checks`: the plan's shapes and ``settings_from``'s seeds.
* :mod:`~cl_streamkl.experiment.study.comparisons`: the Holm family and the hypotheses' verdicts.
* :mod:`~cl_streamkl.experiment.study.registration`: pre-registering a confirmatory plan.
* :mod:`~cl_streamkl.experiment.study.units`, :mod:`~cl_streamkl.experiment.study.rates`: running
  units in worker processes under a deadline, and how long they take.
* :mod:`~cl_streamkl.experiment.study.report`, :mod:`~cl_streamkl.experiment.study.tables`,
  :mod:`~cl_streamkl.experiment.study.outputs`: the report, its Markdown tables and its plot.
* :mod:`~cl_streamkl.experiment.study.files`: strict plan files, reports and safe archives;
  :mod:`~cl_streamkl.experiment.study.carry_checks`: the records an archive or a report carries;
  :mod:`~cl_streamkl.experiment.study.spent`: what an archive leaves out.
* :mod:`~cl_streamkl.experiment.study.start_checks`: the folders, device and data of a start, and
  its lock on ``--out``.
* :mod:`~cl_streamkl.experiment.study.command`: the command line.
"""
