"""CPU stand-in for ``sgl_kernel``: see ``hyflow_cpu_shim.py`` beside this folder."""

import sys

import hyflow_cpu_shim

hyflow_cpu_shim.fill(sys.modules[__name__])
__version__ = "0.0.0+hyflow.cpushim"
