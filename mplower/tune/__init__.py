"""`mplower tune`: the fastest precision plan that meets the guardrails (docs/tune.md).

The layer above backend, report and onnx: it lowers a module under candidate plans through
the ordinary pass pipeline, runs each on evaluation inputs, prices it with the cost model and
searches for the plan with the highest modeled throughput (or inferences per joule) that meets
every guardrail. `evaluation` lowers and scores one plan, `cache` keys evaluations by content,
`distributed` runs them serially or on dask.distributed, `search` orders and grows plans,
`packet` writes the sheet, the lowered module, the release packet and the Pareto plot.
"""
