"""What a user asks: `predict` (time, overhead, memory of a config on a spec), its report (`prediction_report`),
`explain`, `honest` and `published_road` (`predict --explain`: the road to a published throughput),
`sensitivity` (`--sensitivity`), `tune` (the layout search), `tune_space` (its candidate layouts) and `tune_front`
(its answer: evaluated layouts, the Pareto front and its ties), `charts` (their pictures).

May import: the rooms of costmodel listed in costmodel/__init__.py before it (never costmodel.local).
"""
