"""The priced schedule as it runs: the overlapped F&B stage (`fb_stage`) and what a simulated step is made of
(`step_anatomy`).

May import: the rooms of costmodel listed in costmodel/__init__.py before it (never costmodel.local).
"""
