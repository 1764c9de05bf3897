"""The passes that turn a traced step into a scheduled, compiled program, in this order:
`reduction_plan` + `unreduced` (option `gradient_reduction`: sums over batch rows deferred, or
reduce-scattered per layer; `rows` tracks which dimension holds the rows) -> `partition` (cut
the loop body into stage tasks) -> `placement` (work before and after the loop) -> `program`
(unroll by schedule, transfers, accumulator donation) -> `lifetimes` (in-place update of the
after-loop tasks, deletes) -> `compile` (one XLA executable per distinct task, cut at its layer
scans by `blocks`; a stacked gradient added into its accumulator inside its scan:
`scan_accumulate`); `render` prints the program.
`jaxpp_integration.api.mpmd_jit_with_loop` runs them."""
