"""python benchmarks/xla_loops.py [--steps 25 50 100] [--repeat 9]

XLA's reverse loop with a host call in its body, without distop: the gradient of a
`lax.scan` whose nonlinear step, u <- u - dt u / max(u), keeps a stack of every state
for the reverse loop, on a 96 x 96 grid in one process, at several step counts.

Variants, each the same JAX code but for what `max(u)` passes through:
- `plain`: nothing;
- `ffi`: a no-op XLA FFI call (a ctypes handler that copies its operand), in a
  `jax.custom_vjp` whose backward pass makes the same call: no distop code at all;
- `distop`: `distop.Allreduce(op="max")` in a `Problem`, its gradient by
  `compute_totals`.

Per step the work is the same at every step count, so a time that grows faster than
the steps is the loop's own: the table shows each variant's time per step.
"""

import argparse
import ctypes as C
import statistics
import time

import numpy as np

STEP = 0.1
TARGET = "distop_bench_copy"


def ffi_identity():
    """**Returns:** a differentiable identity made of a no-op FFI call (the handler
    registered with XLA as distop registers its own, copying its operand's bytes), whose
    VJP makes the same call on the cotangent."""
    import jax
    import jax.numpy as jnp

    from distop._hostcalls import ffi
    from distop._hostcalls.xla_ffi import DTYPES, EXECUTE, METADATA, Buffer, CallFrame

    data = Buffer.data.offset

    def handler(frame_pointer):
        frame = frame_pointer.contents
        extension = frame.extension_start
        if extension and extension.contents.type == METADATA:
            ffi._answer(frame_pointer, extension)  # (the check distop makes too)
            return None
        if frame.stage == EXECUTE:
            given, made = frame.args.values[0], frame.rets.values[0]
            b = Buffer.from_address(made)
            size = np.dtype(DTYPES[b.dtype]).itemsize
            for i in range(b.rank):
                size *= b.dims[i]
            C.memmove(C.c_void_p.from_address(made + data).value,
                      C.c_void_p.from_address(given + data).value, size)
        return None

    ffi_identity.handler = C.CFUNCTYPE(C.c_void_p, C.POINTER(CallFrame))(handler)  # (kept)
    jax.local_devices(backend="cpu")
    jax.ffi.register_ffi_target(
        TARGET, jax.ffi.pycapsule(C.cast(ffi_identity.handler, C.c_void_p).value),
        platform="cpu")

    def call(x):
        return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    @jax.custom_vjp
    def identity(x):
        return call(x)

    identity.defvjp(lambda x: (call(x), None), lambda _, g: (call(g),))
    return lambda x: identity(jnp.asarray(x))


def gradients(steps, u0, d):
    """**Returns:** {variant: a function computing the gradient}, `steps` steps."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    import distop

    def loss(u, through):
        u = lax.scan(lambda u, _: (u - STEP * u / through(jnp.max(u)), None), u, None,
                     length=steps)[0]
        return 0.5 * jnp.sum((u - d) ** 2)

    found, device_u0 = {}, jax.device_put(u0)
    for name, through in (("plain", lambda v: v), ("ffi", ffi_identity.made)):
        grad = jax.jit(jax.grad(lambda u, through=through: loss(u, through)))
        found[name] = lambda grad=grad: grad(device_u0).block_until_ready()
    biggest, total = distop.Allreduce(op="max"), distop.AllreduceSum()
    problem = distop.Problem(lambda u: {"f": total(loss(u, biggest))}, {"u": u0},
                             distributed="u")
    found["distop"] = lambda: problem.compute_totals("f", "u")
    return found


def main(argv=None):
    import jax

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--steps", type=int, nargs="+", default=[25, 50, 100])
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    ffi_identity.made = ffi_identity()
    rng = np.random.default_rng(0)
    u0, d = 1.0 + 0.1 * rng.standard_normal((96, 96)), rng.standard_normal((96, 96))
    print("# the gradient of a scan that keeps a stack of its states, one process: time "
          f"per step (us), median of {args.repeat} calls")
    print(f"{'steps':>6} {'plain':>9} {'ffi':>9} {'distop':>9}")
    for steps in args.steps:
        variants = gradients(steps, u0, d)
        times = {name: [] for name in variants}
        for fn in variants.values():
            fn()
        for _ in range(args.repeat):
            for name, fn in variants.items():
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
        per_step = {k: 1e6 * statistics.median(v) / steps for k, v in times.items()}
        print(f"{steps:>6} {per_step['plain']:>9.1f} {per_step['ffi']:>9.1f} "
              f"{per_step['distop']:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
