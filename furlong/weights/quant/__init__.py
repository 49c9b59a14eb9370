"""Low-precision weights for rollout engines: FP8 (128x128 blocks), MXFP8, NVFP4 and INT4 weight-only.

- `codecs`   element and scale codecs (e4m3, e2m1, e8m0, nibble packing), no float8/float4 arithmetic
- `formats`  each format's quantise/dequantise pair on a 2-D fp32 weight
- `tensor`   `QuantizedTensor` and `quantize(t, fmt)`, the entry point
- `linear`   `QuantLinear` (computes with a QuantizedTensor) and `quantize_model_linears`
- `payload`  which parameters are quantised (`quantizable`, shared by sender and engine) and how codes +
             scales travel in a sync (`name@fmt.role`, `quantize_for_sync`)

On CPU every format is emulated: the linear dequantises per block and runs an fp32 (or model-dtype)
matmul. Nothing here needs torchao. The engine serves them with `engine.quantization`
(`furlong/engine/quantized.py`).
"""

from furlong.weights.quant.linear import QuantLinear, quantize_model_linears
from furlong.weights.quant.tensor import FORMATS, QuantizedTensor, quantize

__all__ = ["FORMATS", "QuantizedTensor", "quantize", "QuantLinear", "quantize_model_linears"]
