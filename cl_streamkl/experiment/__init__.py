"""Continual-learning experiments: the ``cl-streamkl`` command line, data streams, run loop, outputs.

Needs the ``[experiment]`` extra (``pip install "cl-streamkl[experiment]"``). Only the
configuration is exported here, so that the command line answers ``--help`` without
importing Avalanche; the run loop is :func:`cl_streamkl.experiment.runner.run_experiment`.
"""

from cl_streamkl._extras import require_extra

require_extra(__name__, "experiment", {
    "avalanche": "avalanche-lib",
    "timm": "timm",
    "torchvision": "torchvision",
    "numpy": "numpy",
    "PIL": "pillow",
    "sklearn": "scikit-learn",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "scipy": "scipy",
    "mlxtend": "mlxtend",
    "psutil": "psutil",
    "filelock": "filelock",
    "yaml": "pyyaml",
})

from cl_streamkl.experiment.config import DEFAULT_STRATEGIES, STRATEGY_COMPONENTS, ExperimentConfig  # noqa: E402

__all__ = ["DEFAULT_STRATEGIES", "STRATEGY_COMPONENTS", "ExperimentConfig"]
