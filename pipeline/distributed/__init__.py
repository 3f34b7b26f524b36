"""How ranks talk: the DeviceMesh layout and its process groups (layout), point-to-point channels (p2p, with the
host-staged loopback and the NCCL-rules strict transport), posted async work and its waits (comm), blocking
collectives (collective), the data- and expert-parallel gradient reduction (grad_reduce) with the sums of a user
model's tied parameters over their holders (tied), the MoE all-to-all
(expert), and the one-line errors every bounded wait raises (errors).

May import: device (the CUDA device layer below it) and nothing else of pipeline (runtime, checkpoint, observability
and launch build on it).

Also: `p2p_protocol` (the P2P transport and gradient sink the executor is given), `group_plan` (the groups a layout
makes, without making them), `warmup` (the start-up connection walk),
`strict_transport` (gloo P2P under NCCL's rules), `op_ledger` (the action each posted op carried), `nccl_memory`
(NCCL buffers per rank).
"""
