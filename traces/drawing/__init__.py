"""Pictures of traces: the timeline with its per-rank breakdown (`view`: PNG/SVG), the self-contained interactive
HTML (`html_view`, with its page `html_view.html`), the overhead chart of a comparison (`overhead_chart`), the
schedule figure in DeepSeek's colours (`plot`), the critical path outlined on either (`path_marks`), a run of
hundreds of ranks as one pipeline in full and its other replicas summarised (`replica_summary`) and PNG writing
(`png`). matplotlib's Agg backend only.
"""
