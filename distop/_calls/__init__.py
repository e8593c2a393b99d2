"""The objects XLA calls back into: one operator method (`host.HostCall`), several run
in one host call (`fused.FusedCall`), and one per iteration of a loop (`rolled.RolledCall`),
all behind `base.HostCallable`."""
