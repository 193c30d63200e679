"""The cluster simulator: tailrace's own Scheduler and policies driving cost-modelled engines and
trainers under SimPy's virtual clock (DESIGN.md §2 "Simulator").

    hardware.py  Hardware presets (datasheet numbers + stated efficiencies); "cpu" from calibration
    models.py    ModelShape presets (parameter/KV/FLOP counts from config.json shapes)
    costs.py     CostModel: decode roofline, prefill, weight load/publish, train step
    segment.py   Segment: decode steps over a constant batch, summed in closed form
    runs.py      Runs: run-length token/version sequences (exact, O(runs) memory)
    lengths.py   response-length models (constant, lognormal with tail, empirical replay)
    engine.py    SimEngine: continuous batching, one event per request boundary
    cluster.py   SimCluster: the schedulers' loop under SimPy (one policy, or several sharing the engines)
    recorder.py  metrics.jsonl / events.jsonl / journal.jsonl per policy, and the run summary
    scenario.py  Scenario (YAML), simulate(), scenario_from_run()
    compare.py   the same step figures read from a real and a simulated run directory
    metrics.py   length/staleness/interval helpers (DESIGN.md §5 definitions)

Calibration of the "cpu" presets lives outside (tailrace/calibrate/): it needs torch.

No torch and no processes (checked by .importlinter); time is SimPy's virtual clock (the wall clock only
times the simulator itself).
"""
