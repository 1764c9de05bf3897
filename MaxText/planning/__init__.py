"""Planning a run before launch, and the trainer's `auto` keys.

- `cost_model.py`: one configuration's plan (per-group memory, predicted step time) from the
  trainer's step compiled on abstract inputs;
- `auto.py`: the `auto` keys (schedule, microbatches, stage split, remat) decided from plans;
- `stage_balance.py`, `remat_choice.py`, `schedule_choice.py`: the three choices;
- `hardware.py`: accelerator presets; `flops.py`: model FLOPs per step and MFU.
- `moe_costs.py`: a mixture of experts' cost formulas; `moe_report.py`: its plan terms read
  off the compiled step.

`python -m MaxText.plan` is the command line.
"""
