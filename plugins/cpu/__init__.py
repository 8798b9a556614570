"""CPU kernels (C, AVX2) for the decode step's memory-bound reads; see kernels.c and loader.py."""
from .ops import attention, attention_supported, available, block_topk, block_topk_supported, linear

__all__ = ["attention", "attention_supported", "available", "block_topk", "block_topk_supported", "linear"]
