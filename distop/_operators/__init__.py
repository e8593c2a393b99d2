"""Operators: the public `DistributedOperator` with its primitive and rules
(`operator`), the refusals of what cannot be differentiated (`refusals`,
`second_derivative`) and implicit operators (`implicit`).

May import `_hostcalls` and everything below it."""
