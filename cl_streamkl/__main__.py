"""``python -m cl_streamkl``: the ``cl-streamkl`` command line."""

import sys

from cl_streamkl.experiment.cli import main

sys.exit(main())
