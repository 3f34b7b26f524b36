"""The mhc-pipe runtime: a DualPipe-style pipeline of mHC Transformer blocks on a DeviceMesh.

At the top: the model and its pieces (model; weight_grad, the deferred weight gradient of its linear layers;
partition into stages; data; single_process, the unsplit reference) and the torchrun entry (__main__). Below, by
role: device (the CUDA device layer, real or emulated), distributed (groups, P2P, collectives, errors),
observability (trace recorder, diagnostics), checkpoint (DCP save/resume), runtime (executing a schedule on a
rank), launch (run flags, local rank processes, host measurements). Each sub-package's docstring says what it may
import (tests/test_imports.py checks it).

A user's model: `user_model` (its pieces' contract), `user_reference` (its unsplit run), `user_materialise` (a
model built on the meta device, materialised per stage).
"""
