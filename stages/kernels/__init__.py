"""Triton kernels for memory-bound hot spots of our own step code, each beside its torch reference.

* cfg_step.py — CFG combine fused with the Euler / flow-matching update (the denoise commit)
* rmsnorm.py — RMSNorm (transformers' Llama-style: normalise in float32, cast, scale)
* adaln.py — LayerNorm fused with the adaLN modulation x * (1 + scale) + shift (DiT blocks)
* lora.py — the per-row LoRA update out + scale * B[slot] @ (A[slot] @ x) of gathered adapters (SGMV shrink / expand)
* patch.py — swaps the matching modules of a loaded model onto the kernels (opt-in: `fused_kernels`)

Every kernel runs natively on CUDA and, with TRITON_INTERPRET=1 set before triton is imported,
on CPU tensors (slowly: tests keep the shapes tiny). `use_triton=None` picks the kernel for CUDA
tensors and the reference elsewhere. Triton is imported only when a kernel runs.
"""
