"""kbit_hf: K-bit (K = 2, 3, 4, 5) codebook weight quantization for Hugging Face Transformers.

`import kbit_hf` registers the quantization method "kbit" with transformers, so that
`AutoModelForCausalLM.from_pretrained(path, quantization_config=kbit_hf.KbitConfig(k=4))` quantizes on load and
kbit checkpoints load back without re-quantizing.
"""

from . import ops  # the torch.ops.kbit.* custom ops (reference implementations)
from .backends import cpu as _cpu, cuda as _cuda
from .config import KbitConfig
from .modules import KbitLinear, KbitMoE
from .quantizer import KbitHfQuantizer
from ._register import register

__version__ = "0.1.0"

_cuda.register()  # the compiled CUDA kernels where the library is present
_cpu.register()  # the compiled CPU kernels where the library is present
register()

__all__ = ["KbitConfig", "KbitHfQuantizer", "KbitLinear", "KbitMoE", "register", "__version__"]
