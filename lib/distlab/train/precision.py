"""The precisions of :mod:`distlab.train`'s step."""
import torch

# precision -> (parameter/compute dtype, autocast dtype or None)
PRECISIONS = {"fp64": (torch.float64, None), "fp32": (torch.float32, None),
              "bf16": (torch.bfloat16, torch.bfloat16), "fp16": (torch.float16, torch.float16)}
