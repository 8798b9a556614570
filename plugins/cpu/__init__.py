"""CPU kernels (C, AVX2 + FMA + F16C) for the decode step: linear.c, linear_int8.c (weight-only int8),
attention.c (fp32 / fp16 / bf16 K/V), topk.c (the ops' math),
elementwise.c (the decoder layer's RMSNorm), all wrapped by ops.py,
and residency.c (the lookahead runtime's slot planning and block copies, wrapped by
bookkeeping.py); loader.py builds them on first use, into a base library and an AVX-512 one (the
prefill GEMMs and W8A8: gemm.c, prefill.py), over the one C/Python boundary of lkv_abi.h (abi.py)."""
from .ops import (attention, attention_paged, attention_supported, available, block_topk, block_topk_supported,
                  linear, linear_int8, paged_mask, rms_norm)

__all__ = ["attention", "attention_paged", "attention_supported", "available", "block_topk", "block_topk_supported",
           "linear", "linear_int8", "paged_mask", "rms_norm"]
