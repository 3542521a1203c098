"""moela's attention kernels, one file per kernel family; `moela.ops.attention.phases` chooses which runs each phase.

- worklist.py: the work list every kernel launches over (documents' blocks, costliest first), built on the device.
- triton_common.py: the Triton kernels' launch table and shared @triton.jit helpers (and their design decisions).
- triton_forward.py, triton_backward.py: the Triton forward, and the backward's preprocess, dK/dV and dQ kernels;
  any CUDA GPU, any dtype, head dims up to 256, ALiBi; tested under TRITON_INTERPRET=1.
- gluon_common.py: what the Gluon (sm_90) kernels share: the `supports` rule, TMA descriptors, @gluon.jit helpers.
- gluon_forward.py, gluon_dq.py, gluon_dkdv.py: warp-specialized Hopper kernels of the forward, dQ and dK/dV.
"""
