"""Totals and their checks: assembling totals from sweeps (`assembly`), finite
differences (`differences`), `check_totals` and the helpers around it (`totals`), and
`check_operator` (`operator_check`).

May import `_compiler` and everything below it."""
