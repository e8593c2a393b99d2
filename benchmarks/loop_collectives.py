"""The built-in reductions in a time loop, against the same loop by hand (numpy + mpi4py).

`benchmarks/stencil.py --sections collectives` runs it: one job per rank count. The
state is this rank's block u of an n x n grid split by rows, S explicit steps in a
`lax.scan`, each step one built-in collective on a value of one number per rank:

- `AllreduceSum`: u <- u - dt e u, e = sum over every rank of sum(u * u), over N;
- `Allreduce(op="max")`: u <- u - dt u / m, m = the largest entry over every rank;
- `Allgather`: u <- u - dt (u - w . g / N), g every rank's sum(u), w fixed weights.

The objective is 0.5 ||u_S - d||^2 summed by `AllreduceSum`; the gradient is with
respect to u0. On one rank, `jax` is plain JAX: the same loop with every collective the
identity, `jax.jit` of the value and of `jax.grad`, no host call. The hand-written loop
makes one buffer `Allreduce` (or `Allgather`) per step forward, keeps every state, and
one `Allreduce` per step in its adjoint, the one the adjoint of a value every rank
shares takes. Every variant runs interleaved, call by call.
"""

import numpy as np

STEP = 0.1  # dt of every model


def weights(size):
    """**Returns:** the fixed weights of the `Allgather` model, one per rank."""
    return np.linspace(1.0, 2.0, size)


def models(steps, size, total_rows, n, plain=False):
    """**Returns:** {name: model(u, d)} of every collective, `steps` steps in a scan;
    `plain`: on one rank, plain JAX (each collective the identity on one rank's value)."""
    import jax.numpy as jnp
    from jax import lax

    import distop

    if plain:
        total = biggest = lambda v: v  # noqa: E731
        gather = lambda v: v[None]  # noqa: E731
    else:
        total, biggest, gather = distop.AllreduceSum(), distop.Allreduce(op="max"), \
            distop.Allgather()
    count, w = float(total_rows * n), jnp.asarray(weights(size))

    def by_sum(u):
        return u - STEP * total(jnp.sum(u * u)) / count * u

    def by_max(u):
        return u - STEP * u / biggest(jnp.max(u))

    def by_gather(u):
        return u - STEP * (u - jnp.dot(w, gather(jnp.sum(u))) / count)

    def looped(step):
        def model(u, d):
            u = lax.scan(lambda u, _: (step(u), None), u, None, length=steps)[0]
            f = total(0.5 * jnp.sum((u - d) ** 2))
            return f if plain else {"f": f}
        return model

    return {"AllreduceSum": looped(by_sum), "Allreduce max": looped(by_max),
            "Allgather": looped(by_gather)}


class HandLoop:
    """The three loops by hand: buffer collectives, every state kept for the adjoint.

    **Arguments:**
    - `comm`: the communicator; `u0`, `d`: this rank's blocks; `steps`: S;
      `total_rows`: the grid's rows over every rank.
    """

    def __init__(self, comm, u0, d, steps, total_rows):
        from mpi4py import MPI

        self.comm, self.u0, self.d, self.steps = comm, u0, d, steps
        self.sum, self.max = MPI.SUM, MPI.MAX
        self.count = float(total_rows * u0.shape[1])
        self.w = weights(comm.Get_size())
        self.states = np.empty((steps + 1,) + u0.shape)
        self.scalars = np.empty(steps + 1)  # e, m or w . g / N of each step
        self.one, self.got = np.empty(1), np.empty(1)
        self.every = np.empty(comm.Get_size())

    def _reduced(self, value, op):
        self.one[0] = value
        self.comm.Allreduce(self.one, self.got, op=op)
        return float(self.got[0])

    def forward(self, name):
        """Run the loop of `name`, keeping every state. **Returns:** u_S."""
        states, scalars = self.states, self.scalars
        states[0] = self.u0
        for k in range(self.steps):
            u, new = states[k], states[k + 1]
            if name == "AllreduceSum":
                e = scalars[k] = self._reduced(float(np.vdot(u, u)), self.sum) / self.count
                np.multiply(u, 1.0 - STEP * e, out=new)
            elif name == "Allreduce max":
                m = scalars[k] = self._reduced(float(u.max()) if u.size else -np.inf,
                                               self.max)
                np.multiply(u, 1.0 - STEP / m, out=new)
            else:
                self.one[0] = u.sum()
                self.comm.Allgather(self.one, self.every)
                c = scalars[k] = float(self.w @ self.every) / self.count
                np.multiply(u, 1.0 - STEP, out=new)
                new += STEP * c
        return states[self.steps]

    def value(self, name):
        u = self.forward(name)
        return self._reduced(0.5 * float(((u - self.d) ** 2).sum()), self.sum)

    def gradient(self, name):
        """**Returns:** this rank's block of the gradient (a new array)."""
        states, scalars, rank = self.states, self.scalars, self.comm.Get_rank()
        u_bar = self.forward(name) - self.d
        for k in reversed(range(self.steps)):
            u = states[k]
            if name == "AllreduceSum":
                e_bar = self._reduced(float(np.vdot(u_bar, u)), self.sum)
                u_bar = u_bar * (1.0 - STEP * scalars[k]) \
                    - (2.0 * STEP / self.count * e_bar) * u
            elif name == "Allreduce max":
                m = scalars[k]
                m_bar = self._reduced(float(np.vdot(u_bar, u)), self.sum) * STEP / m ** 2
                u_bar = u_bar * (1.0 - STEP / m)
                if u.size and u.max() == m:  # (this rank holds the largest entry)
                    u_bar.flat[int(np.argmax(u))] += m_bar
            else:
                c_bar = self._reduced(float(u_bar.sum()), self.sum) * STEP
                u_bar = u_bar * (1.0 - STEP) + c_bar * self.w[rank] / self.count
        return u_bar


