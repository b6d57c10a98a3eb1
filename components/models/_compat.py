"""Import torchtune 0.6.1 against torchao 0.18.

torchtune imports `torchao.dtypes.nf4tensor`, which torchao >= 0.16 moved; aliasing the old module name
is the only change torchtune's modules need. Every torchtune import in this project goes through here.
"""

import importlib
import sys

_NF4_OLD = "torchao.dtypes.nf4tensor"
_NF4_NEW = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"

if _NF4_OLD not in sys.modules:
    try:
        importlib.import_module(_NF4_OLD)
    except ImportError:
        sys.modules[_NF4_OLD] = importlib.import_module(_NF4_NEW)

import torchtune  # noqa: E402,F401  (must come after the alias)
