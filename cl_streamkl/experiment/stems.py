"""The ways a model turns images into tokens (``--stem``), named without importing torch or timm.

:mod:`cl_streamkl.experiment.config` declares the option with these choices and
:mod:`cl_streamkl.experiment.model` builds them; both import the names from here.
"""

# patch: timm's patch projection; conv: early convolutions (cl_streamkl.experiment.conv_stem).
STEMS = ("patch", "conv")
