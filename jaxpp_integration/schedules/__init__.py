"""Pipeline schedules as data: the task vocabulary, the built-in schedules, one validator, one
simulator.

- `tasks.py`: `Phase`, `Task` (`fwd_3__0`), `FusedTask` and the dependency rules;
- `base.py`: the `Schedule` base class (placement, validation, the microbatch rule);
- `builtin.py`: `GPipe`, `Std1F1B`, `Eager1F1B`, `Interleaved1F1B`, `ZeroBubble`, `DualPipeV`
  and `schedule_from_name`;
- `user.py`: `UserSchedule`, a schedule given as data;
- `validation.py`: the validator and list-scheduling replay, with the rank x step error grid;
- `simulate.py`: the timed replay (makespan, bubble, live activations) and its cost model.

`from jaxpp_integration.schedules import Std1F1B, Phase, ...` gives the names of `builtin.py`
(which re-exports the others').
"""

from jaxpp_integration.schedules.builtin import *  # noqa: F403
from jaxpp_integration.schedules.builtin import __all__  # noqa: F401
