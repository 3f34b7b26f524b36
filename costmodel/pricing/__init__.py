"""Per-action prices of a layout: the `Pricer` and the `ProfilePricing` plug-in (`pricer`), its switches (`options`),
the overlapped F&B pair's timing (`fb_overlap`), data parallelism around the pipeline (`data_parallel`), which
blocks each stage holds, evenly, as the config says or cut by cost (`stage_split`), a Pricer whose prices many
layouts' pricers share (`shared_pricer`).

May import: the rooms of costmodel listed in costmodel/__init__.py before it (never costmodel.local).
"""
