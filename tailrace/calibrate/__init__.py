"""`tailrace sim calibrate`: measure the real engine and trainer on this machine and fit the "cpu"
hardware preset of the simulator (tailrace/sim/hardware.py), saved as JSON that preset loads.

Outside tailrace/sim on purpose: it needs torch, the engine and the trainer; the simulator itself
only reads the JSON. Measured on the default model's shape (random weights cost what trained ones
do), one torch thread per role as on the testbed, once per dtype: fp32 (engine and trainer in fp32:
the "cpu" preset, cpu.json) and bf16 (a bf16 engine and a bf16-autocast trainer: "cpu-bf16",
cpu-bf16.json):

- decode: steps of the real `Engine` at batch 1..64 with forced lengths, fitted to the simulator's own
  form  step = overhead + per_seq * batch + max((weights + KV of the context) / bw, FLOPs / rate)
  (see `fit_decode`; efficiencies are folded into the fitted bw and rate);
- train: `GRPOTrainer.step` over synthetic groups; FLOPs per step (6N per token + attention) / time;
- weights: the shared-memory publish (one memcpy) and the engine's load of a version;
- checkpoint: the trainer worker's save after a publishing step (a real run's flow.checkpoint_every);
- the engine worker: the runtime's worker process fed as the driver feeds it; wall time between its
  steps that is not a step (its loop: pipe, requests, results) is `host_gap_s` per step, and its busy
  time per step beyond the decode fit's prediction, per running row, is added to the fit's per-row
  cost (`worker_excess`: sampling, stop checks, admissions' prefills grow with the rows);
- the driver: its real handling of an engine report (scoring, scheduler, journal) per report and per
  result (`driver_report_s`, `driver_result_s`: the simulator charges it to the engine's core while the
  trainer computes, as the unpinned driver process then runs there);
- co-running: decode steps alone and while a trainer computes on the other core (`corun_slowdown`).

Timing on a shared machine is noisy: every figure is the median of repeats, and the JSON records
the machine's load average at the time.
"""

from tailrace.calibrate.run import calibrate

__all__ = ["calibrate"]
