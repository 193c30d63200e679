"""The cluster simulator: tailrace's own Scheduler and policies driving cost-modelled engines and a
trainer under SimPy's virtual clock (DESIGN.md §2 "Simulator").

    hardware.py  Hardware presets (datasheet numbers + stated efficiencies); "cpu" from calibration
    models.py    ModelShape presets (parameter/KV/FLOP counts from config.json shapes)
    costs.py     CostModel: decode roofline, prefill, weight load/publish, train step
    segment.py   Segment: decode steps over a constant batch, summed in closed form
    lengths.py   response-length models (constant, lognormal with tail, empirical replay)
    engine.py    SimEngine: continuous batching, one event per request boundary
    cluster.py   SimCluster: the scheduler loop under SimPy
    recorder.py  metrics.jsonl / events.jsonl / journal.jsonl and the run summary
    scenario.py  Scenario (YAML), simulate(), scenario_from_run()

No torch, no processes, no wall clock (checked by .importlinter).
"""
