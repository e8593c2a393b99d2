"""Kinds of values across ranks, inferred when a function is traced: the walk of its
jaxpr (`analysis`), the function run again with `vary` at the places it finds (`emit`),
and the public transform with the constants' agreement (`transform`).

May import `_collectives`, `_compiler.jaxprs` and everything below them."""
