"""The objects XLA calls back into: one operator method (`host.HostCall`, the runner of a
`spec.CallSpec`), several run in one host call (`fused.FusedCall`), and one per iteration
of a loop (`rolled.RolledCall`), all behind `base.HostCallable`; the checks of what a
method returns (`results`); their failure policy (`failure`); the FFI handler that runs
them (`ffi`), the numpy views of XLA's buffers it gives them (`views`), the copy of
XLA's FFI C API it reads (`xla_ffi`), and the tracing sessions
that bind lean calls (`sessions`).

May import `_agreement`, `_diagnostics`, `_safety`, `_mpi` and the leaf modules."""
