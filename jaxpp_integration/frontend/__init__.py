"""What a user's step is written with: stage markers, `treduce` and its reductions, `MpmdMesh`,
and `MpmdArray` (the values a compiled step returns). `jaxpp_integration.api` re-exports them."""
