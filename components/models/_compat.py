"""Import torchtune 0.6.1 against torchao 0.18.

torchtune imports `torchao.dtypes.nf4tensor`, which torchao >= 0.16 moved; aliasing the old module name
is the only change torchtune's modules need. Every torchtune import in this project goes through here.
"""

import importlib
import logging
import sys

import torch

# Import-time noise users cannot act on: torch's pytree deprecation notes for torchao's enums, and (on builds
# without CUDA) torchao's warnings that its optional CUDA kernels did not load. `--debug` logging still shows
# them when configured before this import.
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
if not torch.cuda.is_available():
    logging.getLogger("torchao").setLevel(logging.ERROR)

_NF4_OLD = "torchao.dtypes.nf4tensor"
_NF4_NEW = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"

if _NF4_OLD not in sys.modules:
    try:
        importlib.import_module(_NF4_OLD)
    except ImportError:
        sys.modules[_NF4_OLD] = importlib.import_module(_NF4_NEW)

import torchtune  # noqa: E402,F401  (must come after the alias)
