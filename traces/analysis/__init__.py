"""What a trace says: steps (`step_select`, `step_keys`: each span's step as integer arrays, `matching`: warm-up, spans
matched across traces), the dependency graph of one step (`span_graph` from `span_nodes`, `stage_chains`,
`transfers`, `receive_wait`; a data-parallel run one pipeline at a time, `replicas`), its replay and critical path
(`replay`, `critical_path`; `sim_path`: a simulated step's, on the path's ops alone), what-if replays (`whatif`; its
steps spread over processes by `step_pool`), communication under compute (`overlap_stats`, `comm_overlap`), the
communication replayed under NCCL's rules (`comm_replay`), a trace's time budget per step (`time_stats`, on columns),
predicted against measured (`compare`, `path_overhead`) and the text of these reports (`report`, `path_report`).

`cuda_replay`: the emulated CUDA device's programs under CUDA's and NCCL's rules (`check-comm --cuda`), with
`cuda_hazards` (rule 8: storages released before their NCCL launch was known done).
"""
