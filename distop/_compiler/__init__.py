"""From a model to programs: tracing (`tracing`), layouts (`layout`), schedules
(`schedule`), the programs themselves (`programs`) and the packing of their results
(`packing`); the rewrites of a lean program (`passes`), the stages that run after them
(`stages`), both read jaxprs through `jaxprs` and are run in order by `pipeline`.

May import `_operators`, `_hostcalls` and everything below them (not `_collectives`).
Inside, `jaxprs` sits below `stages`, `stages` below `passes`, and the rest above them.
`jaxprs` imports only `_hostcalls` and what lies below it, and sits below `_inference`
too, which walks a traced model with it.
"""
