"""Operators: the public `DistributedOperator` (`operator`), the primitive its calls bind
and its rules (`primitive`), the refusals of what cannot be differentiated (`refusals`,
`second_derivative`) and implicit operators (`implicit`).

May import `_hostcalls` and everything below it."""
