"""Reading a compiled program without running it, and pictures of runs: `collectives` (counts
from compiled HLO), `memory` (logical bytes per group), `measure` (measured timelines and costs),
`timeline` (PNG pictures and their command line)."""
