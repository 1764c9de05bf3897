"""Reading a compiled program without running it, and pictures of runs: `report` (the public
report of a compiled step: tasks, transfers, values, memory events), `memory` (the memory events
and the logical bytes per group), `collectives` (counts from compiled HLO), `measure` (measured
timelines and costs), `timeline` (PNG pictures and their command line)."""
