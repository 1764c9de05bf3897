"""The passes that turn a traced step into a scheduled, compiled program, in this order:
`unreduced` (option `gradient_reduction="step"`) -> `partition` (cut the loop body into stage
tasks) -> `placement` (work before and after the loop) -> `program` (unroll by schedule, transfers,
accumulator donation) -> `lifetimes` (in-place update of the after-loop tasks, deletes) ->
`compile` (one XLA executable per distinct task); `render` prints the program.
`jaxpp_integration.api.mpmd_jit_with_loop` runs them."""
