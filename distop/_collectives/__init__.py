"""The built-in collective operators, one family per module: `basic`, `reductions`,
`rooted` and `halo`, with the block arithmetic they share (`blocks`).

May import `_operators` and everything below it."""
