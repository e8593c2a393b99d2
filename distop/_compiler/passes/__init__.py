"""Program passes: the rewrites of a proven lean program, each in one module behind
`base.Pass`, run in order by `.._compiler.pipeline.lean_program`.

May import `.._compiler.jaxprs`, `_operators`, `_hostcalls` and everything below them."""
