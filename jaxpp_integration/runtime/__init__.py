"""Running a compiled program: `executor` walks its instructions and dispatches them, `fills`
makes accumulators on the devices, `transfer` moves values between processes, `fetch` reads
values on the host, `reshard` turns pipelined values into global arrays, `watchdog` reports a
hang across processes."""
