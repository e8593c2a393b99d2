"""Program passes: the rewrites of a proven lean program, each in one module behind
`base.Pass`, run in order by `pipeline.lean_program`, then loops and segments."""
