"""What things cost in isolation: hardware specs (`hardware`) and the runtime-profile data a `local` spec may carry
(`runtime_profile`), per-op work (`ops`, `mhc_cost`: the residual variants' kernels), communication (`comm_cost`:
P2P, all-to-all, all-reduce), memory per rank (`memory`).

May import: the rooms of costmodel listed in costmodel/__init__.py before it (never costmodel.local).
"""