def worker(args, rows_of, interleaved, report):
    """Times of every collective's loop, distop against by hand, on every rank; rank 0
    prints the result (`rows_of`, `interleaved`, `report`: `stencil.py`'s)."""
    import jax
    from mpi4py import MPI

    import distop

    jax.config.update("jax_enable_x64", True)
    comm = MPI.COMM_WORLD
    size, rank, n, steps = comm.Get_size(), comm.Get_rank(), args.size, args.steps
    rng = np.random.default_rng([rank, n, 1])
    rows = rows_of(n, size, rank)
    start = sum(rows_of(n, size, r) for r in range(rank))
    u0 = 1.0 + 0.1 * rng.standard_normal((rows, n))
    d = rng.standard_normal(u0.shape)
    hand = HandLoop(comm.Dup(), u0, d, steps, n)
    variants, err = {}, 0.0
    for name, model in models(steps, size, n, n).items():
        made = distop.Problem(lambda u, model=model: model(u, d), {"u": u0},
                              distributed={"u"})

        def grad(made=made):
            return made.compute_totals("f", "u")["f", "u"]

        variants[f"{name} run"], variants[f"{name} grad"] = made.run, grad
        variants[f"{name} hand run"] = lambda name=name: hand.value(name)
        variants[f"{name} hand grad"] = lambda name=name: hand.gradient(name)
        exact_f, exact_g = hand.value(name), hand.gradient(name)
        mine = np.asarray(grad()).reshape(n, n)[start:start + rows]
        err = max(err, abs(float(np.asarray(made.run()["f"])) - exact_f) / abs(exact_f),
                  float(np.max(np.abs(mine - exact_g), initial=0.0))
                  / float(np.max(np.abs(exact_g))))
    if size == 1:  # plain JAX: what XLA's loop costs without any host call
        device_u0 = jax.device_put(u0)
        for name, model in models(steps, size, n, n, plain=True).items():
            value = jax.jit(lambda u, model=model: model(u, d))
            gradient = jax.jit(jax.grad(lambda u, model=model: model(u, d)))
            variants[f"{name} jax run"] = lambda f=value: f(device_u0).block_until_ready()
            variants[f"{name} jax grad"] = lambda f=gradient: f(device_u0).block_until_ready()
    result = interleaved(comm, variants, args.repeat)
    result["err"] = comm.allreduce(err, op=MPI.MAX)
    report(comm, result, args)


def rows(results, fmt, ratio):
    """**Returns:** the table's rows from `results` (keyed "collectives P")."""
    found = []
    for key, r in results.items():
        if not key.startswith("collectives "):
            continue
        for name in ("AllreduceSum", "Allreduce max", "Allgather"):
            found.append([key.split()[1], name, fmt(r[f"{name} hand run"], "ms"),
                          fmt(r[f"{name} run"], "ms"),
                          fmt(ratio(r[f"{name} run"], r[f"{name} hand run"]), "x"),
                          fmt(r[f"{name} hand grad"], "ms"), fmt(r[f"{name} grad"], "ms"),
                          fmt(ratio(r[f"{name} grad"], r[f"{name} hand grad"]), "x"),
                          fmt(r.get(f"{name} jax run"), "ms"),
                          fmt(r.get(f"{name} jax grad"), "ms"), fmt(r["err"], "e")])
    return found
